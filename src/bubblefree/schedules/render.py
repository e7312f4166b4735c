"""Draw timelines as in the pipeline papers: one row per rank, one block per action, coloured per microbatch.

The same drawing serves the simulator's :class:`~bubblefree.schedules.timeline.Timeline` and the runtime's
measured traces (``trace/rank<r>.jsonl``, read by ``bubblefree.bench.pipeline``), so the two can be put in one
picture, one panel each: :func:`draw_timelines` for simulated ones, :func:`draw_panels` for any mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bubblefree.schedules.timeline import Timeline

__all__ = ["Panel", "Span", "draw_panels", "draw_timelines", "timeline_panel"]


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


def timeline_panel(tl: Timeline) -> Panel:
    """The simulator's timeline as a panel, titled with its schedule, size and idle fraction."""
    s = tl.schedule
    spans = tuple(Span(tl.rank_of[a], a.kind, a.microbatch, start, end) for a, (start, end) in tl.spans.items())
    return Panel(f"{s.name}: P={s.n_ranks}, M={s.n_microbatches}, idle {tl.idle_fraction():.1%}", s.n_ranks, spans)


def draw_timelines(timelines: Sequence[Timeline], path: str | Path, *, max_microbatches: int = 64) -> Path:
    """Write one PNG with a panel per timeline (forward blocks light, backward dark, weight-gradient hatched,
    a legend saying so). Only the first ``max_microbatches`` microbatches are labelled, and a label only where
    it fits inside its block, so labels never overlap.
    """
    return draw_panels([timeline_panel(tl) for tl in timelines], path, max_microbatches=max_microbatches)


def draw_panels(panels: Sequence[Panel], path: str | Path, *, max_microbatches: int = 64, dpi: int = 130) -> Path:
    """Write one PNG with the panels stacked on one time axis (colours and labels as :func:`draw_timelines`)."""
    # Imported here: matplotlib costs half a second, which only a command that draws should spend.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    width_in = 12.0
    fig, axes = plt.subplots(len(panels), 1, figsize=(width_in, 1.5 + 0.45 * sum(p.n_ranks for p in panels)),
                             squeeze=False)
    cmap = plt.get_cmap("tab20")
    makespan = max(p.makespan for p in panels)  # one time scale, so panels compare at a glance
    # A label is drawn only where it fits inside its block: at fontsize 6 a character is about 0.055 inch,
    # and the axes span about 85 % of the figure's width.
    per_char = 0.055 * makespan / (0.85 * width_in)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        for s in panel.spans:
            color = cmap((s.microbatch % 10) * 2 + (0 if s.kind == "B" else 1))
            ax.barh(s.rank, s.end - s.start, left=s.start, height=0.8, color=color, edgecolor="black",
                    linewidth=0.3, hatch="//" if s.kind == "W" else None)
            label = f"{s.kind}{s.microbatch}"
            if s.microbatch < max_microbatches and s.end - s.start > (len(label) + 1) * per_char:
                ax.text((s.start + s.end) / 2, s.rank, label, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(panel.n_ranks), [f"rank {r}" for r in range(panel.n_ranks)])
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
