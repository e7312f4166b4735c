"""A pipeline schedule as data: per-rank lists of actions, and generators for the schedules we compare.

An :class:`Action` is ``(stage, kind, microbatch)`` with the text form ``"2F0"`` of
torch.distributed.pipelining's ``_Action``: kind ``F`` (forward), ``B`` (backward; the whole backward, or only
the input-gradient part when the schedule splits it) or ``W`` (the weight-gradient part, zero-bubble only).
Microbatch indices are global over the run: microbatch ``j`` belongs to optimizer step ``j // M``.

Each schedule's row of the schedule table (:mod:`bubblefree.schedules.table`) names its order (an
:class:`~bubblefree.schedules.table.Order`, whose builder is here), whether it flushes, its weight-version rule and
the microbatches it needs. Flushing schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble) repeat one step's order
``steps`` times; the asynchronous ones (PipeDream-2BW, PipeDream) run one 1F1B order over the whole run, filling
once at the start and draining once at the end; WPipe cuts the model into ``2P`` partitions (rank ``r`` holds
``r`` and ``r + P``) and overlaps the first half's next step with the current one. Which weights each microbatch
sees, and hence each stage's delay, is *derived* from these orders by :mod:`bubblefree.schedules.timeline`, and a
test checks the result against the delay table the training uses (:func:`bubblefree.schedules.delays.stage_delays`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

from bubblefree.schedules.table import SCHEDULE_SPECS, SIMULATED_SCHEDULES, Order, ScheduleSpec, Unit, Versions

__all__ = ["ORDERS", "SIMULATED_SCHEDULES", "Action", "Schedule", "build_schedule", "check_schedule",
           "one_f_one_b_order", "simulated_actions"]


class Action(NamedTuple):
    """A tuple, not a dataclass: the simulator hashes millions of them, and a tuple hashes in C."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    name: str
    n_stages: int
    """Pipeline stages (virtual stages for interleaved schedules: ``n_ranks * chunks``)."""
    n_ranks: int
    n_microbatches: int
    """Microbatches per optimizer step."""
    n_steps: int
    orders: tuple[tuple[Action, ...], ...]
    """``orders[r]`` is the sequence of actions rank ``r`` executes."""
    version_policy: Versions
    """Which weight version each forward uses (the schedule table's :class:`~bubblefree.schedules.table.Versions`)."""
    split_backward: bool = False

    def rank_of(self, stage: int) -> int:
        return stage % self.n_ranks

    def format(self) -> str:
        """One line per rank, actions separated by spaces: the golden-string form used in tests."""
        return "\n".join(" ".join(map(str, order)) for order in self.orders)


def one_f_one_b_order(stage: int, n_stages: int, microbatches: range) -> list[Action]:
    """1F1B on one stage over ``microbatches``: fill with ``P-1-s`` forwards, alternate, then drain.

    The one definition of the order: the schedule simulator derives the delays from it, and the distributed
    runtime (``bubblefree.distributed``) executes it for 2BW and PipeDream.
    """
    mbs = list(microbatches)
    warmup = min(n_stages - 1 - stage, len(mbs))
    order = [Action(stage, "F", j) for j in mbs[:warmup]]
    for i, j in enumerate(mbs[warmup:]):
        order += [Action(stage, "F", j), Action(stage, "B", mbs[i])]
    order += [Action(stage, "B", j) for j in mbs[len(mbs) - warmup :]]
    return order


def _gpipe(stage: int, microbatches: range) -> list[Action]:
    return [Action(stage, "F", j) for j in microbatches] + [Action(stage, "B", j) for j in microbatches]


