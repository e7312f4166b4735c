"""Play a :class:`~bubblefree.schedules.ir.Schedule` forward in time and derive what it costs and what it computes.

Each rank runs its actions in order; an action starts when its rank is free and its inputs exist: ``F`` at
stage s needs ``F`` of the same microbatch at stage s-1, ``B`` needs its own ``F`` and ``B`` at stage s+1,
``W`` needs its own ``B`` (plus ``comm`` time for every hop between ranks). Zero-bubble ``W`` actions are
placed greedily into idle time (the ZB-H1 policy of Qi et al., ICLR 2024) and are all done before the step's
update. Stage s applies update t once every backward of step t has finished there, which keeps its rank busy
for ``update`` (zero by default: the idealised schedules of the papers; a measured optimizer step on real
stages, where no schedule can hide it).

From the timeline: the idle fraction ``1 - busy / (ranks * makespan)``; throughput relative to ideal
``max_r busy_r / makespan``; per stage the peak activations in flight, the weight versions that must be kept,
and the *staleness*: the number of updates between the weights a step's gradient was computed at and the
weights it is applied to, which is exactly the training delay ``d_s``.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bubblefree.schedules.ir import Action, Schedule
from bubblefree.schedules.table import Versions

__all__ = ["PROGRESS_EVERY", "Costs", "Timeline", "simulate"]

PROGRESS_EVERY = 1 << 14
"""Actions between two calls of :func:`simulate`'s ``progress`` (a few hundredths of a second of work)."""


@dataclass(frozen=True)
class Costs:
    forward: float = 1.0
    backward: float = 2.0
    """The whole backward; with a split backward, ``backward - weight`` is the input-gradient part."""
    weight: float = 1.0
    """The weight-gradient part of ``backward`` (used only by zero-bubble schedules)."""
    comm: float = 0.0
    update: float = 0.0
    """One optimizer update of a rank's stages (each of its ``chunks`` stages takes ``update / chunks``)."""

    @classmethod
    def parse(cls, text: str) -> Costs:
        """``"F:B:W"`` or ``"F:B:W:U"`` as in ``--costs 1:1:1``: forward, input-gradient backward, weight-gradient
        backward and (optionally) optimizer-update times."""
        try:
            f, b, w, *u = (float(x) for x in text.split(":"))
            if len(u) > 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"Invalid costs: {text!r} (expected F:B:W or F:B:W:U, e.g. 1:1:1)") from None
        u = u[0] if u else 0.0
        if min(f, b, w, u) < 0 or f + b + w <= 0:
            raise ValueError(f"Invalid costs: {text!r} (must be non-negative and F + B + W above zero)")
        return cls(forward=f, backward=b + w, weight=w, update=u)


