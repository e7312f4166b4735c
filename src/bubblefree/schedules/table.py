"""The one table of pipeline schedules (docs/spec.md section 4): one :class:`ScheduleSpec` per schedule in
:data:`SCHEDULE_SPECS`, read through :func:`get_schedule` by the config's rules, the delays
(:mod:`bubblefree.schedules.delays`), the simulator (:mod:`bubblefree.schedules.ir`,
:mod:`bubblefree.schedules.timeline`), the memory plan, the benchmarks and the distributed runtime. A name is
interpreted here and nowhere else: the others ask its object (a test greps the package for names compared as
strings). This module imports neither torch nor the config, so the config lists its choices from here.

A schedule's *delay* at a pipeline partition is the number of optimizer steps that land on that partition
between the forward of a batch and the update that applies its gradient (docs/spec.md): the gradient
of batch ``t`` is evaluated at ``x_{t-d}`` and applied to ``x_t``. The unit is always **one optimizer step
of the simulation** (one whole batch of ``batch_size`` sequences).

| schedule | partitions | delay of partition ``j`` | weight versions |
|---|---|---|---|
| ``sync``, ``gpipe``, ``1f1b`` | ``P`` | 0 (they flush every step) | 1 |
| ``2bw`` (PipeDream-2BW) | ``P`` | 1 on every stage | 2 |
| ``pipedream`` (original) | ``P`` | ``P-1-j`` | ``P-j`` |
| ``wpipe`` (Yang et al. 2022) | ``2P`` | 1 for ``j < P``, 0 for ``j >= P`` | 2 / 1 |
| ``interleaved-1f1b``, ``zero-bubble`` (simulated only) | ``2P``, ``P`` | 0 (they flush every step) | 1 |

*PipeDream.* The original updates once per microbatch with no gradient accumulation; stage ``s`` updates
while ``P-1-s`` later microbatches are in flight. The simulation keeps its unit (one optimizer step = one
whole batch), so ``pipedream`` here means "each stage is ``P-1-s`` optimizer steps stale", which compares
it with 2BW at the same batch size per step.

*WPipe* (Yang et al., ICLR 2022): the model is cut into ``2P`` partitions over ``P`` devices, device ``s``
holding partitions ``s`` and ``s+P``; ``P`` microbatches accumulate per step and the two halves update
alternately with double-buffered weights. The first half's forwards of the next step run ahead of its
backwards of the current one, the second half keeps the plain order, so the first half (partitions
``0..P-1``) is one step stale with two versions and the second half fresh with one. These values are the
ones the timeline simulator derives from WPipe's order (``schedules.ir``, ``schedules.timeline``); a test
checks every row of this table against the simulated order. For ``wpipe`` the lists of delays have
``n_partitions("wpipe", P) = 2P`` entries, and parameters are mapped to partitions by splitting the model
into ``2P`` consecutive pieces (``models.split.param_stages(model, 2 * P)``).

``weight_versions`` is derived from the delays (``d + 1``: the live weights plus ``d`` stashed ones), never
tabulated twice. Each schedule's other facts are fields of its :class:`ScheduleSpec`, like torch's
``get_schedule_class``: whether it flushes, the order the simulator builds and which weights that order's
microbatches see, which loop of the distributed runtime runs it and what flows through the pipeline as one
piece, and the microbatches a layout needs, with the reason a refusal gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

__all__ = ["DISTRIBUTED_SCHEDULES", "SCHEDULES", "SCHEDULE_SPECS", "SIMULATED_SCHEDULES", "Needs", "Order",
           "Runtime", "ScheduleSpec", "Unit", "Versions", "get_schedule"]


class Runtime(str, Enum):
    """Which loop of the distributed runtime runs a schedule's steps."""

    GPIPE = "gpipe"
    """torch's stock ``ScheduleGPipe``."""
    ONE_F_ONE_B = "1f1b"
    """torch's stock ``Schedule1F1B``."""
    ASYNC = "async"
    """The persistent 1F1B loop of ``distributed.async_loop`` for the asynchronous steps (each on a weight version
    of its own), stock 1F1B for the synchronous phases."""


