"""DistributedExecutor: one process per pipeline stage (and per data-parallel replica) on torch.distributed.

Rank ``replica * P + stage`` computes; global rank 0 (replica 0, stage 0, the last to finish every step)
returns the statistics and is the one process that writes the run's outputs (:attr:`is_writer`). A step runs
on one of two drivers:

* :mod:`~bubblefree.distributed.stock`: ``gpipe``, ``1f1b``, ``sync`` and the synchronous phases of the
  others, on torch's stock ``ScheduleGPipe`` / ``Schedule1F1B`` (a flush every step);
* :mod:`~bubblefree.distributed.async_loop`: the asynchronous steps of ``2bw`` and ``pipedream``, a persistent
  1F1B loop that drains only when the weights are needed whole.

The statistics travel down the pipeline with the last gradient of each step
(:mod:`~bubblefree.distributed.relay`), so no pipeline-wide collective runs in the steady state; evaluation
and checkpoints gather the pipeline at rest (:mod:`~bubblefree.distributed.gather`). Losses are scaled by
``1/m`` (the global number of microbatches), the MoE balancing gradient too (``set_aux_loss_scale``), and
replica gradients are summed: the simulation's mean over microbatches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import bubblefree.distributed.gather as gather
from bubblefree.config import Config, validate
from bubblefree.delay import build_delayed
from bubblefree.distributed.async_loop import AsyncLoop
from bubblefree.distributed.faults import maybe_fault
from bubblefree.distributed.memory import PeakMemory, tensor_bytes
from bubblefree.distributed.mesh import Mesh, init_mesh
from bubblefree.distributed.p2p import P2P, timeout_s as default_timeout_s
from bubblefree.distributed.rank import Rank
from bubblefree.distributed.relay import StepRelay
from bubblefree.distributed.stage import StageRuntime
from bubblefree.distributed.stock import StockSchedules
from bubblefree.distributed.trace import Tracer
from bubblefree.errors import UserError
from bubblefree.optim import build_optimizer
from bubblefree.schedules import SCHEDULE_SPECS, get_schedule, stage_delays
from bubblefree.schedules.table import Runtime, Unit
from bubblefree.train.build import autocast_for, build_stage, resolve_device
from bubblefree.train.executor import StepStats

__all__ = ["ASYNC_SCHEDULES", "DistributedExecutor"]

ASYNC_SCHEDULES = tuple(name for name, spec in SCHEDULE_SPECS.items() if spec.runtime is Runtime.ASYNC)
"""The schedules whose asynchronous steps run the persistent loop (the others run the stock schedules)."""


class DistributedExecutor:
    """:class:`~bubblefree.train.executor.Executor` for one rank of the pipeline (see module doc).

    ``out_dir`` receives this rank's trace (``trace/rank<r>.jsonl``); None records none. ``mesh`` reuses
    process groups already made (tests); by default the torchrun environment is joined. ``stage_module``
    replaces this rank's piece of the model (the fixed-cost stages of :mod:`bubblefree.bench.synthetic`
    that ``bubblefree bench pipeline`` runs); it must map the previous stage's output (token ids on stage 0)
    to the next one's input (logits on the last stage).
    """

    def __init__(self, config: Config, model: torch.nn.Module, data: Any, *, out_dir: str | Path | None = None,
                 mesh: Mesh | None = None, timeout_s: float | None = None,
                 stage_module: torch.nn.Module | None = None):
        if mesh is None and not dist.is_initialized() and "RANK" not in os.environ:
            raise UserError("Invalid pipeline.runtime: 'distributed' needs one process per stage: run under torchrun "
                            "(python -m bubblefree.distributed) or bubblefree.distributed.launch_local")
        pipe = config.pipeline
        timeout_s = timeout_s or default_timeout_s()
        self.mesh = mesh or init_mesh(stages=pipe.stages, timeout_s=timeout_s,
                                      device_type=resolve_device(config.train.device).type)
        validate(config, replicas=self.mesh.replicas)
        self.config, self.schedule = config, get_schedule(pipe.schedule)
        model.set_aux_loss_scale(1 / pipe.microbatches)  # each microbatch's loss enters the backward divided by m
        module = (build_stage(model, config, self.mesh.stage) if stage_module is None else stage_module
                  ).to(self.mesh.device)
        delayed = build_delayed(build_optimizer(module, config.optim),
                                delays=stage_delays(pipe.schedule, pipe.stages)[self.mesh.stage],
                                config=config.delay, total_steps=config.train.steps)
        p2p = P2P(self.mesh.device, timeout_s)
        trace = Path(out_dir) / "trace" / f"rank{self.mesh.rank}.jsonl" if out_dir is not None else None
        local_m = pipe.microbatches // self.mesh.replicas
        self.rank = Rank(
            pipeline=pipe, train=config.train, data=data, mesh=self.mesh, module=module,
            stage=StageRuntime(module, delayed, n_stages=pipe.stages, grad_clip=config.train.grad_clip,
                               dp_group=self.mesh.dp_group),
            p2p=p2p, tracer=Tracer(trace, rank=self.mesh.rank, replica=self.mesh.replica, stage=self.mesh.stage),
            relay=StepRelay(self.mesh, p2p, pipe.microbatches), autocast=autocast_for(config.train.dtype,
                                                                                        self.mesh.device),
            units_per_step=local_m if self.schedule.unit is Unit.MICROBATCH else 1)
        self.stage, self.module = self.rank.stage, module
        self._async, self._stock = AsyncLoop(self.rank), StockSchedules(self.rank)

    @property
    def is_writer(self) -> bool:
        """Global rank 0 writes the run's outputs; every rank takes part in every call of the loop."""
        return self.mesh.rank == 0

    def train_step(self, step: int, lr_scale: float) -> StepStats | None:
        maybe_fault(self.mesh.rank, when=step)
        if self.rank.memory is None:  # the whole model this rank built is gone by now, its stage's part stays
            delayed = self.stage.delayed
            known = tensor_bytes(list(self.module.parameters()), delayed.optimizer.state, delayed.state_dict())
            self.rank.memory = PeakMemory(self.mesh.device, known)
        with self.rank.tracer.running():
            if self.stage.delayed.is_async(step) and self.schedule.runtime is Runtime.ASYNC:
                self._async.step(step, lr_scale)
            else:
                self._async.drain()
                self._stock.step(step, lr_scale)
        return self.rank.relay.pop(step)

    def drain(self) -> None:
        """End the running asynchronous segment at the last completed step (nothing to do if none runs)."""
        self._async.drain()

    def evaluate(self, split: str = "val") -> float | None:
        """Loss on the ``split`` windows at the current weights on the writer (None elsewhere)."""
        self.drain()
        return gather.evaluate(self.rank, split)

    def state_dict(self) -> dict[str, Any]:
        """Drain, then gather the whole pipeline's state on the writer (:func:`~bubblefree.distributed.gather.
        gather_state`); every rank must call it, the others get an empty dict."""
        self.drain()
        return gather.gather_state(self.rank)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        gather.load_state(self.rank, state)

    def close(self) -> None:
        self.drain()
        self.rank.p2p.flush()
        self.rank.tracer.flush()