@dataclass
class Timeline:
    schedule: Schedule
    spans: dict[Action, tuple[float, float]] = field(default_factory=dict)
    rank_of: dict[Action, int] = field(default_factory=dict)
    updates: dict[tuple[int, int], float] = field(default_factory=dict)
    """``(stage, step) -> time`` at which the stage finished applying that step's update."""
    versions_used: dict[tuple[int, int], int] = field(default_factory=dict)
    """``(stage, microbatch) -> number of updates`` the microbatch's weights had seen."""
    update_s: float = 0.0
    """How long one stage's update keeps its rank busy (it ends at ``updates[(stage, step)]``)."""

    @property
    def makespan(self) -> float:
        return max(max(end for _, end in self.spans.values()), max(self.updates.values(), default=0.0))

    def busy(self) -> list[float]:
        busy = [0.0] * self.schedule.n_ranks
        for rank, (start, end) in zip(self.rank_of.values(), self.spans.values(), strict=True):  # one key order
            busy[rank] += end - start
        for stage, _ in self.updates:
            busy[self.schedule.rank_of(stage)] += self.update_s
        return busy

    def idle_fraction(self) -> float:
        return 1.0 - sum(self.busy()) / (self.schedule.n_ranks * self.makespan)

    def relative_throughput(self) -> float:
        """Ideal (bubble-free) time over actual time: 1.0 means no bubbles at all."""
        return max(self.busy()) / self.makespan

    def staleness(self) -> list[int]:
        """Per stage: the largest number of updates between a gradient's weights and the update applying it."""
        M = self.schedule.n_microbatches
        worst = [0] * self.schedule.n_stages
        for (stage, j), version in self.versions_used.items():
            worst[stage] = max(worst[stage], j // M - version)
        return worst

    def peak_activations(self) -> list[int]:
        """Per stage: the most microbatches whose forward has started and whose last backward has not ended."""
        return [_peak_overlap([(start, end) for _, start, end, _ in lives]) for lives in self._lifetimes()]

    def open_steps(self) -> list[int]:
        """Per stage: the most optimizer steps under way at once, each from the first forward of its first
        microbatch to the end of its update there (the life of the step's gradients, and in the distributed
        runtime's asynchronous loop of the step's own copy of the weights)."""
        M = self.schedule.n_microbatches
        counts = []
        for stage, lives in enumerate(self._lifetimes()):
            first: dict[int, float] = {}
            for j, start, _, _ in lives:
                first[j // M] = min(first.get(j // M, start), start)
            events = sorted(e for t, start in first.items()
                            for e in ((start, 1), (self.updates.get((stage, t), start), -1)))
            level = peak = 0
            for _, delta in events:
                level += delta
                peak = max(peak, level)
            counts.append(peak)
        return counts

    def weight_versions(self) -> list[int]:
        """Per stage: the most weight versions alive at once (the newest plus every older one still in use).

        Counted at time 0 and at each of the stage's updates (the only moments the newest version changes):
        a microbatch holds its version from its forward's start until its last backward part ends. One sweep
        over the sorted starts, ends and updates of the stage."""
        peaks = []
        updated: list[list[float]] = [[] for _ in range(self.schedule.n_stages)]
        for (stage, _), t in self.updates.items():
            updated[stage].append(t)
        for stage, lives in enumerate(self._lifetimes()):
            times = sorted(updated[stage])
            starts = sorted((start, version) for _, start, _, version in lives)
            ends = sorted((end, version) for _, _, end, version in lives)
            holders: dict[int, int] = defaultdict(int)  # version -> microbatches holding it now
            distinct = i_start = i_end = newest = 0
            peak = 1
            for time in sorted({*times, 0.0}):
                while i_start < len(starts) and starts[i_start][0] <= time:
                    distinct += holders[starts[i_start][1]] == 0
                    holders[starts[i_start][1]] += 1
                    i_start += 1
                while i_end < len(ends) and ends[i_end][0] <= time:  # an end never precedes its start
                    holders[ends[i_end][1]] -= 1
                    distinct -= holders[ends[i_end][1]] == 0
                    i_end += 1
                while newest < len(times) and times[newest] <= time:
                    newest += 1
                peak = max(peak, distinct + (holders[newest] == 0))
            peaks.append(peak)
        return peaks

    def _lifetimes(self) -> list[list[tuple[int, float, float, int]]]:
        """Per stage, ``(microbatch, forward start, last backward end, version)`` of each microbatch it ran."""
        spans = self.spans  # looked up by plain tuples, which hash and compare as Actions do, and faster
        lives: list[list[tuple[int, float, float, int]]] = [[] for _ in range(self.schedule.n_stages)]
        for (stage, j), version in self.versions_used.items():
            last = spans.get((stage, "W", j)) or spans[(stage, "B", j)]
            lives[stage].append((j, spans[(stage, "F", j)][0], last[1], version))
        return lives


def _peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals ``[start, end)`` that overlap at one moment (an end before a start at equal times)."""
    level = peak = 0
    for _, delta in sorted(e for start, end in intervals for e in ((start, 1), (end, -1))):
        level += delta
        peak = max(peak, level)
    return peak


@dataclass
class _Run:
    """A simulation under way: each rank's place in its order and its clock, and per stage and microbatch the end
    times the next actions wait for."""

    tl: Timeline
    n_microbatches: int
    split: bool
    duration: dict[str, float]
    """Each kind of action's time on one of a rank's ``chunks`` stages (``B`` without ``W`` when split)."""
    queue: list[list[Action | None]]
    """Each rank's order with None past its end, so "the next action" needs no bounds check."""
    ptr: list[int]
    clock: list[float]
    f_end: list[list[float | None]]
    b_end: list[list[float | None]]
    rank: list[int]
    hop: list[float]
    """``hop[s]``: the communication time into stage ``s`` from ``s - 1`` (or back), zero on one rank."""
    remaining: list[list[int]]
    """Backward parts still to run on each stage before each step's update."""
    pending_w: list[deque[Action]]
    in_flight: list[int]
    """Microbatches holding activations on each rank (zero bubble: until their W)."""
    updates_done: list[int]
    total: int
    """Every action to run, the W of a split backward included."""


def _start(schedule: Schedule, costs: Costs) -> _Run:
    """Nothing run yet: the durations, each rank's order, and how many backward parts each update waits for."""
    S, R, M = schedule.n_stages, schedule.n_ranks, schedule.n_microbatches
    chunks = S // R
    split = schedule.split_backward
    duration = {
        "F": costs.forward / chunks,
        "B": (costs.backward - (costs.weight if split else 0.0)) / chunks,
        "W": costs.weight / chunks,
    }
    n_units = schedule.n_steps * M  # microbatch indices run over 0 .. n_units - 1
    rank = [schedule.rank_of(s) for s in range(S)]
    remaining = [[0] * schedule.n_steps for _ in range(S)]
    parts = 2 if split else 1
    for order in schedule.orders:
        for a in order:
            if a.kind == "B":
                remaining[a.stage][a.microbatch // M] += parts
    total = sum(map(len, schedule.orders)) + (sum(map(sum, remaining)) // 2 if split else 0)
    return _Run(
        tl=Timeline(schedule, update_s=costs.update / chunks), n_microbatches=M, split=split, duration=duration,
        queue=[[*order, None] for order in schedule.orders], ptr=[0] * R, clock=[0.0] * R,
        f_end=[[None] * n_units for _ in range(S)], b_end=[[None] * n_units for _ in range(S)], rank=rank,
        hop=[costs.comm if rank[s] != rank[s - 1] else 0.0 for s in range(S)], remaining=remaining,
        pending_w=[deque() for _ in range(R)], in_flight=[0] * R, updates_done=[0] * S, total=total)


def _inputs_ready(run: _Run) -> Callable[[Action], float | None]:
    """``ready_time(a)``: when ``a``'s inputs exist, or None while one is still to be computed."""
    f_end, b_end, hop, last = run.f_end, run.b_end, run.hop, len(run.f_end) - 1

    def ready_time(a: Action) -> float | None:
        s, kind, j = a
        if kind == "F":
            if s == 0:
                return 0.0
            end = f_end[s - 1][j]
            return None if end is None else end + hop[s]
        if kind != "B":
            return 0.0
        own = f_end[s][j]
        if own is None:
            return None
        if s == last:
            return own + 0.0
        later = b_end[s + 1][j]
        return None if later is None else max(own + 0.0, later + hop[s + 1])

    return ready_time


def _version_rule(policy: Versions, updates_done: list[int]) -> Callable[[int, int], int]:
    """``version(stage, step)``: the weights a forward of ``step`` uses at ``stage`` now, as the number of
    updates they have seen, by the schedule's rule (:class:`~bubblefree.schedules.table.Versions`)."""
    if policy is Versions.PER_STEP:  # every microbatch of the step at the version its first one saw
        first_version: dict[tuple[int, int], int] = {}

        def per_step(stage: int, step: int) -> int:
            now = updates_done[stage]
            seen = first_version.setdefault((stage, step), now)
            assert seen == now, f"stage {stage} updated between microbatches of step {step}"
            return now

        return per_step
    if policy is Versions.DOUBLE_BUFFERED:
        # PipeDream-2BW computes every gradient of step t at x_{t-1} on every stage (Narayanan et al. 2021), even
        # where a fresher version already exists (the last stage): a constant delay of one, two versions kept.
        def double_buffered(stage: int, step: int) -> int:
            now, v = updates_done[stage], max(step - 1, 0)
            assert v <= now <= v + 1, f"2BW needs x_{v} at stage {stage}, but {now} updates are done"
            return v

        return double_buffered
    return lambda stage, step: updates_done[stage]  # the newest: after a flush, or at the forward's own time


def _execute(run: _Run, a: Action, start: float, r: int, version: Callable[[int, int], int]) -> None:
    """Run action ``a`` on rank ``r`` from ``start``: its span, the inputs it provides, the weights a forward
    uses, and the update its stage applies after a step's last backward part there."""
    s, kind, j = a
    if kind == "W":
        run.pending_w[r].popleft()
    else:
        run.ptr[r] += 1
    end = start + run.duration[kind]
    tl = run.tl
    tl.spans[a], tl.rank_of[a] = (start, end), r
    run.clock[r] = end
    step = j // run.n_microbatches
    if kind == "F":
        run.in_flight[r] += 1
        run.f_end[s][j] = end
        tl.versions_used[(s, j)] = version(s, step)
        return
    if kind == "B":
        run.b_end[s][j] = end
    if kind == "W" or not run.split:
        run.in_flight[r] -= 1
    run.remaining[s][step] -= 1
    if run.remaining[s][step] == 0:
        # The update runs on this rank right after the step's last backward part here.
        run.clock[r] = tl.updates[(s, step)] = end + tl.update_s
        run.updates_done[s] += 1
    if kind == "B" and run.split:
        run.pending_w[r].append(Action(s, "W", j))


def simulate(schedule: Schedule, costs: Costs = Costs(), *,
             progress: Callable[[int, int], None] | None = None) -> Timeline:
    """List-schedule every rank's actions and return the timeline (deterministic, no randomness).

    Every rank offers one candidate, its next action (or a pending ``W``) with the time it could start; the
    earliest candidate runs, ties going to the lowest rank. Running an action changes only the candidates of
    its own rank and of the ranks whose next action waits for it (the neighbouring stages), so only those are
    recomputed and a heap keeps the earliest: ``O(E log R)`` for ``E`` actions on ``R`` ranks, where scanning
    every rank for every action cost ``O(E R)``. ``progress(done, total)``, if given, is called every
    ``PROGRESS_EVERY`` actions and after the last. The test suite keeps the full scan as the reference this
    must equal event for event (``tests/timeline_reference.py``).
    """
    run = _start(schedule, costs)
    ready_time = _inputs_ready(run)
    version = _version_rule(schedule.version_policy, run.updates_done)
    S, M = schedule.n_stages, schedule.n_microbatches
    queue, ptr, clock, rank = run.queue, run.ptr, run.clock, run.rank
    pending_w, in_flight = run.pending_w, run.in_flight
    heap: list[tuple[float, int, int, Action]] = []
    push = heapq.heappush
    generation = [0] * schedule.n_ranks  # a heap entry counts only while its rank's generation is unchanged

    def refresh(r: int) -> None:
        """Push rank ``r``'s candidate: its pending W or its next action, at the time it could start."""
        generation[r] += 1
        nxt = queue[r][ptr[r]]
        if pending_w[r]:
            w = pending_w[r][0]
            # A step's weight gradients must be complete before the next step's forward (flush) or at the end,
            # and a new forward may not raise the activations held above 1F1B's P - s (ZB-H1's memory bound).
            must = nxt is None or (
                nxt.kind == "F"
                and (nxt.microbatch // M > w.microbatch // M or in_flight[r] >= S - nxt.stage)
            )
            t_next = ready_time(nxt) if nxt is not None and not must else None
            if must or t_next is None or t_next > clock[r]:
                push(heap, (clock[r], r, generation[r], w))
                return
        if nxt is None:
            return
        t = ready_time(nxt)
        if t is not None:
            push(heap, (max(clock[r], t), r, generation[r], nxt))

    for r in range(schedule.n_ranks):
        refresh(r)
    done = 0
    while heap:
        start, r, gen, a = heapq.heappop(heap)
        if gen != generation[r]:
            continue  # superseded: this rank's candidate changed after the entry was pushed
        _execute(run, a, start, r, version)
        refresh(r)
        # The only other candidates this action can change: the next stage's forward and the previous stage's
        # backward of the same microbatch, where they are next in their rank's order.
        s, kind, j = a
        if kind == "F" and s + 1 < S and (nr := rank[s + 1]) != r and queue[nr][ptr[nr]] == (s + 1, "F", j):
            refresh(nr)
        if kind == "B" and s > 0 and (nr := rank[s - 1]) != r and queue[nr][ptr[nr]] == (s - 1, "B", j):
            refresh(nr)
        done += 1
        if progress is not None and (done % PROGRESS_EVERY == 0 or done == run.total):
            progress(done, run.total)
    missing = sum(map(len, schedule.orders)) - sum(ptr)
    assert missing == 0, f"schedule {schedule.name} deadlocked with {missing} actions unscheduled"
    return run.tl
