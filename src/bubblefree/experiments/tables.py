"""Statistics over seeds and the markdown cells of the reproduction tables.

Definitions used in every table (all on the final validation loss, nats/token):

- *gap* = mean over seeds of async - mean over seeds of sync (positive: delay hurts);
- *noise floor* = mean over pairs of seeds of ``|sync(seed a) - sync(seed b)|``: the gap two synchronous
  runs that differ only in their seed show, so a gap below it is not an effect;
- *gap recovered* by a correction = ``(async - corrected) / (async - sync)`` (the paper's Table 2 measure;
  100 % closes the gap, 0 % does nothing, negative makes it worse).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["PAPER_360M", "PAPER_MOE", "fmt", "fmt_mean", "fmt_pct", "gap_recovered", "losses", "markdown_table",
           "mean", "noise_floor", "tokens_per_param"]

# arXiv 2606.30634 as secondary sources quote it (docs/spec.md section 8): 360M models on FineWeb-Edu.
# (sync, async with delay 1, async + EF); None where no number is reported.
PAPER_360M: dict[str, tuple[float | None, float | None, float | None]] = {
    "muon": (2.578, 2.590, 2.583),
    "soap": (2.581, 2.608, 2.590),
    "adan": (2.641, 2.651, None),
    "adamw": (2.612, 2.890, 2.640),
}
PAPER_MOE = (1.906, 1.911, 1.906)
"""The paper's 10B MoE on 200B tokens: sync, async, async + EF (docs/spec.md section 8)."""


def losses(results: Iterable[dict[str, Any]], **match: Any) -> list[float]:
    """Final validation losses of the records whose fields equal ``match`` (one per seed), ``inf`` for a
    diverged run, in seed order."""
    chosen = [r for r in results if all(r.get(k) == v for k, v in match.items())]
    chosen.sort(key=lambda r: r["seed"])
    return [math.inf if r["final_val_loss"] is None else r["final_val_loss"] for r in chosen]


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def noise_floor(sync: Sequence[float]) -> float:
    """Mean ``|a - b|`` over pairs of synchronous seeds (NaN with fewer than two)."""
    pairs = list(itertools.combinations(sync, 2))
    return statistics.fmean(abs(a - b) for a, b in pairs) if pairs else math.nan


def gap_recovered(sync: float, delayed: float, corrected: float) -> float:
    """``(delayed - corrected) / (delayed - sync)``; NaN when there is no gap to recover."""
    gap = delayed - sync
    return (delayed - corrected) / gap if gap > 0 and math.isfinite(corrected) else math.nan


def fmt(value: float | None, digits: int = 3) -> str:
    """``-`` for no value (None or NaN: nothing to compare), ``diverged`` for an infinite loss."""
    if value is None or math.isnan(value):
        return "-"
    return "diverged" if math.isinf(value) else f"{value:.{digits}f}"


def fmt_mean(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± std`` over seeds (sample std), just the value for one seed, ``-`` for none."""
    if not values:
        return "-"
    if len(values) == 1 or not all(math.isfinite(v) for v in values):
        return fmt(mean(values), digits)
    return f"{mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def fmt_pct(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{round(100 * value) or 0} %"  # never "-0 %"


def tokens_per_param(record: dict[str, Any]) -> str:
    """``D / N (D / N_non-embedding)`` of a run record, from the counts the runner stores; ``-`` for a record
    written before the counts were kept."""
    if "tokens_per_param" not in record:
        return "-"
    d_over_n = record["tokens_per_param"]
    return f"{d_over_n:.3g} ({d_over_n * record['params'] / record['params_non_embedding']:.3g})"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
