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

from collections import defaultdict, deque
from dataclasses import dataclass, field

from bubblefree.schedules.ir import Action, Schedule

__all__ = ["Costs", "Timeline", "simulate"]


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
        for action, (start, end) in self.spans.items():
            busy[self.rank_of[action]] += end - start
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
        return self._peak(lambda stage, j: (self.spans[Action(stage, "F", j)][0], self._last_backward_end(stage, j)))

    def open_steps(self) -> list[int]:
        """Per stage: the most optimizer steps under way at once, each from the first forward of its first
        microbatch to the end of its update there (the life of the step's gradients, and in the distributed
        runtime's asynchronous loop of the step's own copy of the weights)."""
        M = self.schedule.n_microbatches
        first: dict[tuple[int, int], float] = {}
        for (stage, j) in self.versions_used:
            start = self.spans[Action(stage, "F", j)][0]
            key = (stage, j // M)
            first[key] = min(first.get(key, start), start)
        counts = []
        for stage in range(self.schedule.n_stages):
            events = [e for (s, t), start in first.items() if s == stage
                      for e in ((start, 1), (self.updates.get((s, t), start), -1))]
            level = peak = 0
            for _, delta in sorted(events):
                level += delta
                peak = max(peak, level)
            counts.append(peak)
        return counts

    def weight_versions(self) -> list[int]:
        """Per stage: the most weight versions alive at once (the newest plus every older one still in use)."""
        S = self.schedule.n_stages
        peaks = []
        for stage in range(S):
            events = sorted({t for (s, _), t in self.updates.items() if s == stage} | {0.0})
            peak = 1
            for time in events:
                newest = sum(1 for (s, _), t in self.updates.items() if s == stage and t <= time)
                live = {newest}
                for (s, j), version in self.versions_used.items():
                    if s == stage and self.spans[Action(s, "F", j)][0] <= time < self._last_backward_end(s, j):
                        live.add(version)
                peak = max(peak, len(live))
            peaks.append(peak)
        return peaks

    def _last_backward_end(self, stage: int, j: int) -> float:
        w = self.spans.get(Action(stage, "W", j))
        return (w or self.spans[Action(stage, "B", j)])[1]

    def _peak(self, interval) -> list[int]:
        counts = []
        for stage in range(self.schedule.n_stages):
            events = []
            for (s, j) in self.versions_used:
                if s == stage:
                    start, end = interval(s, j)
                    events += [(start, 1), (end, -1)]
            level = peak = 0
            for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
                level += delta
                peak = max(peak, level)
            counts.append(peak)
        return counts


def simulate(schedule: Schedule, costs: Costs = Costs()) -> Timeline:
    """List-schedule every rank's actions and return the timeline (deterministic, no randomness)."""
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
    remaining = defaultdict(int)  # (stage, step) -> backward parts still to run before the update
    for order in schedule.orders:
        for a in order:
            if a.kind == "B":
                remaining[(a.stage, a.microbatch // M)] += 2 if split else 1
    in_flight = [0] * R  # microbatches holding activations on each rank (zero bubble: until their W)
    updates_done = defaultdict(int)

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

    def run(rank: int, a: Action, start: float) -> None:
        end = start + duration[a.kind]
        tl.spans[a], tl.rank_of[a] = (start, end), rank
        clock[rank] = end
        step = a.microbatch // M
        in_flight[rank] += {"F": 1, "B": 0 if split else -1, "W": -1}[a.kind]
        if a.kind == "F":
            tl.versions_used[(a.stage, a.microbatch)] = _version(a.stage, step)
        if a.kind in ("B", "W"):
            remaining[(a.stage, step)] -= 1
            if remaining[(a.stage, step)] == 0:
                # The update runs on this rank right after the step's last backward part here.
                clock[rank] = tl.updates[(a.stage, step)] = end + tl.update_s
                updates_done[a.stage] += 1
        if a.kind == "B" and split:
            pending_w[rank].append(Action(a.stage, "W", a.microbatch))

    first_version: dict[tuple[int, int], int] = {}

    def _version(stage: int, step: int) -> int:
        now = updates_done[stage]
        if schedule.version_policy == "newest":  # every microbatch of the step at the version its first one saw
            version = first_version.setdefault((stage, step), now)
            assert version == now, f"stage {stage} updated between microbatches of step {step}"
            return now
        if schedule.version_policy != "2bw":
            return now
        # PipeDream-2BW computes every gradient of step t at x_{t-1} on every stage (Narayanan et al. 2021), even
        # where a fresher version already exists (the last stage): a constant delay of one, two versions kept.
        version = max(step - 1, 0)
        assert version <= now <= version + 1, f"2BW needs x_{version} at stage {stage}, but {now} updates are done"
        return version

    while True:
        best = None  # (start, rank, action)
        for r in range(R):
            nxt = schedule.orders[r][ptr[r]] if ptr[r] < len(schedule.orders[r]) else None
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
    missing = sum(len(o) for o in schedule.orders) - sum(1 for a in tl.spans if a.kind != "W")
    assert missing == 0, f"schedule {schedule.name} deadlocked with {missing} actions unscheduled"
    return tl
