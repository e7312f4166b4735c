"""DistributedExecutor: one process per pipeline stage (and per data-parallel replica) on torch.distributed.

* ``gpipe``, ``1f1b``, ``sync`` and the synchronous phases of the others run the stock
  ``torch.distributed.pipelining`` schedules (``ScheduleGPipe``, ``Schedule1F1B``); they flush every step.
* ``2bw`` and ``pipedream`` run a persistent 1F1B loop that keeps microbatches in flight across optimizer
  steps: it fills once when an asynchronous phase starts and drains only when the run needs the weights
  whole (evaluation, checkpoint, the switch to a synchronous phase, the end). A *unit* is what flows
  through the pipeline: a microbatch for 2BW (``m/R`` per step and replica, ``m/R >= P``), the replica's
  whole share of the batch for PipeDream (one unit per step, so stage ``s`` is ``P-1-s`` steps stale).

Rank ``replica * P + stage`` computes; global rank 0 (replica 0, stage 0, the last to finish every step)
returns the statistics, which travel down the pipeline with the last gradient of each step, so no
pipeline-wide collective runs in the steady state. Losses are scaled by ``1/m`` (the global number of
microbatches) and replica gradients are summed, which is the simulation's mean over microbatches.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from bubblefree.distributed.mesh import Mesh, init_mesh
from bubblefree.distributed.p2p import P2P
from bubblefree.distributed.stage import StageRuntime
from bubblefree.distributed.trace import Tracer
from bubblefree.errors import UserError
from bubblefree.train.config import Config
from bubblefree.train.executor import StepStats

__all__ = ["ASYNC_SCHEDULES", "DistributedExecutor", "one_f_one_b"]

ASYNC_SCHEDULES = ("2bw", "pipedream")
_SYNC_SCHEDULES = ("sync", "gpipe", "1f1b")
DEFAULT_TIMEOUT_S = 300.0


def one_f_one_b(stage: int, n_stages: int, first: int, end: int) -> Iterator[tuple[str, int]]:
    """Actions ``("F"|"B", unit)`` of ``stage`` for units ``first..end-1``: fill, steady 1F1B, drain."""
    n = end - first
    warm = min(n_stages - 1 - stage, n)
    for i in range(warm):
        yield "F", first + i
    for i in range(n - warm):
        yield "F", first + warm + i
        yield "B", first + i
    for i in range(n - warm, n):
        yield "B", first + i


def _forwards_until(stage: int, n_stages: int, first: int, end: int, last_backward: int) -> int:
    """Forwards ``stage`` has run when it finishes the backward of unit ``last_backward``."""
    count = 0
    for kind, unit in one_f_one_b(stage, n_stages, first, end):
        count += kind == "F"
        if kind == "B" and unit == last_backward:
            return count
    raise AssertionError("unit outside the segment")


class DistributedExecutor:
    """:class:`~bubblefree.train.executor.Executor` for one rank of the pipeline (see module doc)."""

    def __init__(self, config: Config, model: torch.nn.Module, data: Any, *, out_dir: str | Path | None = None,
                 mesh: Mesh | None = None, timeout_s: float | None = None):
        from bubblefree.models.split import split_model
        from bubblefree.optim import build_optimizer
        from bubblefree.delay import DelayedOptimizer
        from bubblefree.schedules import stage_delays

        cfg, pipe = config, config.pipeline
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
        self.mesh = mesh or init_mesh(stages=pipe.stages, timeout_s=timeout_s)
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
        self.module = split_model(model, P)[self.mesh.stage].to(self.device)
        optimizer = build_optimizer(self.module, cfg.optim)
        delay = stage_delays(pipe.schedule, P)[self.mesh.stage]
        delayed = DelayedOptimizer(optimizer, delays=delay, correction=cfg.delay.correction,
                                   ef_beta=cfg.delay.ef_beta, taylor_lambda=cfg.delay.taylor_lambda,
                                   sync_start_steps=cfg.delay.sync_start_steps,
                                   sync_cooldown_steps=cfg.delay.sync_cooldown_steps, total_steps=cfg.train.steps)
        self.stage = StageRuntime(self.module, delayed, n_stages=P, grad_clip=cfg.train.grad_clip,
                                  dp_group=self.mesh.dp_group)
        self.p2p = P2P(self.device, timeout_s)
        out_dir = out_dir if out_dir is not None else os.environ.get("BUBBLEFREE_RUN_DIR")
        out = Path(out_dir) if out_dir else None
        self.tracer = Tracer(out / "trace" / f"rank{self.mesh.rank}.jsonl" if out else None,
                             rank=self.mesh.rank, replica=self.mesh.replica, stage=self.mesh.stage)
        use_bf16 = cfg.train.dtype == "bfloat16" or (cfg.train.dtype == "auto" and self.device.type == "cuda")
        self._autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext
        self._stock: dict[str, Any] = {}
        self._segment: tuple[int, int] | None = None  # units [first, end) of the running asynchronous segment
        self._actions: Iterator[tuple[str, int]] | None = None
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # unit -> (input, output or loss)
        self._loss_sum: dict[int, float] = {}
        self._stats: dict[int, StepStats] = {}

    # ------------------------------------------------------------------------------------------ data
    def _unit_batch(self, step: int, unit_in_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and targets of a unit: microbatches ``replica * m/R + i`` of the step, concatenated."""
        cfg = self.config.train
        from bubblefree.data import get_batch

        mbs = range(self.local_m) if self.units_per_step == 1 else [unit_in_step]
        xs, ys = zip(*(get_batch(self.data.train, seed=cfg.seed, step=step, microbatch=self.mesh.replica * self.local_m + i,
                                 batch_size=cfg.batch_size // self.m, seq_len=cfg.seq_len, device=self.device)
                       for i in mbs))
        return torch.cat(xs), torch.cat(ys)

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    # ---------------------------------------------------------------------------------- the executor
    def train_step(self, step: int, lr_scale: float) -> StepStats | None:
        from bubblefree.distributed.launch import _maybe_fault

        _maybe_fault(self.mesh.rank, when=step)
        delayed = self.stage.delayed
        if delayed.is_async(step) and self.config.pipeline.schedule in ASYNC_SCHEDULES:
            self._async_step(step, lr_scale)
        else:
            self.drain()
            self._stock_step(step, lr_scale)
        return self._stats.pop(step, None)

    def _rank(self, stage: int) -> int:
        return self.mesh.global_rank(stage)

    def _step_stats(self, step: int, norm: float, incoming: torch.Tensor | None) -> None:
        """Add this stage's numbers to the statistics of ``step`` and pass them towards stage 0."""
        stats = torch.zeros(2, dtype=torch.float64) if incoming is None else incoming.cpu()
        if self.mesh.is_last:
            loss = torch.tensor([self._loss_sum.pop(step)], dtype=torch.float64)
            if self.mesh.dp_group is not None:
                dist.all_reduce(loss, group=self.mesh.dp_group)
            stats[0] = loss[0] / self.m
        stats[1] += norm * norm
        if not self.mesh.is_first:
            self.p2p.send(stats.to(self.device), self._rank(self.mesh.stage - 1))
        elif self.mesh.replica == 0:
            self._stats[step] = StepStats(loss=float(stats[0]), grad_norm=float(stats[1]) ** 0.5,
                                          lr=self.stage.delayed.param_groups[0]["lr"])

    def _recv_stats(self) -> torch.Tensor | None:
        if self.mesh.is_last:
            return None
        return self.p2p.recv((2,), torch.float64, self._rank(self.mesh.stage + 1))

    # --------------------------------------------------------------------- stock synchronous schedules
    def _stock_step(self, step: int, lr_scale: float) -> None:
        mesh, n = self.mesh, self.local_m
        if "schedule" not in self._stock:
            pstage = PipelineStage(self.module, mesh.stage, self.P, self.device, group=mesh.pp_group)
            cls = Schedule1F1B if self.config.pipeline.schedule != "gpipe" and n >= self.P else ScheduleGPipe
            loss_fn = lambda out, y: self._loss(out, y) / self.m  # noqa: E731
            self._stock["schedule"] = cls(pstage, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
            for name in ("forward_one_chunk", "backward_one_chunk"):  # trace the stock schedule's compute
                setattr(pstage, name, self._traced(getattr(pstage, name), name[0].upper(), step_box=self._stock))
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
                self._loss_sum[step] = float(sum(float(loss.detach()) for loss in losses)) * self.m
            else:
                schedule.step()
        incoming = self._recv_stats()
        with self.tracer.span("U", step=step):
            norm = self.stage.finish(step, lr_scale, versioned=False)
        self._step_stats(step, norm, incoming)
        self.p2p.flush()

    def _traced(self, fn, kind: str, *, step_box: dict[str, Any]):
        def run(chunk_id, *args, **kwargs):
            with self.tracer.span(kind, step=step_box["step"], unit=chunk_id):
                return fn(chunk_id, *args, **kwargs)
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
            first, end = step * U, self._phase_end(step) * U
            self._segment = (first, end)
            self._actions = one_f_one_b(self.mesh.stage, self.P, first, end)
        assert self._segment[0] <= step * U < self._segment[1], "train_step called out of order"
        last_unit = (step + 1) * U - 1
        for kind, unit in self._actions:
            if kind == "F":
                self._forward(unit)
            else:
                self._backward(unit, lr_scale)
                if unit == last_unit:
                    break
        if (step + 1) * U == self._segment[1]:
            self._close_segment()

    def _forward(self, unit: int) -> None:
        mesh, U = self.mesh, self.units_per_step
        step, i = divmod(unit, U)
        if i == 0:
            self.stage.enter(step)
        x, y = self._unit_batch(step, i) if (mesh.is_first or mesh.is_last) else (None, None)
        if not mesh.is_first:
            x = self.p2p.recv_activation(self._rank(mesh.stage - 1)).requires_grad_()
        with self.tracer.span("F", step=step, unit=unit), self._autocast():
            out = self.stage.forward(step, x)
            if mesh.is_last:
                loss = self._loss(out, y)
                self._loss_sum[step] = self._loss_sum.get(step, 0.0) + float(loss.detach()) * (self.local_m // U)
                out = loss * (self.local_m // U) / self.m
        if not mesh.is_last:
            self.p2p.send_activation(out, self._rank(mesh.stage + 1))
        self._saved[unit] = (x, out)

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
            incoming = self._recv_stats()
            with self.tracer.span("U", step=step):
                norm = self.stage.finish(step, lr_scale)
            self._step_stats(step, norm, incoming)

    def drain(self) -> None:
        """End the running asynchronous segment at the last completed step (nothing to do if none runs).

        Every rank has just finished the same step ``t``; forwards already run for later steps are
        dropped, and the activations the previous stage sent for them are received and discarded (their
        number is a pure function of the schedule), so the next segment refills from step ``t+1``.
        """
        if self._segment is None:
            return
        first, end = self._segment
        done = self.stage.updates_done * self.units_per_step  # units whose steps have been applied
        if done < end and not self.mesh.is_first:
            sent = _forwards_until(self.mesh.stage - 1, self.P, first, end, done - 1)
            taken = _forwards_until(self.mesh.stage, self.P, first, end, done - 1)
            for _ in range(sent - taken):
                self.p2p.recv_activation(self._rank(self.mesh.stage - 1))
        for step in self.stage.entered():
            self.stage.abandon(step)
        self._saved.clear()
        self._loss_sum = {k: v for k, v in self._loss_sum.items() if k * self.units_per_step < done}
        self._close_segment()

    def _close_segment(self) -> None:
        self._segment, self._actions = None, None
        self.p2p.flush()
        self.tracer.flush()

    # ------------------------------------------------------------------------------ evaluation, state
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Validation loss at the current weights: replica 0 runs the evaluation batches through its pipeline."""
        from bubblefree.data import eval_batches

        self.drain()
        mesh, cfg = self.mesh, self.config.train
        if mesh.replica != 0:
            return None
        self.module.eval()
        batches = eval_batches(self.data.val, n_batches=cfg.eval_batches, batch_size=cfg.batch_size,
                               seq_len=cfg.seq_len, device=self.device)
        total = torch.zeros((), dtype=torch.float64)
        for i, (x, y) in enumerate(batches):
            if not mesh.is_first:
                x = self.p2p.recv_activation(self._rank(mesh.stage - 1))
            with self.tracer.span("E", step=self.stage.updates_done, unit=i), self._autocast():
                out = self.module(x)
            if mesh.is_last:
                total += float(self._loss(out, y))
            else:
                self.p2p.send_activation(out, self._rank(mesh.stage + 1))
        self.module.train()
        result = (total / len(batches)).to(self.device)
        if mesh.is_last and not mesh.is_first:
            self.p2p.send(result, self._rank(0))
        elif mesh.is_first and not mesh.is_last:
            result = self.p2p.recv((), torch.float64, self._rank(self.P - 1))
        self.p2p.flush()
        self.tracer.flush()
        return float(result) if mesh.is_first else None

    def state_dict(self) -> dict[str, Any]:
        """The whole pipeline's state on global rank 0 (``{"stages": [...]}``, one entry per stage: weights,
        optimizer, stash of weight versions, EF buffers); an empty dict on the other ranks. Drains first."""
        self.drain()
        own = {"module": self.module.state_dict(), "delayed": self.stage.delayed.state_dict()}
        gathered: list[Any] = [None] * self.mesh.world_size if self.mesh.rank == 0 else None
        dist.gather_object(own, gathered, dst=0)
        if self.mesh.rank != 0:
            return {}
        return {"runtime": "distributed", "schedule": self.config.pipeline.schedule,
                "stages": gathered[: self.P]}  # replicas hold identical copies

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (every rank may pass it; rank 0's copy is broadcast)."""
        box = [state if self.mesh.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        stages = box[0]["stages"]
        if len(stages) != self.P:
            raise ValueError(f"Invalid checkpoint: {len(stages)} stages, this run has {self.P}")
        mine = stages[self.mesh.stage]
        self.module.load_state_dict(mine["module"])
        self.stage.delayed.load_state_dict(mine["delayed"])

    def close(self) -> None:
        self.drain()
        self.p2p.flush()
        self.tracer.flush()