class Unit(str, Enum):
    """What flows through the pipeline as one piece, the simulator's and the distributed runtime's alike."""

    MICROBATCH = "microbatch"
    STEP = "step"
    """The replica's whole share of a step, one update per unit (PipeDream, which never accumulates: stage ``s``
    is ``P-1-s`` steps stale). The simulator gives such a schedule one microbatch per step, so the work of
    ``T`` batches of ``M`` is ``T * M`` updates; the memory plan counts ``M / R`` microbatches of activations
    per unit in flight."""


class Order(str, Enum):
    """The per-rank order of forwards and backwards the simulator builds (the builders are ``schedules.ir``'s).
    A flushing schedule's order is built one step at a time, the others' over the whole run at once."""

    GPIPE = "gpipe"
    """Every forward of the microbatches, then every backward."""
    ONE_F_ONE_B = "1f1b"
    """Fill with ``P-1-s`` forwards, alternate, drain."""
    INTERLEAVED = "interleaved"
    """Megatron's interleaved 1F1B over ``chunks`` virtual stages per rank."""
    WPIPE = "wpipe"
    """Two partitions per rank, the first half's next forwards moved ahead of its current backwards."""


class Versions(str, Enum):
    """Which weight version a microbatch's forward uses at a stage (the timeline simulator's rule). The values
    are the names earlier versions of the IR used."""

    FLUSH = "flush"
    """A step starts after the previous update everywhere: the newest version."""
    DOUBLE_BUFFERED = "2bw"
    """Every microbatch of step ``t`` at ``x_{t-1}``, even where a fresher version exists (PipeDream-2BW)."""
    AT_FORWARD = "pipedream"
    """The newest version present at the microbatch's own forward."""
    PER_STEP = "newest"
    """The newest, the same for every microbatch of a step (WPipe, whose order guarantees it)."""


@dataclass(frozen=True)
class Needs:
    """The microbatches per step a schedule needs on ``P`` stages: at least one per stage, or (``multiple``) a
    multiple of the stages. ``why`` is the reason its refusal gives, a format string of ``P`` (the stages)
    and ``R`` (the data-parallel replicas)."""

    why: str
    multiple: bool = False

    def met(self, microbatches: int, n_stages: int) -> bool:
        return microbatches % n_stages == 0 if self.multiple else microbatches >= n_stages

    def reason(self, n_stages: int, replicas: int = 1) -> str:
        return self.why.format(P=n_stages, R=replicas)


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """Everything the package knows about one pipeline schedule."""

    delays: Callable[[int], list[int]]
    """``delays(P)``: the delay of each model partition, in optimizer steps (``partitions * P`` entries)."""

    partitions: int = 1
    """Model partitions per device (WPipe holds two; interleaved 1F1B ``chunks``, two by default)."""

    flushes: bool
    """Synchronous: every step's microbatches finish before the update (no delay)."""

    config_value: bool = True
    """A value of ``pipeline.schedule``; the others are simulated only (``bubblefree simulate``, ``plan``)."""

    order: Order | None = None
    """The simulator's order of actions; None: not simulated (``sync`` is 1F1B with no pipeline to draw)."""

    versions: Versions = Versions.FLUSH
    """Which weight version each forward of the simulated order uses."""

    split_backward: bool = False
    """The backward is split into its input-gradient part ``B`` and its weight-gradient part ``W`` (zero bubble:
    the simulator places the ``W`` into idle time)."""

    simulator_needs: Needs | None = None
    """The microbatches per step the simulated order needs (:func:`schedules.ir.check_schedule`)."""

    runtime: Runtime | None
    """The loop of the distributed runtime that runs it; None: the simulation only."""

    runtime_needs: Needs | None = None
    """The microbatches per step and replica the distributed runtime needs (1F1B's warm-up; 2BW's two weight
    versions), checked by ``config.validate``."""

    no_runtime: str = ""
    """Why the distributed runtime cannot run it, added to the refusal (where ``runtime`` is None)."""

    unit: Unit = Unit.MICROBATCH
    """What flows through the pipeline as one piece (:class:`Unit`)."""

    @property
    def microbatches_per_stage(self) -> bool:
        """The distributed runtime needs at least ``P`` microbatches per step and replica (:attr:`runtime_needs`)."""
        return self.runtime_needs is not None and not self.runtime_needs.multiple

    @property
    def versioned(self) -> bool:
        """Each step under way computes on a weight version of its own and collects its own gradient (the
        runtime's asynchronous loop): the memory plan counts a gradient per open step."""
        return self.runtime is Runtime.ASYNC


