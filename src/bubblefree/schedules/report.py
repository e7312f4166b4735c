"""``bubblefree simulate``: compare schedules on paper, from the same IR the training's delays are checked against.

The simulation costs time and memory in proportion to its actions (``ir.simulated_actions``), which are counted
before anything is built: a request that would need more memory than the machine has is refused with the
estimate (``BYTES_PER_ACTION`` each), and one that takes more than ``PROGRESS_AFTER_S`` seconds says how far it is
on stderr.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bubblefree import interrupts
from bubblefree.errors import UserError
from bubblefree.schedules.ir import build_schedule, simulated_actions
from bubblefree.schedules.render import draw_timelines
from bubblefree.schedules.timeline import Costs, simulate

__all__ = ["BYTES_PER_ACTION", "PROGRESS_AFTER_S", "PROGRESS_EVERY_S", "simulate_schedules"]

BYTES_PER_ACTION = 640
"""Memory one simulated action holds at most, the schedule's action, the timeline's records and the analyses'
sorting all counted: measured 290-460 bytes (tracemalloc) and up to 500 bytes of resident memory (PipeDream,
whose every microbatch is an update) over P = 4-64 and M = 64-256; a test keeps it above the measured peak."""

PROGRESS_AFTER_S = 3.0
"""A simulation still running after this long starts reporting its progress on stderr."""

PROGRESS_EVERY_S = 10.0
"""Where stderr is not a terminal (a log file), the seconds between two progress lines."""


def simulate_schedules(schedules: Sequence[str], *, stages: int, microbatches: int, costs: Costs = Costs(),
                       steps: int = 8, out: str | Path | None = None) -> list[dict]:
    """Simulate each schedule for ``steps`` optimizer steps, print a table, and draw the timelines.

    The idle fraction counts the whole run, so the asynchronous schedules' single fill and drain are included
    (they shrink as ``steps`` grows; the synchronous ones pay a fill and drain every step). Raises
    :class:`~bubblefree.errors.UserError` before simulating anything when the timelines would not fit in the
    machine's memory: one at a time, or all of them with ``out`` (they are drawn together).
    """
    actions = {name: simulated_actions(name, stages, microbatches, steps=steps) for name in schedules}
    _check_memory(actions, drawn=out is not None, request=f"--stages {stages} --microbatches {microbatches} "
                                                          f"--steps {steps}")
    progress = _Progress(actions)
    rows, timelines = [], []
    with _collector_paused():
        for name in schedules:
            progress.phase("building", name)
            schedule = build_schedule(name, stages, microbatches, steps=steps)
            tl = simulate(schedule, costs, progress=progress.simulating(name))
            progress.phase("analysing", name)
            if out is not None:  # kept for the drawing only, so a table alone holds one timeline at a time
                timelines.append(tl)
            rows.append({
                "schedule": name,
                "idle_fraction": tl.idle_fraction(),
                "throughput_vs_ideal": tl.relative_throughput(),
                "delay_per_stage": tl.staleness(),
                "weight_versions": tl.weight_versions(),
                "peak_activations": tl.peak_activations(),
            })
            del tl
    progress.close()
    header = f"{'schedule':<18}{'idle':>7}{'thru/ideal':>12}  {'delay/stage':<18}{'versions':<18}{'activations':<18}"
    print(f"P={stages} M={microbatches} steps={steps} costs F={costs.forward:g} B={costs.backward:g} "
          f"(W={costs.weight:g}) comm={costs.comm:g} update={costs.update:g}")
    print(header)
    for r in rows:
        print(f"{r['schedule']:<18}{r['idle_fraction']:>7.1%}{r['throughput_vs_ideal']:>12.3f}  "
              f"{_short(r['delay_per_stage']):<18}{_short(r['weight_versions']):<18}{_short(r['peak_activations']):<18}")
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        progress.phase(f"drawing {len(timelines)} timelines")
        png = draw_timelines(timelines, out / "timeline.png")
        progress.close()
        (out / "simulate.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(f"timelines: {png}")
    return rows


def machine_memory() -> int | None:
    """Bytes of memory this machine has: its physical memory, or this process's cgroup limit where lower (a
    container's). None where the system does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # cgroup v2 writes "max" for no limit
            total = min(total, int(text))
    return total


def _check_memory(actions: dict[str, int], *, drawn: bool, request: str) -> None:
    have = machine_memory()
    if have is None or not actions:
        return
    held = sum(actions.values()) if drawn else max(actions.values())
    need = held * BYTES_PER_ACTION
    if need <= have:
        return
    which = (f"the {len(actions)} timelines drawn together: {held:,} actions" if drawn else
             f"{max(actions, key=actions.__getitem__)}: {held:,} actions")
    raise UserError(f"simulate {request} would need about {_bytes(need)} of memory ({which} at up to "
                    f"{BYTES_PER_ACTION} bytes each), more than this machine's {_bytes(have)}; use fewer stages, "
                    f"microbatches or steps{' (or no --out)' if drawn else ''}")


class _Progress:
    """How far a ``simulate`` command is, on stderr once it has run ``PROGRESS_AFTER_S`` seconds: what it is doing
    (building, simulating, analysing or drawing) and how many of its actions it has simulated. On a terminal one
    line rewritten in place; elsewhere (a log) a line at each change of phase and every ``PROGRESS_EVERY_S``
    seconds while simulating."""

    def __init__(self, actions: dict[str, int]) -> None:
        self.actions, self.total, self.done = actions, sum(actions.values()), 0
        self.began, self.shown, self.doing = time.monotonic(), 0.0, ""
        self.terminal, self.width = sys.stderr.isatty(), 0

    def phase(self, doing: str, name: str | None = None) -> None:
        """Start a phase, ``doing`` schedule ``name`` (of the command's) or the whole command's."""
        if name is not None:
            doing = f"{doing} {name} ({list(self.actions).index(name) + 1} of {len(self.actions)})"
        self.doing = doing
        self._show(force=True)

    def simulating(self, name: str) -> Callable[[int, int], None]:
        """Start simulating ``name``; the ``progress`` callback of
        :func:`~bubblefree.schedules.timeline.simulate`."""
        self.phase("simulating", name)
        before = self.done

        def report(done: int, _total: int) -> None:
            self.done = before + done
            self._show(force=False)

        return report

    def _show(self, *, force: bool) -> None:
        interrupts.check()  # a signal that came during an import stops the simulation here
        now = time.monotonic()
        if now - self.began < PROGRESS_AFTER_S or not (force or self.terminal or now - self.shown >= PROGRESS_EVERY_S):
            return
        self.shown = now
        line = (f"bubblefree: {self.doing}: {self.done:,} of {self.total:,} actions simulated "
                f"({self.done / self.total:.0%}), {now - self.began:.0f} s")
        if self.terminal:
            print(f"\r{line:<{self.width}}", end="", file=sys.stderr, flush=True)
            self.width = len(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Clear the line of a terminal (the table follows on stdout)."""
        if self.terminal and self.width:
            print(f"\r{'':<{self.width}}\r", end="", file=sys.stderr, flush=True)
            self.width = 0


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The simulation makes millions of tuples and frees none of them until it ends, none in a cycle: the cyclic
    garbage collector would only scan them again and again (a quarter of the time at P = 64, M = 128)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _bytes(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _short(values: list[int]) -> str:
    text = ",".join(map(str, values))
    return text if len(text) <= 16 else text[:14] + ".."
