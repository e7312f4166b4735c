"""What the parts of one rank's executor share: its place in the mesh, its stage, its links and its batches.

Of the config it holds the two sections those parts read, ``pipeline`` (the shape and the schedule) and
``train`` (the batches and the run's length); the rest (model, optimizer, delay, ...) is spent building the
parts (``DistributedExecutor.__init__``) and no part reaches for it.

A *unit* is what flows through the pipeline as one piece: a microbatch for 2BW and the stock schedules
(``units_per_step = m/R``, the replica's microbatches of a step), the replica's whole share of the batch for
PipeDream (one unit per step, so that stage ``s`` is ``P-1-s`` steps stale), which each stage still computes
one microbatch at a time, so that the arithmetic, and the MoE balancing loss (a per-forward statistic), are
the simulation's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bubblefree.config import PipelineConfig, TrainConfig
from bubblefree.distributed.memory import PeakMemory
from bubblefree.distributed.mesh import Mesh
from bubblefree.distributed.p2p import P2P
from bubblefree.distributed.relay import StepRelay
from bubblefree.distributed.stage import StageRuntime
from bubblefree.distributed.trace import Tracer
from bubblefree.models import aux_loss_sum
from bubblefree.train.build import train_microbatch

__all__ = ["Rank"]


@dataclass(eq=False)
class Rank:
    """One rank of the pipeline (replica ``mesh.replica``, stage ``mesh.stage``) and its parts."""

    pipeline: PipelineConfig
    train: TrainConfig
    data: Any
    """A ``bubblefree.data.TokenData`` (``.train``, ``.val`` token streams)."""
    mesh: Mesh
    module: nn.Module
    """This stage's piece of the model."""
    stage: StageRuntime
    p2p: P2P
    tracer: Tracer
    relay: StepRelay
    autocast: Callable[[], contextlib.AbstractContextManager]
    units_per_step: int
    memory: PeakMemory | None = None
    """The peak-memory probe, made at the first ``train_step`` (:mod:`~bubblefree.distributed.memory`)."""

    @property
    def P(self) -> int:
        return self.pipeline.stages

    @property
    def m(self) -> int:
        """Microbatches per step over all replicas (every loss is scaled by ``1/m``)."""
        return self.pipeline.microbatches

    @property
    def local_m(self) -> int:
        """Microbatches of this replica per step."""
        return self.m // self.mesh.replicas

    @property
    def device(self) -> torch.device:
        return self.mesh.device

    def peer(self, stage: int) -> int:
        """Global rank of ``stage`` in this rank's replica."""
        return self.mesh.global_rank(stage)

    def unit_batch(self, step: int, unit_in_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and targets of a unit: microbatches ``replica * m/R + i`` of the step, concatenated."""
        mbs = range(self.local_m) if self.units_per_step == 1 else [unit_in_step]
        xs, ys = zip(*(train_microbatch(self.train, self.m, self.data.train, step,
                                        self.mesh.replica * self.local_m + i, self.device) for i in mbs))
        return torch.cat(xs), torch.cat(ys)

    def add_aux(self, step: int) -> None:
        """Count the balancing loss of this stage's last forward in the step's statistics."""
        self.relay.add_aux(step, aux_loss_sum(self.module))

    def finish(self, step: int, lr_scale: float, *, versioned: bool = True) -> None:
        """End ``step`` on this stage. The statistics go on towards stage 0 before the update, not after: the
        next stage's (which stage 0 waits for) are then already there, and no stage sits idle through another's
        optimizer step."""
        norm = self.stage.prepare_update(step, lr_scale, versioned=versioned)
        self.relay.end_step(step, norm, lr=self.stage.delayed.param_groups[0]["lr"], busy=self.tracer.window(),
                            peak=self.memory.peak() if self.memory is not None else None)
        with self.tracer.span("U", step=step):
            self.stage.update(step)