def _flat(P: int) -> list[int]:
    return [0] * P


SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    "sync": ScheduleSpec(delays=_flat, flushes=True, runtime=Runtime.ONE_F_ONE_B),
    "gpipe": ScheduleSpec(delays=_flat, flushes=True, order=Order.GPIPE, runtime=Runtime.GPIPE),
    "1f1b": ScheduleSpec(
        delays=_flat, flushes=True, order=Order.ONE_F_ONE_B, runtime=Runtime.ONE_F_ONE_B,
        runtime_needs=Needs("1f1b needs at least P = {P} microbatches per step and replica, and there are {R} "
                            "replicas; gpipe runs fewer")),
    "interleaved-1f1b": ScheduleSpec(
        delays=lambda P: [0] * (2 * P), partitions=2, flushes=True, config_value=False, order=Order.INTERLEAVED,
        simulator_needs=Needs("interleaved 1F1B needs a multiple of the stages, {P}", multiple=True), runtime=None),
    "zero-bubble": ScheduleSpec(delays=_flat, flushes=True, config_value=False, order=Order.ONE_F_ONE_B,
                                split_backward=True, runtime=None),
    "2bw": ScheduleSpec(
        delays=lambda P: [1] * P, flushes=False, order=Order.ONE_F_ONE_B, versions=Versions.DOUBLE_BUFFERED,
        simulator_needs=Needs("PipeDream-2BW needs at least one per stage, {P}"), runtime=Runtime.ASYNC,
        runtime_needs=Needs("2bw keeps two weight versions, which needs at least P = {P} microbatches per step "
                            "and replica; there are {R} replicas")),
    "pipedream": ScheduleSpec(delays=lambda P: [P - 1 - s for s in range(P)], flushes=False, order=Order.ONE_F_ONE_B,
                              versions=Versions.AT_FORWARD, runtime=Runtime.ASYNC, unit=Unit.STEP),
    "wpipe": ScheduleSpec(
        delays=lambda P: [1] * P + [0] * P, partitions=2, flushes=False, order=Order.WPIPE,
        versions=Versions.PER_STEP, runtime=None,
        no_runtime="it has no WPipe loop: two partitions per process updating alternately; run it with "
                   "pipeline.runtime = sim"),
}
"""Schedule name -> :class:`ScheduleSpec` (the table in the module docstring), in the order commands list them."""

SCHEDULES: tuple[str, ...] = tuple(name for name, spec in SCHEDULE_SPECS.items() if spec.config_value)
"""Every value of ``pipeline.schedule``. The simulation runs them all; the distributed runtime runs those with a
``runtime`` (:data:`DISTRIBUTED_SCHEDULES`)."""

DISTRIBUTED_SCHEDULES: tuple[str, ...] = tuple(name for name in SCHEDULES if SCHEDULE_SPECS[name].runtime is not None)
"""The values of ``pipeline.schedule`` the distributed runtime runs."""

SIMULATED_SCHEDULES: tuple[str, ...] = tuple(name for name, spec in SCHEDULE_SPECS.items() if spec.order is not None)
"""The schedules ``bubblefree simulate`` and ``bubblefree plan`` draw (those with an :class:`Order`)."""


def get_schedule(schedule: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of ``schedule``, or a ValueError naming the schedules."""
    if schedule not in SCHEDULE_SPECS:
        raise ValueError(f"Invalid schedule: {schedule!r} (expected one of {', '.join(SCHEDULE_SPECS)})")
    return SCHEDULE_SPECS[schedule]
