"""Draw timelines as in the pipeline papers: one row per rank, one block per action, coloured per microbatch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bubblefree.schedules.timeline import Timeline

__all__ = ["draw_timelines"]


def draw_timelines(timelines: Sequence[Timeline], path: str | Path, *, max_microbatches: int = 64) -> Path:
    """Write one PNG with a panel per timeline (forward blocks light, backward dark, weight-gradient hatched).

    Only the first ``max_microbatches`` microbatches are labelled, so long runs stay legible.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.1 + 0.45 * sum(t.schedule.n_ranks for t in timelines)),
                             squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, tl in zip(axes[:, 0], timelines, strict=True):
        s = tl.schedule
        for action, (start, end) in tl.spans.items():
            rank = tl.rank_of[action]
            color = cmap((action.microbatch % 10) * 2 + (0 if action.kind == "B" else 1))
            ax.barh(rank, end - start, left=start, height=0.8, color=color, edgecolor="black", linewidth=0.3,
                    hatch="//" if action.kind == "W" else None)
            if action.microbatch < max_microbatches and end - start > 0.02 * tl.makespan / 4:
                ax.text((start + end) / 2, rank, f"{action.kind}{action.microbatch}", ha="center", va="center",
                        fontsize=6)
        ax.set_yticks(range(s.n_ranks), [f"rank {r}" for r in range(s.n_ranks)])
        ax.invert_yaxis()
        ax.set_xlim(0, tl.makespan)
        ax.set_title(f"{s.name}: P={s.n_ranks}, M={s.n_microbatches}, idle {tl.idle_fraction():.1%}", fontsize=9,
                     loc="left")
    axes[-1, 0].set_xlabel("time (units of the F:B:W costs)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
