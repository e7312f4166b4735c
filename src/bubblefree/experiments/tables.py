"""Statistics over seeds and the markdown cells of the reproduction tables.

Definitions used in every table (all on the final validation loss, nats/token):

- *gap* = mean over seeds of async - mean over seeds of sync (positive: delay hurts);
- *noise floor* = mean over pairs of seeds of ``|sync(seed a) - sync(seed b)|``: the gap two synchronous
  runs that differ only in their seed show, so a gap below it is not an effect;
- *gap recovered* by a correction = ``(async - corrected) / (async - sync)`` (the paper's Table 2 measure;
  100 % closes the gap, 0 % does nothing, negative makes it worse).

Intervals (:func:`paired_interval`, :func:`share_interval`): runs of two arms with the same seed share their
initialisation and data order, so a gap is the mean of the per-seed differences, with a two-sided 95 %
Student-t interval over seeds (``n - 1`` degrees of freedom); a share (ratio of two such means) gets a 95 %
percentile bootstrap over seeds. :func:`verdict` reads an interval: "indistinguishable" only when it holds 0.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["PAPER_360M", "PAPER_MOE", "T975", "fmt", "fmt_interval", "fmt_mean", "fmt_pct", "gap_recovered",
           "losses", "markdown_table", "mean", "noise_floor", "paired", "paired_interval", "share_interval",
           "tokens_per_param", "verdict", "VERDICT_SEEDS"]

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


T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
        2.042)
"""The 0.975 quantile of Student's t with 1, 2, ..., 30 degrees of freedom (beyond 30: 1.96 understates the
interval by under 4 %, and no table here has that many seeds). tests/test_steps.py integrates the density."""


def paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """``a[s] - b[s]`` for every seed ``s`` both have (``{seed: loss}``), in seed order."""
    return [a[s] - b[s] for s in sorted(a.keys() & b.keys())]


def paired_interval(diffs: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of paired differences with its two-sided 95 % t interval; the interval
    is NaN with fewer than two differences (or a diverged run among them)."""
    m = mean(diffs)
    if len(diffs) < 2 or not all(math.isfinite(d) for d in diffs):
        return m, math.nan, math.nan
    half = T975[min(len(diffs) - 1, len(T975)) - 1] * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return m, m - half, m + half


def share_interval(sync: dict[int, float], delayed: dict[int, float], corrected: dict[int, float], *,
                   resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """``(share, low, high)``: the gap recovered, ``mean(delayed - corrected) / mean(delayed - sync)`` over the
    seeds all three have, with a 95 % percentile bootstrap that resamples seeds (a resample whose gap is not
    positive counts as an undefined share, which widens the interval to NaN when over 2.5 % of them are)."""
    seeds = sorted(sync.keys() & delayed.keys() & corrected.keys())
    gap = [delayed[s] - sync[s] for s in seeds]
    won = [delayed[s] - corrected[s] for s in seeds]
    share = gap_recovered(0.0, mean(gap), mean(gap) - mean(won)) if seeds else math.nan
    if len(seeds) < 2 or not math.isfinite(share):
        return share, math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, len(seeds), size=(resamples, len(seeds)))
    g, w = np.asarray(gap)[idx].mean(axis=1), np.asarray(won)[idx].mean(axis=1)
    shares = np.where(g > 0, w / np.where(g > 0, g, 1.0), np.nan)
    if np.isnan(shares).mean() > 0.025:
        return share, math.nan, math.nan
    low, high = np.nanpercentile(shares, [2.5, 97.5])
    return share, float(low), float(high)


VERDICT_SEEDS = 3
"""Fewest paired seeds a verdict is read from: with two, the t interval is 12.7 standard errors wide, so
"indistinguishable" would mostly say that two seeds are few."""


def verdict(low: float, high: float, *, n: int, than: str = "sync") -> str:
    """What a 95 % interval of ``arm - reference`` over ``n`` paired seeds says: worse, better, or
    indistinguishable (it holds 0); no verdict from fewer than :data:`VERDICT_SEEDS` seeds."""
    if n < VERDICT_SEEDS:
        return f"none ({n} seed{'s' if n != 1 else ''})"
    if not (math.isfinite(low) and math.isfinite(high)):
        return "-"
    if low > 0:
        return f"worse than {than}"
    if high < 0:
        return f"better than {than}"
    return f"indistinguishable from {than} at 95 %"


def fmt_interval(m: float, low: float, high: float, digits: int = 3) -> str:
    """``mean [low, high]``, or the mean alone where there is no interval."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return fmt(m, digits)
    return f"{m:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


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
