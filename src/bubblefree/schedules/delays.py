"""The one table of pipeline schedules (docs/spec.md section 4): :data:`SCHEDULE_SPECS`, read through
:func:`get_schedule` by the delays below, the trainers and the distributed runtime.

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
checks every row of this table against the simulated order. For ``wpipe`` the lists below have
``n_partitions("wpipe", P) = 2P`` entries, and parameters are mapped to partitions by splitting the model
into ``2P`` consecutive pieces (``models.split.param_stages(model, 2 * P)``).

``weight_versions`` is derived from the delays (``d + 1``: the live weights plus ``d`` stashed ones), never
tabulated twice. Each schedule's other facts (whether it flushes, which loop of the distributed runtime runs it,
what flows through the pipeline as one piece) are fields of its :class:`ScheduleSpec`, like torch's
``get_schedule_class``: a name is interpreted here and nowhere else (``config`` lists the names and its
microbatch rules, and a test checks them against this table).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: `bubblefree --help` and the CLI's signal handling start before torch loads
    import torch
    from torch import nn

__all__ = ["SCHEDULES", "SCHEDULE_SPECS", "ScheduleSpec", "get_schedule", "n_partitions", "parameter_delays",
           "stage_delays", "weight_versions"]


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """Everything the package knows about one value of ``pipeline.schedule``."""

    delays: Callable[[int], list[int]]
    """``delays(P)``: the delay of each model partition, in optimizer steps (``partitions * P`` entries)."""

    partitions: int = 1
    """Model partitions per device (WPipe holds two)."""

    flushes: bool
    """Synchronous: every step's microbatches finish before the update (no delay)."""

    runtime: str | None
    """How the distributed runtime runs its steps: ``"gpipe"`` (torch's stock ``ScheduleGPipe``), ``"1f1b"``
    (stock ``Schedule1F1B``), ``"async"`` (the persistent 1F1B loop of ``distributed.async_loop`` for the
    asynchronous steps, stock 1F1B for the synchronous phases), or None: the simulation only."""

    unit: str = "microbatch"
    """What flows through the runtime's pipeline as one piece: a ``"microbatch"``, or the replica's whole
    ``"step"`` (PipeDream, one update per unit, so stage ``s`` is ``P-1-s`` steps stale)."""

    microbatches_per_stage: bool = False
    """Needs at least ``P`` microbatches per step and replica on the runtime (1F1B's warm-up; 2BW's two weight
    versions)."""


SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    "sync": ScheduleSpec(delays=lambda P: [0] * P, flushes=True, runtime="1f1b", unit="step"),
    "gpipe": ScheduleSpec(delays=lambda P: [0] * P, flushes=True, runtime="gpipe", unit="step"),
    "1f1b": ScheduleSpec(delays=lambda P: [0] * P, flushes=True, runtime="1f1b", unit="step",
                         microbatches_per_stage=True),
    "2bw": ScheduleSpec(delays=lambda P: [1] * P, flushes=False, runtime="async", microbatches_per_stage=True),
    "pipedream": ScheduleSpec(delays=lambda P: [P - 1 - s for s in range(P)], flushes=False, runtime="async",
                              unit="step"),
    "wpipe": ScheduleSpec(delays=lambda P: [1] * P + [0] * P, partitions=2, flushes=False, runtime=None),
}
"""Schedule name -> :class:`ScheduleSpec` (the table in the module docstring)."""

SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_SPECS)
"""Every value of ``pipeline.schedule``. The simulation runs them all; the distributed runtime runs those with a
``runtime`` (``config.DISTRIBUTED_SCHEDULES``); ``bubblefree simulate`` draws those of ``schedules.ir``."""


def get_schedule(schedule: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of ``schedule``, or a ValueError naming the schedules."""
    if schedule not in SCHEDULE_SPECS:
        raise ValueError(f"Invalid schedule: {schedule!r} (expected one of {', '.join(SCHEDULES)})")
    return SCHEDULE_SPECS[schedule]


def _check(schedule: str, n_stages: int) -> ScheduleSpec:
    spec = get_schedule(schedule)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"Invalid n_stages: {n_stages!r} (must be an integer >= 1)")
    return spec


def n_partitions(schedule: str, n_stages: int) -> int:
    """How many consecutive pieces the model is cut into: ``2P`` for ``wpipe``, ``P`` otherwise."""
    return _check(schedule, n_stages).partitions * n_stages


def stage_delays(schedule: str, n_stages: int) -> list[int]:
    """Delay (in optimizer steps) of each of the ``n_partitions(schedule, n_stages)`` model partitions.

    >>> stage_delays("2bw", 3), stage_delays("pipedream", 3), stage_delays("wpipe", 2)
    ([1, 1, 1], [2, 1, 0], [1, 1, 0, 0])
    """
    return _check(schedule, n_stages).delays(n_stages)


def weight_versions(schedule: str, n_stages: int) -> list[int]:
    """Weight versions each partition holds (live + stashed): ``d + 1`` (2BW 2, PipeDream ``P - s``, sync 1)."""
    return [d + 1 for d in stage_delays(schedule, n_stages)]


def parameter_delays(model: nn.Module, optimizer: torch.optim.Optimizer, schedule: str | Sequence[int],
                     n_stages: int, param_stages: Mapping[str, int]) -> list[int]:
    """Per-parameter delays in the optimizer's order (flattened ``param_groups``), for ``DelayedOptimizer``.

    ``schedule`` is a schedule name or an explicit list of per-partition delays (one per partition:
    ``n_stages`` entries, or ``2 * n_stages`` for ``wpipe``-style splits). ``param_stages`` maps each
    parameter name of ``model`` to its partition (``models.split.param_stages(model, n_partitions)``); a
    parameter registered under several names (tied weights) needs only one of them.
    """
    if isinstance(schedule, str):
        delays = stage_delays(schedule, n_stages)
    else:
        delays = [int(d) for d in schedule]
        if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
            raise ValueError(f"Invalid n_stages: {n_stages!r} (must be an integer >= 1)")
        if len(delays) not in (n_stages, 2 * n_stages):
            raise ValueError(f"Invalid stage delays: {delays} (expected {n_stages} entries, one per stage)")
        if any(d < 0 for d in delays):
            raise ValueError(f"Invalid stage delays: {delays} (must be >= 0)")
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            known = [n for n in names.get(id(p), []) if n in param_stages]
            if not known:
                raise ValueError(f"Invalid param_stages: no stage for the optimizer parameter of shape "
                                 f"{tuple(p.shape)} (model names: {names.get(id(p), ['<not in the model>'])})")
            stage = param_stages[known[0]]
            if not 0 <= stage < len(delays):
                raise ValueError(f"Invalid param_stages[{known[0]!r}]: {stage} (must be in [0, {len(delays)}))")
            out.append(delays[stage])
    return out
