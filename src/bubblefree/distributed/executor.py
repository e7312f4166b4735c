"""DistributedExecutor: one process per pipeline stage (and per data-parallel replica) on torch.distributed.

* ``gpipe``, ``1f1b``, ``sync`` and the synchronous phases of the others run the stock
  ``torch.distributed.pipelining`` schedules (``ScheduleGPipe``, ``Schedule1F1B``); they flush every step.
* ``2bw`` and ``pipedream`` run a persistent 1F1B loop that keeps microbatches in flight across optimizer
  steps: it fills once when an asynchronous phase starts and drains only when the run needs the weights
  whole (evaluation, checkpoint, the switch to a synchronous phase, the end). The order is the schedule IR's
  (:func:`bubblefree.schedules.ir.one_f_one_b_order`), the one the schedule simulator derives the delays
  from. A *unit* is what flows through the pipeline: a microbatch for 2BW (``m/R`` per step and replica,
  ``m/R >= P``), the replica's whole share of the batch for PipeDream (one unit per step, so stage ``s`` is
  ``P-1-s`` steps stale), which each stage computes one microbatch at a time so that the arithmetic, and
  the MoE balancing loss (a per-forward statistic), are the simulation's.

Rank ``replica * P + stage`` computes; global rank 0 (replica 0, stage 0, the last to finish every step)
returns the statistics and is the one process that writes the run's outputs (:attr:`is_writer`). The
statistics travel down the pipeline with the last gradient of each step, so no pipeline-wide collective runs
in the steady state. Losses are scaled by ``1/m`` (the global number of microbatches), the MoE balancing
gradient too (``set_aux_loss_scale``), and replica gradients are summed: the simulation's mean over
microbatches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bubblefree.distributed.mesh import Mesh, init_mesh
from bubblefree.distributed.p2p import P2P
from bubblefree.distributed.stage import StageRuntime
from bubblefree.distributed.trace import Tracer
from bubblefree.errors import UserError
from bubblefree.models.moe import MoE
from bubblefree.schedules.ir import one_f_one_b_order
from bubblefree.train.config import Config
from bubblefree.train.executor import StepStats
from bubblefree.train.sim import autocast_for, resolve_device

__all__ = ["ASYNC_SCHEDULES", "DistributedExecutor"]

ASYNC_SCHEDULES = ("2bw", "pipedream")
_SYNC_SCHEDULES = ("sync", "gpipe", "1f1b")
DEFAULT_TIMEOUT_S = 300.0
_N_STATS = 3  # loss, squared gradient norm, MoE balancing loss


def forwards_done(stage: int, n_stages: int, segment: tuple[int, int], last_backward: int) -> int:
    """Forwards ``one_f_one_b_order(stage, n_stages, range(*segment))`` has run when it finishes the backward of
    unit ``last_backward``: its ``P-1-s`` warm-up forwards plus one per backward so far, at most the segment's
    length (the closed form of that order; a test enumerates the order to check it)."""
    first, end = segment
    assert first <= last_backward < end, "unit outside the segment"
    return min(last_backward - first + n_stages - stage, end - first)


def _to_cpu(tree: Any) -> Any:
    """A copy of a state tree with every tensor on the CPU (a checkpoint must not name this rank's GPU)."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree


class DistributedExecutor:
    """:class:`~bubblefree.train.executor.Executor` for one rank of the pipeline (see module doc).

    ``out_dir`` receives this rank's trace (``trace/rank<r>.jsonl``); None records none. ``mesh`` reuses
    process groups already made (tests); by default the torchrun environment is joined. ``stage_module``
    replaces this rank's piece of ``split_model(model, P)`` (the fixed-cost stages of
    :mod:`bubblefree.distributed.synthetic` that ``bubblefree bench pipeline`` runs); it must map the
    previous stage's output (token ids on stage 0) to the next one's input (logits on the last stage).
    """

    def __init__(self, config: Config, model: torch.nn.Module, data: Any, *, out_dir: str | Path | None = None,
                 mesh: Mesh | None = None, timeout_s: float | None = None,
                 stage_module: torch.nn.Module | None = None):
        from bubblefree.delay import build_delayed
        from bubblefree.models.split import split_model
        from bubblefree.optim import build_optimizer
        from bubblefree.schedules import stage_delays

        cfg, pipe = config, config.pipeline
        if pipe.schedule == "wpipe":
            raise ValueError("Invalid pipeline.schedule: 'wpipe' (the distributed runtime has no WPipe loop: two "
                             "partitions per process updating alternately; run it with pipeline.runtime = sim)")
        if pipe.schedule not in ASYNC_SCHEDULES + _SYNC_SCHEDULES:
            raise ValueError(f"Invalid pipeline.schedule: {pipe.schedule!r} (the distributed runtime runs "
                             f"{', '.join(_SYNC_SCHEDULES + ASYNC_SCHEDULES)})")
        if getattr(getattr(model, "args", None), "tie_embeddings", False) and pipe.stages > 1:
            raise ValueError(f"Invalid model.preset: {cfg.model.preset!r} ties its embedding and head, which the "
                             f"distributed runtime refuses for pipeline.stages > 1 (docs/runtime.md)")
        if mesh is None and not dist.is_initialized() and "RANK" not in os.environ:
            raise UserError("Invalid pipeline.runtime: 'distributed' needs one process per stage: run under torchrun "
                            "(python -m bubblefree.distributed) or bubblefree.distributed.launch_local")
        timeout_s = timeout_s or float(os.environ.get("BUBBLEFREE_P2P_TIMEOUT", DEFAULT_TIMEOUT_S))
        device_type = resolve_device(cfg.train.device).type
        self.mesh = mesh or init_mesh(stages=pipe.stages, timeout_s=timeout_s, device_type=device_type)
        P, R, m = pipe.stages, self.mesh.replicas, pipe.microbatches
        if m % R or cfg.train.batch_size % m:
            raise ValueError(f"Invalid pipeline.microbatches: {m} (must divide train.batch_size = "
                             f"{cfg.train.batch_size} and be a multiple of the {R} replicas)")
        if pipe.schedule == "2bw" and m // R < P:
            raise ValueError(f"Invalid pipeline.microbatches: {m} (2bw keeps two weight versions, which needs at "
                             f"least P = {P} microbatches per step and replica; there are {R} replicas)")
        self.config, self.data, self.P, self.m = config, data, P, m
        self.local_m = m // R  # microbatches of this replica per step
        self.units_per_step = self.local_m if pipe.schedule == "2bw" else 1
        self.device = self.mesh.device
        model.set_aux_loss_scale(1 / m)  # each microbatch's cross-entropy enters the backward divided by m
        self.module = (split_model(model, P)[self.mesh.stage] if stage_module is None else stage_module
                       ).to(self.device)
        self._moe = [mod for mod in self.module.modules() if isinstance(mod, MoE)]
        delayed = build_delayed(build_optimizer(self.module, cfg.optim),
                                delays=stage_delays(pipe.schedule, P)[self.mesh.stage], config=cfg.delay,
                                total_steps=cfg.train.steps)
        self.stage = StageRuntime(self.module, delayed, n_stages=P, grad_clip=cfg.train.grad_clip,
                                  dp_group=self.mesh.dp_group)
        self.p2p = P2P(self.device, timeout_s)
        trace = Path(out_dir) / "trace" / f"rank{self.mesh.rank}.jsonl" if out_dir is not None else None
        self.tracer = Tracer(trace, rank=self.mesh.rank, replica=self.mesh.replica, stage=self.mesh.stage)
        self._autocast = autocast_for(cfg.train.dtype, self.device)
        self._stock: dict[str, Any] = {}
        self._segment: tuple[int, int] | None = None  # units [first, end) of the running asynchronous segment
        self._actions: Any = None  # iterator over the segment's order
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # unit -> (input, output or loss)
        self._posted: tuple[int, Any] | None = None  # (unit, wait) of the activation receive posted ahead
        self._loss_sum: dict[int, torch.Tensor] = {}  # step -> sum of its microbatch losses (last stage)
        self._aux_sum: dict[int, torch.Tensor] = {}  # step -> sum of this stage's balancing losses
        self._stats: dict[int, StepStats] = {}

    @property
    def is_writer(self) -> bool:
        """Global rank 0 writes the run's outputs; every rank takes part in every call of the loop."""
        return self.mesh.rank == 0

    # ------------------------------------------------------------------------------------------ data
    def _unit_batch(self, step: int, unit_in_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and targets of a unit: microbatches ``replica * m/R + i`` of the step, concatenated."""
        from bubblefree.data import get_batch

        cfg = self.config.train
        mbs = range(self.local_m) if self.units_per_step == 1 else [unit_in_step]
        xs, ys = zip(*(get_batch(self.data.train, seed=cfg.seed, step=step,
                                 microbatch=self.mesh.replica * self.local_m + i, batch_size=cfg.batch_size // self.m,
                                 seq_len=cfg.seq_len, device=self.device)
                       for i in mbs))
        return torch.cat(xs), torch.cat(ys)

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def _add_aux(self, step: int) -> None:
        """Add the balancing loss of this stage's last forward to the step's sum (a tensor: no device sync)."""
        if self._moe:
            aux = sum(mod.last_aux_loss.double() for mod in self._moe)
            self._aux_sum[step] = self._aux_sum.get(step, 0.0) + aux

    # ---------------------------------------------------------------------------------- the executor
    def train_step(self, step: int, lr_scale: float) -> StepStats | None:
        from bubblefree.distributed.launch import _maybe_fault

        _maybe_fault(self.mesh.rank, when=step)
        if self.stage.delayed.is_async(step) and self.config.pipeline.schedule in ASYNC_SCHEDULES:
            self._async_step(step, lr_scale)
        else:
            self.drain()
            self._stock_step(step, lr_scale)
        return self._stats.pop(step, None)

    def _rank(self, stage: int) -> int:
        return self.mesh.global_rank(stage)

    def _step_stats(self, step: int, norm: float, incoming: torch.Tensor | None) -> None:
        """Add this stage's numbers to the statistics of ``step`` and pass them towards stage 0."""
        stats = torch.zeros(_N_STATS, dtype=torch.float64) if incoming is None else incoming.cpu()
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        local = torch.stack([torch.as_tensor(self._loss_sum.pop(step, zero)).double(),
                             torch.as_tensor(self._aux_sum.pop(step, zero)).double()]).to(self.device)
        if self.mesh.dp_group is not None:  # the replica's microbatches -> all m of the step
            dist.all_reduce(local, group=self.mesh.dp_group)
        local = local.cpu() / self.m
        stats[0] += local[0]
        stats[1] += norm * norm
        stats[2] += local[1]
        if not self.mesh.is_first:
            self.p2p.send(stats.to(self.device), self._rank(self.mesh.stage - 1))
        elif self.mesh.replica == 0:
            self._stats[step] = StepStats(loss=float(stats[0]), grad_norm=float(stats[1]) ** 0.5,
                                          aux_loss=float(stats[2]), lr=self.stage.delayed.param_groups[0]["lr"])

    def _recv_stats(self) -> torch.Tensor | None:
        if self.mesh.is_last:
            return None
        return self.p2p.recv((_N_STATS,), torch.float64, self._rank(self.mesh.stage + 1))

    # --------------------------------------------------------------------- stock synchronous schedules
    def _stock_step(self, step: int, lr_scale: float) -> None:
        # Imported here: it costs a second or more per process, and asynchronous runs never need it.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        mesh, n = self.mesh, self.local_m
        if "schedule" not in self._stock:
            pstage = PipelineStage(self.module, mesh.stage, self.P, self.device, group=mesh.pp_group)
            cls = Schedule1F1B if self.config.pipeline.schedule != "gpipe" and n >= self.P else ScheduleGPipe
            loss_fn = lambda out, y: self._loss(out, y) / self.m
            self._stock["schedule"] = cls(pstage, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
            for name in ("forward_one_chunk", "backward_one_chunk"):  # trace the stock schedule's compute
                setattr(pstage, name, self._traced(getattr(pstage, name), name[0].upper()))
        self._stock["step"] = step
        schedule = self._stock["schedule"]
        self.stage.delayed.zero_grad(set_to_none=True)
        x, y = self._unit_batch(step, 0) if self.units_per_step == 1 else \
            map(torch.cat, zip(*(self._unit_batch(step, i) for i in range(n))))
        with self._autocast():
            if mesh.is_first:
                schedule.step(x)
            elif mesh.is_last:
                losses: list[torch.Tensor] = []
                schedule.step(target=y, losses=losses)
                self._loss_sum[step] = torch.stack(losses).detach().double().sum() * self.m
            else:
                schedule.step()
        self._finish(step, lr_scale, versioned=False)
        self.p2p.flush()

    def _traced(self, fn, kind: str):
        def run(chunk_id, *args, **kwargs):
            step = self._stock["step"]
            with self.tracer.span(kind, step=step, unit=chunk_id):
                result = fn(chunk_id, *args, **kwargs)
            if kind == "F":
                self._add_aux(step)
            return result
        return run

    # ------------------------------------------------------------------ the asynchronous 1F1B loop
    def _phase_end(self, step: int) -> int:
        """First step after ``step`` that is not asynchronous (where the segment must end)."""
        delayed, end = self.stage.delayed, step
        while end < self.config.train.steps and delayed.is_async(end):
            end += 1
        return end

    def _async_step(self, step: int, lr_scale: float) -> None:
        U = self.units_per_step
        if self._segment is None:
            self._segment = (step * U, self._phase_end(step) * U)
            self._actions = iter(one_f_one_b_order(self.mesh.stage, self.P, range(*self._segment)))
        assert self._segment[0] <= step * U < self._segment[1], "train_step called out of order"
        last_unit = (step + 1) * U - 1
        for action in self._actions:
            if action.kind == "F":
                self._forward(action.microbatch, last_unit)
            else:
                self._backward(action.microbatch, lr_scale)
                if action.microbatch == last_unit:
                    break
        if (step + 1) * U == self._segment[1]:
            self._close_segment()

    def _forward(self, unit: int, last_unit: int) -> None:
        mesh, U = self.mesh, self.units_per_step
        step, i = divmod(unit, U)
        if i == 0:
            self.stage.enter(step)
        x, y = self._unit_batch(step, i) if (mesh.is_first or mesh.is_last) else (None, None)
        if not mesh.is_first:
            x = self._receive_activation(unit, last_unit).requires_grad_()
        chunks = self.local_m // U  # microbatches in the unit, computed one by one as the simulation does
        with self.tracer.span("F", step=step, unit=unit), self._autocast():
            outs = []
            for xc in x.chunk(chunks):
                outs.append(self.stage.forward(step, xc))
                self._add_aux(step)
            if mesh.is_last:
                loss = sum(self._loss(o, yc) for o, yc in zip(outs, y.chunk(chunks)))
                self._loss_sum[step] = self._loss_sum.get(step, 0.0) + loss.detach().double()
                out = loss / self.m
            else:
                out = torch.cat(outs) if chunks > 1 else outs[0]
        if not mesh.is_last:
            self.p2p.send_activation(out, self._rank(mesh.stage + 1))
        self._saved[unit] = (x, out)

    def _receive_activation(self, unit: int, last_unit: int) -> torch.Tensor:
        """The previous stage's output for ``unit``, and the receive of the next unit's posted at once.

        A gloo (or NCCL) transfer moves when the receiver asks for it, and then needs the sender's transport
        thread, which on a busy CPU shares a core with the sender's compute: asked for late, an activation
        sent long before arrived 5-10 ms late (llama-5m, P = 2). Posted ahead, it moves as soon as it is sent.
        Only a unit the previous stage sends before this ``train_step`` can end is posted (it finishes the
        step's ``last_unit`` with ``forwards_done`` forwards run), so a drain never leaves a receive waiting.
        """
        prev = self._rank(self.mesh.stage - 1)
        if self._posted is not None:
            posted, wait = self._posted
            assert posted == unit, (posted, unit)
            x, self._posted = wait(), None
        else:
            x = self.p2p.recv_activation(prev)
        first = self._segment[0]
        if unit + 1 < first + forwards_done(self.mesh.stage - 1, self.P, self._segment, last_unit):
            self._posted = (unit + 1, self.p2p.post_activation(x, prev))  # a segment's units share one shape
        return x

    def _backward(self, unit: int, lr_scale: float) -> None:
        mesh, U = self.mesh, self.units_per_step
        step = unit // U
        x, out = self._saved.pop(unit)
        grad = None if mesh.is_last else self.p2p.recv(out.shape, out.dtype, self._rank(mesh.stage + 1))
        with self.tracer.span("B", step=step, unit=unit):
            torch.autograd.backward(out, grad)
        if not mesh.is_first:
            self.p2p.send(x.grad, self._rank(mesh.stage - 1))
        if (unit + 1) % U == 0:
            self._finish(step, lr_scale)

    def _finish(self, step: int, lr_scale: float, *, versioned: bool = True) -> None:
        """End ``step`` on this stage. The statistics go on towards stage 0 before the update, not after: the
        next stage's (which stage 0 waits for) are then already there, and no stage sits idle through another's
        optimizer step (measured: stage 0 waited 34 ms of a 175 ms llama-5m step for stage 1's Muon update)."""
        norm = self.stage.prepare_update(step, lr_scale, versioned=versioned)
        self._step_stats(step, norm, self._recv_stats())
        with self.tracer.span("U", step=step):
            self.stage.update(step)

    def drain(self) -> None:
        """End the running asynchronous segment at the last completed step (nothing to do if none runs).

        Every rank has just finished the same step ``t``; forwards already run for later steps are
        dropped, and the activations the previous stage sent for them are received and discarded (their
        number follows from the two stages' orders), so the next segment refills from step ``t+1``.
        """
        if self._segment is None:
            return
        first, end = self._segment
        done = self.stage.updates_done * self.units_per_step  # units whose steps have been applied
        if done < end and not self.mesh.is_first:
            sent = forwards_done(self.mesh.stage - 1, self.P, self._segment, done - 1)
            taken = forwards_done(self.mesh.stage, self.P, self._segment, done - 1)
            if self._posted is not None:  # the first of them, already asked for
                self._posted[1]()
                self._posted, taken = None, taken + 1
            for _ in range(sent - taken):
                self.p2p.recv_activation(self._rank(self.mesh.stage - 1))
        for step in self.stage.entered():
            self.stage.abandon(step)
        self._saved.clear()
        self._loss_sum = {k: v for k, v in self._loss_sum.items() if k * self.units_per_step < done}
        self._aux_sum = {k: v for k, v in self._aux_sum.items() if k * self.units_per_step < done}
        self._close_segment()

    def _close_segment(self) -> None:
        assert self._posted is None, "a receive was posted past the segment"
        self._segment, self._actions = None, None
        self.p2p.flush()
        self.tracer.flush()

    # ------------------------------------------------------------------------------ evaluation, state
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Validation loss at the current weights on the writer (None elsewhere): replica 0 runs the
        evaluation batches through its pipeline; the other replicas only drain."""
        from bubblefree.data import eval_batches

        self.drain()
        mesh, cfg = self.mesh, self.config.train
        if mesh.replica != 0:
            return None
        self.module.eval()
        batches = eval_batches(self.data.val, n_batches=cfg.eval_batches, batch_size=cfg.batch_size,
                               seq_len=cfg.seq_len, device=self.device)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (x, y) in enumerate(batches):
            if not mesh.is_first:
                x = self.p2p.recv_activation(self._rank(mesh.stage - 1))
            with self.tracer.span("E", step=self.stage.updates_done, unit=i), self._autocast():
                out = self.module(x)
            if mesh.is_last:
                total += self._loss(out, y).double()
            else:
                self.p2p.send_activation(out, self._rank(mesh.stage + 1))
        self.module.train()
        result = total / len(batches)
        if mesh.is_last and not mesh.is_first:
            self.p2p.send(result, self._rank(0))
        elif mesh.is_first and not mesh.is_last:
            result = self.p2p.recv((), torch.float64, self._rank(self.P - 1))
        self.p2p.flush()
        self.tracer.flush()
        return float(result) if mesh.is_first else None

    def state_dict(self) -> dict[str, Any]:
        """Drain, then gather the whole pipeline's state on the writer: ``{"runtime": "distributed",
        "stages": [...]}`` with one entry per stage (weights, and the ``DelayedOptimizer`` state: optimizer,
        stash of weight versions, EF buffers, counters), on the CPU. Every rank must call it; the others get
        an empty dict."""
        self.drain()
        own = _to_cpu({"module": self.module.state_dict(), "delayed": self.stage.delayed.state_dict()})
        gathered: list[Any] | None = [None] * self.mesh.world_size if self.is_writer else None
        dist.gather_object(own, gathered, dst=0)
        if not self.is_writer:
            return {}
        return {"runtime": "distributed", "schedule": self.config.pipeline.schedule,
                "stages": gathered[: self.P]}  # replicas hold identical copies

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load this rank's stage from what :meth:`state_dict` returned on the writer. Every rank passes
        the whole state (each reads the checkpoint file itself); no communication."""
        stages = state.get("stages") if state.get("runtime") == "distributed" else None
        if stages is None or len(stages) != self.P:
            found = "not a distributed run's" if stages is None else f"{len(stages)} stages'"
            raise ValueError(f"Invalid checkpoint: it holds {found} state; this run has {self.P} stages")
        mine = stages[self.mesh.stage]
        self.module.load_state_dict(mine["module"])
        self.stage.delayed.load_state_dict(mine["delayed"])

    def close(self) -> None:
        self.drain()
        self.p2p.flush()
        self.tracer.flush()
