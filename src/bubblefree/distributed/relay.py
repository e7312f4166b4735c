"""The statistics of a step, gathered without a pipeline-wide collective.

Each stage keeps, per step, the sum of its microbatch losses (the last stage) and of its MoE balancing
losses. When a stage ends a step (:meth:`StepRelay.end_step`) it receives the partial statistics of the
stages after it, adds its own (over its replicas, then divided by the global number of microbatches ``m``)
and sends them on towards stage 0, travelling with the last gradient of the step. Stage 0 of replica 0 holds
the step's :class:`~bubblefree.train.executor.StepStats`: loss, gradient norm (the root of the stages' summed
squared norms), balancing loss and learning rate, and what a person watching the run reads per stage: its
busy and window seconds (:meth:`~bubblefree.distributed.trace.Tracer.window`) and its peak memory
(:mod:`~bubblefree.distributed.memory`), each stage writing its own slots (replica 0's stages: every
replica's relay ends at its own stage 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from bubblefree.distributed.mesh import Mesh
from bubblefree.distributed.p2p import P2P
from bubblefree.train.executor import StepStats

__all__ = ["StepRelay"]

_N_STATS = 3  # loss, squared gradient norm, MoE balancing loss; then busy, window and peak bytes per stage


class StepRelay:
    """One rank's per-step sums and its part of the relay towards stage 0 (see module doc)."""

    def __init__(self, mesh: Mesh, p2p: P2P, n_microbatches: int):
        self.mesh, self.p2p, self.m = mesh, p2p, n_microbatches
        self._loss_sum: dict[int, Tensor] = {}  # step -> sum of its microbatch losses (last stage)
        self._aux_sum: dict[int, Tensor] = {}  # step -> sum of this stage's balancing losses
        self._stats: dict[int, StepStats] = {}

    def add_loss(self, step: int, loss: Tensor) -> None:
        """Add microbatch losses (a float64 tensor: no device sync) to the step's sum."""
        self._loss_sum[step] = self._loss_sum.get(step, 0.0) + loss

    def add_aux(self, step: int, aux: Tensor | float) -> None:
        """Add a balancing-loss sum (``models.aux_loss_sum``; a plain 0.0 for a stage without MoE layers)."""
        if isinstance(aux, Tensor):
            self._aux_sum[step] = self._aux_sum.get(step, 0.0) + aux

    def end_step(self, step: int, norm: float, lr: float, *, busy: tuple[float, float] = (0.0, 0.0),
                 peak: int | None = None) -> None:
        """Add this stage's numbers (gradient norm ``norm``; ``busy``: its busy and window seconds since its
        last step; ``peak``: its peak bytes, None if unknown) to the statistics of ``step``, pass them on."""
        mesh, device, P = self.mesh, self.mesh.device, self.mesh.stages
        n = _N_STATS + 3 * P
        incoming = None if mesh.is_last else self.p2p.recv((n,), torch.float64, mesh.global_rank(mesh.stage + 1))
        stats = torch.zeros(n, dtype=torch.float64) if incoming is None else incoming.cpu()
        s = _N_STATS + mesh.stage
        stats[s], stats[s + P], stats[s + 2 * P] = busy[0], busy[1], -1.0 if peak is None else float(peak)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        local = torch.stack([torch.as_tensor(self._loss_sum.pop(step, zero)).double(),
                             torch.as_tensor(self._aux_sum.pop(step, zero)).double()]).to(device)
        if mesh.dp_group is not None:  # the replica's microbatches -> all m of the step
            dist.all_reduce(local, group=mesh.dp_group)
        local = local.cpu() / self.m
        stats[0] += local[0]
        stats[1] += norm * norm
        stats[2] += local[1]
        if not mesh.is_first:
            self.p2p.send(stats.to(device), mesh.global_rank(mesh.stage - 1))
        elif mesh.replica == 0:
            per_stage = stats[_N_STATS:].view(3, P).tolist()
            self._stats[step] = StepStats(loss=float(stats[0]), grad_norm=float(stats[1]) ** 0.5,
                                          aux_loss=float(stats[2]), lr=lr, busy_s=tuple(per_stage[0]),
                                          window_s=tuple(per_stage[1]),
                                          peak_bytes=tuple(None if b < 0 else int(b) for b in per_stage[2]))

    def pop(self, step: int) -> StepStats | None:
        """The finished statistics of ``step`` (on stage 0 of replica 0; None elsewhere)."""
        return self._stats.pop(step, None)

    def forget_from(self, step: int) -> None:
        """Drop the partial sums of ``step`` and later (forwards a drain abandoned)."""
        self._loss_sum = {k: v for k, v in self._loss_sum.items() if k < step}
        self._aux_sum = {k: v for k, v in self._aux_sum.items() if k < step}