def _interleaved(rank: int, n_ranks: int, chunks: int, microbatches: range) -> list[Action]:
    """Megatron's interleaved 1F1B on one rank holding virtual stages ``rank + c * n_ranks``.

    Microbatches go through the chunks in groups of ``n_ranks``; warmup is ``2 (P - r - 1) + (v - 1) P``
    forwards (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters").
    """
    mbs = list(microbatches)
    total = len(mbs) * chunks

    def unit(k: int, backward: bool) -> Action:
        group, within = divmod(k, n_ranks * chunks)
        chunk = (k // n_ranks) % chunks
        if backward:
            chunk = chunks - 1 - chunk
        j = mbs[group * n_ranks + within % n_ranks]
        return Action(rank + chunk * n_ranks, "B" if backward else "F", j)

    warmup = min(total, 2 * (n_ranks - rank - 1) + (chunks - 1) * n_ranks)
    order = [unit(k, False) for k in range(warmup)]
    for k in range(warmup, total):
        order += [unit(k, False), unit(k - warmup, True)]
    order += [unit(k, True) for k in range(total - warmup, total)]
    return order


def _wpipe(rank: int, n_ranks: int, per_step: list[range]) -> list[Action]:
    """WPipe on one rank (Yang et al., ICLR 2022): it holds partition ``r`` of the first half and ``r + P`` of
    the second. Per step ``t``: the second half's forwards and backwards of ``t``, then the first half's
    forwards of step ``t+1`` *moved ahead of* its backwards of ``t``. So the second half updates before its
    next forward (no delay, one version), while the first half runs step ``t+1``'s forwards on the weights
    without update ``t`` (one step stale, two versions: the double buffer). Both follow from this order in
    the timeline simulator; nothing here states them. Each group's microbatches of a step run back to back
    (the paper interleaves them finer, which changes the bubbles, not which weights each forward sees)."""
    first, second = rank, rank + n_ranks
    order = [Action(first, "F", j) for j in per_step[0]]
    for t, mbs in enumerate(per_step):
        order += [Action(second, "F", j) for j in mbs] + [Action(second, "B", j) for j in mbs]
        if t + 1 < len(per_step):
            order += [Action(first, "F", j) for j in per_step[t + 1]]
        order += [Action(first, "B", j) for j in mbs]
    return order


ORDERS: dict[Order, Callable[[int, int, list[range], int], list[Action]]] = {
    Order.GPIPE: lambda rank, P, steps, chunks: _gpipe(rank, _through(steps)),
    Order.ONE_F_ONE_B: lambda rank, P, steps, chunks: one_f_one_b_order(rank, P, _through(steps)),
    Order.INTERLEAVED: lambda rank, P, steps, chunks: _interleaved(rank, P, chunks, _through(steps)),
    Order.WPIPE: lambda rank, P, steps, chunks: _wpipe(rank, P, steps),
}
"""The builder of each order: ``build(rank, P, steps, chunks)`` is rank ``rank``'s actions over ``steps``, the
microbatches of consecutive optimizer steps (one step at a time for a flushing schedule: 1F1B over several steps
is the asynchronous schedules' order, which never drains in between)."""


def _through(steps: list[range]) -> range:
    """The microbatches of consecutive steps as one range."""
    return range(steps[0].start, steps[-1].stop)


def _simulated(name: str) -> ScheduleSpec:
    spec = SCHEDULE_SPECS.get(name)
    if spec is None or spec.order is None:
        raise ValueError(f"Invalid schedule: {name!r} (choose from {', '.join(SIMULATED_SCHEDULES)})")
    return spec


def _stages_per_rank(spec: ScheduleSpec, chunks: int) -> int:
    """Model partitions on each rank: the interleaved order's ``chunks`` virtual stages, else the table's."""
    return chunks if spec.order is Order.INTERLEAVED else spec.partitions


def check_schedule(name: str, n_stages: int, n_microbatches: int, *, steps: int = 1) -> ScheduleSpec:
    """The ValueError :func:`build_schedule` would raise for these arguments, without building anything (a
    command checks every schedule it was asked for before simulating any); the schedule's row otherwise."""
    spec = _simulated(name)
    for label, value in (("stages", n_stages), ("microbatches", n_microbatches), ("steps", steps)):
        if value < 1:
            raise ValueError(f"Invalid {label}: {value} (must be >= 1)")
    if (needs := spec.simulator_needs) is not None and not needs.met(n_microbatches, n_stages):
        raise ValueError(f"Invalid microbatches: {n_microbatches} ({needs.reason(n_stages)})")
    return spec


def build_schedule(name: str, n_stages: int, n_microbatches: int, *, steps: int = 1, chunks: int = 2) -> Schedule:
    """The per-rank action orders of schedule ``name`` for ``steps`` optimizer steps.

    ``n_stages`` is the number of devices P; ``chunks`` the virtual stages per rank of the interleaved order. A
    schedule whose unit is the step (PipeDream) updates after every microbatch: the work of ``steps`` batches
    of ``M`` is ``steps * M`` steps of one microbatch. ``zero-bubble`` returns the 1F1B order with split
    backwards; its W actions are placed greedily by the timeline simulator (ZB-H1 policy).
    """
    spec = check_schedule(name, n_stages, n_microbatches, steps=steps)
    P, M = n_stages, n_microbatches
    if spec.unit is Unit.STEP:
        M, steps = 1, steps * M
    per_step = [range(t * M, (t + 1) * M) for t in range(steps)]
    build = ORDERS[spec.order]
    if spec.flushes:  # a flush ends every step: one step's order, repeated
        orders = [_steps(build(r, P, [mbs], chunks) for mbs in per_step) for r in range(P)]
    else:
        orders = [build(r, P, per_step, chunks) for r in range(P)]
    return Schedule(name, P * _stages_per_rank(spec, chunks), P, M, steps, _freeze(orders), spec.versions,
                    split_backward=spec.split_backward)


def simulated_actions(name: str, n_stages: int, n_microbatches: int, *, steps: int = 1, chunks: int = 2) -> int:
    """How many actions the timeline of ``build_schedule(name, ...)`` holds (zero bubble's W actions included),
    known before anything is built: what sizes a simulation's time and memory. Two per microbatch and stage
    (three with a split backward) on each of a rank's partitions (``chunks`` interleaved, two for WPipe)."""
    spec = _simulated(name)
    per_microbatch = (3 if spec.split_backward else 2) * _stages_per_rank(spec, chunks)
    return per_microbatch * n_stages * n_microbatches * steps


def _steps(per_step: Iterable[list[Action]]) -> list[Action]:
    """One rank's orders of consecutive steps, joined (in linear time, where ``sum(lists, [])`` is quadratic)."""
    return list(chain.from_iterable(per_step))


def _freeze(orders: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(order) for order in orders)
