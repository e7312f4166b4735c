"""Synchronous steps on torch's stock schedules: ``ScheduleGPipe`` and ``Schedule1F1B`` over a ``PipelineStage``.

They run ``gpipe``, ``1f1b`` and ``sync``, and the synchronous phases (sync start, sync cooldown) of ``2bw``
and ``pipedream``; they flush every step, and they are the synchronous baselines the benchmarks compare the
asynchronous loop against. ``gpipe`` runs GPipe; every other schedule runs 1F1B, which needs at least ``P``
microbatches per replica. ``1f1b`` with fewer is refused by ``config.validate``; ``sync`` and the synchronous
phases of ``pipedream`` with fewer run GPipe (the same arithmetic: every microbatch's gradient is
accumulated before the update) and say so once on the writer's output.
"""

from __future__ import annotations

from typing import Any

import torch

from bubblefree.distributed.rank import Rank
from bubblefree.models import token_loss
from bubblefree.schedules import get_schedule
from bubblefree.schedules.table import Runtime

__all__ = ["StockSchedules"]


class StockSchedules:
    """The stock schedule of one rank, built at its first synchronous step."""

    def __init__(self, rank: Rank):
        self.rank = rank
        self._schedule: Any = None
        self._step = -1  # the step the stock schedule is running (for the trace)

    def _build(self) -> Any:
        # Imported here: it costs a second or more per process, and asynchronous runs never need it.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        rank, n, schedule = self.rank, self.rank.local_m, self.rank.pipeline.schedule
        gpipe = get_schedule(schedule).runtime is Runtime.GPIPE
        pstage = PipelineStage(rank.module, rank.mesh.stage, rank.P, rank.device, group=rank.mesh.pp_group)
        cls = Schedule1F1B if not gpipe and n >= rank.P else ScheduleGPipe
        if cls is ScheduleGPipe and not gpipe and rank.mesh.rank == 0:
            print(f"bubblefree: the synchronous steps of pipeline.schedule={schedule} run torch's GPipe: 1F1B needs "
                  f"at least P = {rank.P} microbatches per step and replica, and there are {n}", flush=True)
        loss_fn = lambda out, y: token_loss(out, y) / rank.m
        built = cls(pstage, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
        for name in ("forward_one_chunk", "backward_one_chunk"):  # trace the stock schedule's compute
            setattr(pstage, name, self._traced(getattr(pstage, name), name[0].upper()))
        return built

    def step(self, step: int, lr_scale: float) -> None:
        """Run step ``step`` synchronously: every microbatch through the pipeline, then the update."""
        rank, mesh, n = self.rank, self.rank.mesh, self.rank.local_m
        if self._schedule is None:
            self._schedule = self._build()
        self._step = step
        rank.stage.delayed.zero_grad(set_to_none=True)
        x, y = rank.unit_batch(step, 0) if rank.units_per_step == 1 else \
            map(torch.cat, zip(*(rank.unit_batch(step, i) for i in range(n))))
        with rank.autocast():
            if mesh.is_first:
                self._schedule.step(x)
            elif mesh.is_last:
                losses: list[torch.Tensor] = []
                self._schedule.step(target=y, losses=losses)
                rank.relay.add_loss(step, torch.stack(losses).detach().double().sum() * rank.m)
            else:
                self._schedule.step()
        rank.finish(step, lr_scale, versioned=False)
        rank.p2p.flush()

    def _traced(self, fn, kind: str):
        def run(chunk_id, *args, **kwargs):
            with self.rank.tracer.span(kind, step=self._step, unit=chunk_id):
                result = fn(chunk_id, *args, **kwargs)
            if kind == "F":
                self.rank.add_aux(self._step)
            return result
        return run
