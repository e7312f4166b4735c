"""Helper for tests/test_schedules.py: the timeline simulator as it was before it was made fast (issue 46), kept
as the reference the fast one must equal event for event.

``reference_simulate`` scans every rank for every action (``O(actions x ranks)``) and the ``reference_*``
analyses recount from scratch at each moment (quadratic), straight from the definitions in the docstrings of
``bubblefree.schedules.timeline``. Slow, and simple enough to read as the specification.
"""

from __future__ import annotations

from collections import defaultdict, deque

from bubblefree.schedules.ir import Action, Schedule
from bubblefree.schedules.timeline import Costs, Timeline


def reference_simulate(schedule: Schedule, costs: Costs = Costs()) -> Timeline:
    """List scheduling: at each moment every rank's candidate is computed afresh and the earliest
    ``(start, rank)`` runs."""
    S, R, M = schedule.n_stages, schedule.n_ranks, schedule.n_microbatches
    chunks = S // R
    split = schedule.split_backward
    duration = {
        "F": costs.forward / chunks,
        "B": (costs.backward - (costs.weight if split else 0.0)) / chunks,
        "W": costs.weight / chunks,
    }
    tl = Timeline(schedule, update_s=costs.update / chunks)
    ptr, clock = [0] * R, [0.0] * R
    pending_w: list[deque[Action]] = [deque() for _ in range(R)]
    remaining = defaultdict(int)
    for order in schedule.orders:
        for a in order:
            if a.kind == "B":
                remaining[(a.stage, a.microbatch // M)] += 2 if split else 1
    in_flight = [0] * R
    updates_done = defaultdict(int)
    first_version: dict[tuple[int, int], int] = {}

    def ready_time(a: Action) -> float | None:
        deps = []
        if a.kind == "F" and a.stage > 0:
            deps.append(Action(a.stage - 1, "F", a.microbatch))
        if a.kind == "B":
            deps.append(Action(a.stage, "F", a.microbatch))
            if a.stage < S - 1:
                deps.append(Action(a.stage + 1, "B", a.microbatch))
        times = []
        for dep in deps:
            if dep not in tl.spans:
                return None
            hop = costs.comm if schedule.rank_of(dep.stage) != schedule.rank_of(a.stage) else 0.0
            times.append(tl.spans[dep][1] + hop)
        return max(times, default=0.0)

    def version(stage: int, step: int) -> int:
        now = updates_done[stage]
        if schedule.version_policy == "newest":
            seen = first_version.setdefault((stage, step), now)
            assert seen == now
            return now
        return max(step - 1, 0) if schedule.version_policy == "2bw" else now

    def run(rank: int, a: Action, start: float) -> None:
        end = start + duration[a.kind]
        tl.spans[a], tl.rank_of[a] = (start, end), rank
        clock[rank] = end
        step = a.microbatch // M
        in_flight[rank] += {"F": 1, "B": 0 if split else -1, "W": -1}[a.kind]
        if a.kind == "F":
            tl.versions_used[(a.stage, a.microbatch)] = version(a.stage, step)
        if a.kind in ("B", "W"):
            remaining[(a.stage, step)] -= 1
            if remaining[(a.stage, step)] == 0:
                clock[rank] = tl.updates[(a.stage, step)] = end + tl.update_s
                updates_done[a.stage] += 1
        if a.kind == "B" and split:
            pending_w[rank].append(Action(a.stage, "W", a.microbatch))

    while True:
        best = None  # (start, rank, action)
        for r in range(R):
            nxt = schedule.orders[r][ptr[r]] if ptr[r] < len(schedule.orders[r]) else None
            if pending_w[r]:
                w = pending_w[r][0]
                must = nxt is None or (
                    nxt.kind == "F"
                    and (nxt.microbatch // M > w.microbatch // M or in_flight[r] >= S - nxt.stage)
                )
                t_next = ready_time(nxt) if nxt is not None and not must else None
                if must or t_next is None or t_next > clock[r]:
                    cand = (clock[r], r, w)
                    best = cand if best is None or cand[:2] < best[:2] else best
                    continue
            if nxt is None:
                continue
            t = ready_time(nxt)
            if t is not None:
                cand = (max(clock[r], t), r, nxt)
                best = cand if best is None or cand[:2] < best[:2] else best
        if best is None:
            break
        start, r, a = best
        if a.kind == "W":
            pending_w[r].popleft()
        else:
            ptr[r] += 1
        run(r, a, start)
    assert sum(len(o) for o in schedule.orders) == sum(1 for a in tl.spans if a.kind != "W"), "deadlock"
    return tl


def _last_backward_end(tl: Timeline, stage: int, j: int) -> float:
    w = tl.spans.get(Action(stage, "W", j))
    return (w or tl.spans[Action(stage, "B", j)])[1]


def _holding(tl: Timeline, stage: int, time: float) -> list[int]:
    """Microbatches of ``stage`` whose forward has started by ``time`` and whose last backward has not ended."""
    return [j for (s, j) in tl.versions_used
            if s == stage and tl.spans[Action(s, "F", j)][0] <= time < _last_backward_end(tl, s, j)]


def reference_peak_activations(tl: Timeline) -> list[int]:
    """Counted at every forward start (where the count can rise)."""
    return [max((len(_holding(tl, stage, tl.spans[Action(s, "F", j)][0])) for (s, j) in tl.versions_used
                 if s == stage), default=0) for stage in range(tl.schedule.n_stages)]


def reference_weight_versions(tl: Timeline) -> list[int]:
    """Counted at time 0 and at every update of the stage (where the newest version changes)."""
    peaks = []
    for stage in range(tl.schedule.n_stages):
        times = [t for (s, _), t in tl.updates.items() if s == stage]
        peaks.append(max(len({sum(1 for u in times if u <= time)}
                             | {tl.versions_used[(stage, j)] for j in _holding(tl, stage, time)})
                         for time in {*times, 0.0}))
    return peaks


def reference_open_steps(tl: Timeline) -> list[int]:
    """Counted at every step's first forward (where the count can rise)."""
    M = tl.schedule.n_microbatches
    life: dict[tuple[int, int], list[float]] = {}
    for (stage, j) in tl.versions_used:
        start = tl.spans[Action(stage, "F", j)][0]
        key = (stage, j // M)
        life[key] = [min(life.get(key, [start])[0], start), 0.0]
    for (stage, t), span in life.items():
        span[1] = tl.updates.get((stage, t), span[0])
    return [max((sum(1 for (s2, _), (a, b) in life.items() if s2 == stage and a <= start < b)
                 for (s, _), (start, _) in life.items() if s == stage), default=0)
            for stage in range(tl.schedule.n_stages)]


def recurrence(schedule: Schedule, costs: Costs = Costs()) -> tuple[dict[Action, tuple[float, float]],
                                                                       dict[tuple[int, int], float]]:
    """``(spans, updates)`` of a schedule without split backwards, from the recursion alone: each rank runs its
    order in sequence, so an action starts at the later of its rank's previous end (an update included) and
    its inputs' ends (plus ``comm`` across ranks); no global order is involved."""
    assert not schedule.split_backward
    S, M = schedule.n_stages, schedule.n_microbatches
    chunks = S // schedule.n_ranks
    duration = {"F": costs.forward / chunks, "B": costs.backward / chunks}
    left = defaultdict(int)
    for order in schedule.orders:
        for a in order:
            left[(a.stage, a.microbatch // M)] += a.kind == "B"
    spans: dict[Action, tuple[float, float]] = {}
    updates: dict[tuple[int, int], float] = {}
    free = [0.0] * schedule.n_ranks
    at = [0] * schedule.n_ranks
    progressed = True
    while progressed:
        progressed = False
        for r, order in enumerate(schedule.orders):
            while at[r] < len(order):
                s, kind, j = a = order[at[r]]
                deps = ([Action(s - 1, "F", j)] if kind == "F" and s > 0 else []) + (
                    [Action(s, "F", j)] + ([Action(s + 1, "B", j)] if s < S - 1 else []) if kind == "B" else [])
                if any(d not in spans for d in deps):
                    break
                hops = [costs.comm if schedule.rank_of(d.stage) != r else 0.0 for d in deps]
                ready = max((spans[d][1] + hop for d, hop in zip(deps, hops, strict=True)), default=0.0)
                start = max(free[r], ready)
                spans[a] = (start, start + duration[kind])
                free[r] = spans[a][1]
                if kind == "B":
                    left[(s, j // M)] -= 1
                    if left[(s, j // M)] == 0:
                        free[r] = updates[(s, j // M)] = free[r] + costs.update / chunks
                at[r] += 1
                progressed = True
    assert all(at[r] == len(order) for r, order in enumerate(schedule.orders)), "deadlock"
    return spans, updates
