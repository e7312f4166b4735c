"""Draw timelines as in the pipeline papers: one row per rank, one block per action, coloured per microbatch.

The same drawing serves the simulator's :class:`~bubblefree.schedules.timeline.Timeline` and the runtime's
measured traces (``trace/rank<r>.jsonl``, read by ``bubblefree.bench.pipeline``), so the two can be put in one
picture, one panel each: :func:`draw_timelines` for simulated ones, :func:`draw_panels` for any mix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bubblefree.schedules.timeline import Timeline

__all__ = ["MAX_DRAWN_BLOCKS", "MAX_ROWS_HEIGHT_IN", "Panel", "Span", "draw_panels", "draw_timelines",
           "timeline_panel"]

MAX_DRAWN_BLOCKS = 20_000
"""Blocks one picture draws at most (each costs about 0.2 ms of CPU, so 4 s). A longer run's picture shows its
first part, where the blocks are wide enough to see: all of it would be blocks narrower than a pixel."""

MAX_ROWS_HEIGHT_IN = 40.0
"""The height of all the picture's rows together at most, in inches (0.45 a rank up to it): at 130 dpi a
picture stays within the 2^16 pixels matplotlib can draw, whatever the number of ranks."""


@dataclass(frozen=True)
class Span:
    """One block: ``kind`` F, B or W of ``microbatch`` on ``rank`` from ``start`` to ``end``."""

    rank: int
    kind: str
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Panel:
    title: str
    n_ranks: int
    spans: tuple[Span, ...]
    xlabel: str = "time (units of the F:B:W costs)"

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.spans), default=1.0)


def timeline_panel(tl: Timeline, *, before: float = math.inf) -> Panel:
    """The simulator's timeline as a panel, titled with its schedule, size and idle fraction; only the blocks
    that start ``before`` the given time (a drawing too long to show whole, :data:`MAX_DRAWN_BLOCKS`)."""
    s = tl.schedule
    spans = tuple(Span(tl.rank_of[a], a.kind, a.microbatch, start, end) for a, (start, end) in tl.spans.items()
                  if start < before)
    title = f"{s.name}: P={s.n_ranks}, M={s.n_microbatches}, idle {tl.idle_fraction():.1%}"
    if len(spans) < len(tl.spans):
        title += _window(before, tl.makespan)
    return Panel(title, s.n_ranks, spans)


def _window(shown: float, whole: float) -> str:
    """What a title adds when only the start of a panel is drawn."""
    return f" (up to time {shown:.4g} of {whole:.4g})"


def draw_timelines(timelines: Sequence[Timeline], path: str | Path, *, max_microbatches: int = 64) -> Path:
    """Write one PNG with a panel per timeline (forward blocks light, backward dark, weight-gradient hatched,
    a legend saying so). Only the first ``max_microbatches`` microbatches are labelled, and a label only where
    it fits inside its block, so labels never overlap.
    """
    # Cut here too, not only in draw_panels: a long run's blocks would all become Spans first.
    starts = sorted(start for tl in timelines for start, _ in tl.spans.values())
    before = starts[MAX_DRAWN_BLOCKS] if len(starts) > MAX_DRAWN_BLOCKS else math.inf
    return draw_panels([timeline_panel(tl, before=before) for tl in timelines], path,
                       max_microbatches=max_microbatches)


def draw_panels(panels: Sequence[Panel], path: str | Path, *, max_microbatches: int = 64, dpi: int = 130,
                max_blocks: int = MAX_DRAWN_BLOCKS) -> Path:
    """Write one PNG with the panels stacked on one time axis (colours and labels as :func:`draw_timelines`).

    Beyond ``max_blocks`` blocks in all, only the time window from 0 that holds the first ``max_blocks`` is
    drawn, and each title says so; beyond ``MAX_ROWS_HEIGHT_IN`` inches of rows, the rows get thinner."""
    # Imported here: matplotlib costs half a second, which only a command that draws should spend.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    makespan = max(p.makespan for p in panels)  # one time scale, so panels compare at a glance
    starts = sorted(s.start for p in panels for s in p.spans)
    if len(starts) > max_blocks:
        makespan = starts[max_blocks]  # the first max_blocks blocks start before it
        panels = [replace(p, spans=tuple(s for s in p.spans if s.start < makespan),
                          title=p.title + _window(makespan, p.makespan)) for p in panels]
    width_in, rows = 12.0, sum(p.n_ranks for p in panels)
    row_in = min(0.45, MAX_ROWS_HEIGHT_IN / rows)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width_in, 1.5 + row_in * rows), squeeze=False)
    cmap = plt.get_cmap("tab20")
    # A label is drawn only where it fits inside its block: at fontsize 6 a character is about 0.055 inch,
    # and the axes span about 85 % of the figure's width.
    per_char = 0.055 * makespan / (0.85 * width_in)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        # One collection per rank, colour and hatch rather than one bar per block: the same picture, drawn in
        # time linear in the blocks with a small constant (a bar each took a millisecond, minutes for 10^5).
        blocks: dict[tuple[int, int, bool], list[tuple[float, float]]] = {}
        for s in panel.spans:
            colour = (s.microbatch % 10) * 2 + (0 if s.kind == "B" else 1)
            blocks.setdefault((s.rank, colour, s.kind == "W"), []).append((s.start, s.end - s.start))
            label = f"{s.kind}{s.microbatch}"
            if s.microbatch < max_microbatches and s.end - s.start > (len(label) + 1) * per_char:
                ax.text((s.start + s.end) / 2, s.rank, label, ha="center", va="center", fontsize=6)
        for (rank, colour, weight), xranges in blocks.items():
            ax.broken_barh(xranges, (rank - 0.4, 0.8), facecolors=cmap(colour), edgecolor="black", linewidth=0.3,
                           hatch="//" if weight else None)
        ticks = range(0, panel.n_ranks, -(-panel.n_ranks // 16))  # at most 16 labels a panel, so none overlap
        ax.set_yticks(ticks, [f"rank {r}" for r in ticks])
        ax.invert_yaxis()
        ax.set_xlim(0, makespan)
        ax.set_title(panel.title, fontsize=9, loc="left")
        ax.set_xlabel(panel.xlabel, fontsize=8)
    legend = [Patch(facecolor=cmap(1), edgecolor="black", label="F: forward"),
              Patch(facecolor=cmap(0), edgecolor="black", label="B: backward (input gradient; all of it without W)"),
              Patch(facecolor=cmap(1), edgecolor="black", hatch="//", label="W: weight gradient"),
              Patch(facecolor="white", edgecolor="white", label="colour: microbatch; label: kind and microbatch "
                                                                  "(where it fits)")]
    fig.legend(handles=legend, loc="upper center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
