"""The findings table: every finding of arXiv 2606.30634 (docs/spec.md section 8) beside what the reproduction
measured at 1200 steps (the ``long`` scale: 20.7 tokens per parameter, 32 x 256 tokens per step) and at 4800 steps
(``long4x``: the same tokens in 4x the steps), and the verdict the 4800-step figure carries.

Every cell is computed from the runs' JSON under ``results/`` (nothing typed by hand): ``python -m bubblefree.docs``
writes the table into docs/results.md, and names each cell ``ROW/COLUMN`` (``muon-gap/4800``) so prose can quote a
cell through a marker the same command fills in (``bubblefree.docs``). A figure is a mean of paired per-seed
differences with its 95 % t interval and, in parentheses, the seeds it pairs; a share of a gap has Fieller's
interval (``experiments.tables``). A cell whose runs are not all in says ``-``, or what it has so far with
"so far". The verdict column reads the 4800-step cell (``tables.verdict``, at ``tables.MARGIN``).

At 1200 steps the AdamW and Muon cells are the ``steps`` suite's (every arm tuned, test windows, 3 seeds); the
momentum and mitigations cells are those suites' tuned arms (validation windows, 2 seeds); the other optimizers,
the MoE and the depth were not run there with tuned arms.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bubblefree.errors import UserError
from bubblefree.experiments.reproduce import recorded
from bubblefree.experiments.suite_runs import AJANTHAN, ALL_OPTIMIZERS, RETUNED
from bubblefree.experiments.sweeps import Rows
from bubblefree.experiments.tables import (
    MARGIN,
    PAPER_360M,
    PAPER_MOE,
    fmt,
    fmt_interval,
    fmt_pct,
    gap_recovered,
    markdown_table,
    paired,
    paired_interval,
    share_interval,
    upper_bound,
    verdict,
)

__all__ = ["COLUMNS", "FINDINGS", "Finding", "cells", "findings_markdown"]

COLUMNS = ("paper", "1200", "4800", "verdict")
"""Column keys of a cell's name (``ROW/COLUMN``); ``ROW/bound`` also names the 4800-step figure's one-sided 95 %
upper bound ("at most this much worse"), which the table leaves out."""

_HEADER = ("finding", "paper (360M, 20 tokens/param)", "1200 steps (32 x 256)", "4800 steps (8 x 256)",
           f"verdict at 4800 steps (margin {MARGIN:g})")


@dataclass(frozen=True)
class _Figure:
    """A cell's figure: paired differences (or a share) and how to print them."""

    text: str
    diffs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Finding:
    key: str
    """The row's name in cell names (``muon-gap``)."""
    claim: str
    paper: str
    at_1200: Callable[[Path], _Figure | None] | None = None
    at_4800: Callable[[Path], _Figure | None] | None = None
    reads: str = "diff"
    """``diff``: the verdict reads the 4800-step differences; ``share``: a share, no verdict of its own."""
    than: str = "sync"
    """What the row's differences are taken against, in the verdict's words."""
    unrun: str = "not run"
    """The 1200-step cell of a row with no figure there."""


@functools.cache
def _rows(folder: Path, suite: str) -> tuple[Rows, bool]:
    """``(rows, finished)`` of a suite's reported runs in ``folder`` (empty when it has no record there)."""
    if not (folder / f"{suite}.json").exists():
        return [], False
    got = recorded(folder, suite, partial=True)
    return got.rows + got.knobs, not got.progress


def _loss(r: dict[str, Any]) -> float:
    """A reported run's loss: its test windows where it has them (tuned suites), else its validation windows."""
    value = r["final_test_loss"] if "final_test_loss" in r else r["final_val_loss"]
    return math.inf if value is None else value


def _by_seed(rows: Rows, **match: Any) -> dict[int, float]:
    return {r["seed"]: _loss(r) for r in rows if all(r.get(k) == v for k, v in match.items())}


def _diff_figure(diffs: list[float], finished: bool) -> _Figure | None:
    if not diffs:
        return None
    text = f"{fmt_interval(*paired_interval(diffs))} ({len(diffs)})" + ("" if finished else " so far")
    return _Figure(text, tuple(diffs))


def _share_figure(sync: dict, delayed: dict, corrected: dict, finished: bool) -> _Figure | None:
    share, lo, hi = share_interval(sync, delayed, corrected)
    n = len(sync.keys() & delayed.keys() & corrected.keys())
    if n == 0 or not math.isfinite(share):
        return None if n == 0 else _Figure(f"- (no gap, {n})")
    interval = f" [{fmt_pct(lo)}, {fmt_pct(hi)}]" if math.isfinite(lo) else " [unbounded]"
    return _Figure(f"{fmt_pct(share)}{interval} ({n})" + ("" if finished else " so far"))


def _arm(folder: str, suite: str, arm: str, ref: str = "sync", **match: Any) -> Callable[[Path], _Figure | None]:
    """``arm - ref`` over the reported seeds of ``suite`` in ``results/folder``, rows matching ``match``."""
    def figure(results: Path) -> _Figure | None:
        rows, finished = _rows(results / folder, suite)
        best = [r for r in rows if r.get("role", "best") == "best"]
        return _diff_figure(paired(_by_seed(best, variant=arm, **match), _by_seed(best, variant=ref, **match)),
                            finished)
    return figure


def _share(folder: str, suite: str, delayed: str, corrected: str, **match: Any) -> Callable[[Path], _Figure | None]:
    def figure(results: Path) -> _Figure | None:
        rows, finished = _rows(results / folder, suite)
        best = [r for r in rows if r.get("role", "best") == "best"]
        return _share_figure(*(_by_seed(best, variant=v, **match) for v in ("sync", delayed, corrected)), finished)
    return figure


def _gap_change(folder: str, suite: str, arms: tuple[str, str], x: float, x0: float,
                **match: Any) -> Callable[[Path], _Figure | None]:
    """The gap ``arms[1] - arms[0]`` at ``x`` minus the same gap at ``x0``, paired by seed."""
    def figure(results: Path) -> _Figure | None:
        rows, finished = _rows(results / folder, suite)
        best = [r for r in rows if r.get("role", "best") == "best"]

        def gap(at: float) -> dict[int, float]:
            sync, delayed = (_by_seed(best, variant=v, x=at, **match) for v in arms)
            return {s: delayed[s] - sync[s] for s in sync.keys() & delayed.keys()}
        return _diff_figure(paired(gap(x), gap(x0)), finished)
    return figure


def _gaps_across(first: tuple[str, str, float], second: tuple[str, str, float], opt: str,
                 arm: str = "async") -> Callable[[Path], _Figure | None]:
    """``arm - sync`` in one suite minus ``arm - sync`` in another (each ``(folder, suite, x)``), paired by seed."""
    def figure(results: Path) -> _Figure | None:
        gaps, done = [], True
        for folder, suite, x in (first, second):
            rows, finished = _rows(results / folder, suite)
            best = [r for r in rows if r.get("role", "best") == "best" and r["optimizer"] == opt and r["x"] == x]
            sync, delayed = _by_seed(best, variant="sync"), _by_seed(best, variant=arm)
            gaps.append({s: delayed[s] - sync[s] for s in sync.keys() & delayed.keys()})
            done = done and finished
        return _diff_figure(paired(*gaps), done)
    return figure


def _optimizer_gap_difference(folder: str, suite: str, x: float) -> Callable[[Path], _Figure | None]:
    """AdamW's 2BW gap minus Muon's, paired by seed (the same seed gives both optimizers their data order)."""
    def figure(results: Path) -> _Figure | None:
        rows, finished = _rows(results / folder, suite)
        best = [r for r in rows if r.get("role", "best") == "best" and r["x"] == x]
        gaps = []
        for opt in ("adamw", "muon"):
            sync, delayed = (_by_seed(best, optimizer=opt, variant=v) for v in ("sync", "async"))
            gaps.append({s: delayed[s] - sync[s] for s in sync.keys() & delayed.keys()})
        return _diff_figure(paired(*gaps), finished)
    return figure


def _paper_gap(opt: str) -> str:
    sync, delayed, _ = PAPER_360M.get(opt, (None, None, None))
    return fmt(delayed - sync) if sync is not None and delayed is not None else {
        "lion": "degrades", "mars": "degrades badly"}.get(opt, "-")


def _paper_ef(opt: str) -> str:
    sync, _, ef = PAPER_360M.get(opt, (None, None, None))
    return fmt(ef - sync) if sync is not None and ef is not None else "-"


def _paper_share(opt: str) -> str:
    sync, delayed, ef = PAPER_360M.get(opt, (None, None, None))
    return fmt_pct(gap_recovered(sync, delayed, ef)) if None not in (sync, delayed, ef) else "-"


_LABEL = {"adamw": "AdamW", "muon": "Muon", "soap": "SOAP", "adan": "Adan", "lion": "Lion", "mars": "MARS"}


def _findings() -> tuple[Finding, ...]:
    out: list[Finding] = []
    steps_1200 = {"muon", "adamw"}  # the optimizers the steps suite tuned at 1200 steps
    for opt in ALL_OPTIMIZERS:
        name = _LABEL[opt]
        out.append(Finding(f"{opt}-gap", f"{name}: 2BW - sync", _paper_gap(opt),
                           _arm("long", "steps", "async", optimizer=opt, x=1) if opt in steps_1200 else None,
                           _arm("long4x", "error-feedback", "async", optimizer=opt)))
    out.append(Finding("adamw-vs-muon", "AdamW's 2BW gap - Muon's (AdamW degrades more)",
                       fmt(PAPER_360M["adamw"][1] - PAPER_360M["adamw"][0]
                           - (PAPER_360M["muon"][1] - PAPER_360M["muon"][0])),
                       _optimizer_gap_difference("long", "steps", 1),
                       _optimizer_gap_difference("long4x", "error-feedback", 1), than="Muon's gap"))
    for opt in ALL_OPTIMIZERS:
        name = _LABEL[opt]
        out.append(Finding(f"{opt}-ef", f"{name}: 2BW + EF - sync (the paper: EF closes the gap)", _paper_ef(opt),
                           _arm("long", "steps", "ef", optimizer=opt, x=1) if opt in steps_1200 else None,
                           _arm("long4x", "error-feedback", "ef", optimizer=opt)))
        out.append(Finding(f"{opt}-ef-share", f"{name}: share of the 2BW gap EF recovers", _paper_share(opt),
                           _share("long", "steps", "async", "ef", optimizer=opt, x=1) if opt in steps_1200 else None,
                           _share("long4x", "error-feedback", "async", "ef", optimizer=opt), reads="share"))
    for opt in ("muon", "adamw"):
        name = _LABEL[opt]
        # The paper's MoE is reported once (Muon presumed, docs/spec.md section 8).
        moe_paper = (fmt(PAPER_MOE[1] - PAPER_MOE[0]), fmt(PAPER_MOE[2] - PAPER_MOE[0])) if opt == "muon" else (
            "-", "-")
        out.append(Finding(f"moe-{opt}-gap", f"MoE, {name}: 2BW - sync", moe_paper[0], None,
                           _arm("long4x", "moe", "async", optimizer=opt)))
        out.append(Finding(f"moe-{opt}-ef", f"MoE, {name}: 2BW + EF - sync", moe_paper[1], None,
                           _arm("long4x", "moe", "ef", optimizer=opt)))
    for depth in (8, 16):
        for schedule, label, paper in (("pipedream", "PipeDream", "degrades sharply at 16"), ("2bw", "2BW", "flat")):
            out.append(Finding(f"depth{depth}-{schedule}", f"Depth {depth}, Muon: {label} - sync", paper, None,
                               _arm("long4x", "schedules", schedule, optimizer="muon", x=depth)))
        out.append(Finding(f"depth{depth}-pipedream-ef", f"Depth {depth}, Muon: PipeDream + EF - sync", "-", None,
                           _arm("long4x", "schedules", "pipedream + EF", optimizer="muon", x=depth)))
    for opt in ("muon", "adamw"):
        name = _LABEL[opt]
        out.append(Finding(f"momentum-{opt}", f"{name}: 2BW gap at momentum 0.99 - at 0.8 (rate retuned at each)",
                           "higher momentum shrinks the gap",
                           _gap_change("long", "momentum", RETUNED, 0.99, 0.8, optimizer=opt),
                           _gap_change("long4x", "momentum", ("sync", "async"), 0.99, 0.8, optimizer=opt),
                           than="the gap at 0.8"))
        out.append(Finding(f"steps-{opt}", f"{name}: 2BW gap in 4800 steps - in 1200 (same tokens)",
                           "smaller batches shrink the gap", None,
                           _gaps_across(("long", "steps", 4), ("long", "steps", 1), opt),
                           than="the 1200-step gap", unrun="(the reference)"))
    for x, regime in ((2, "2BW"), (8, "PipeDream-8")):
        out.append(Finding(f"ajanthan-{x}", f"{regime}: Ajanthan et al. (NAdamW 0.99) - AdamW + EF", "-",
                           _arm("long", "mitigations", AJANTHAN, ref="AdamW + EF", x=x), than="AdamW + EF"))
    return tuple(out)


FINDINGS = _findings()
"""The rows of the findings table, in the order of docs/spec.md section 8."""


def cells(results: Path) -> dict[str, str]:
    """``{"ROW/COLUMN": text}`` of every cell of the findings table, from the JSON under ``results``."""
    _rows.cache_clear()  # a process may regenerate after new runs landed
    out: dict[str, str] = {}
    for f in FINDINGS:
        figures = {col: (get(results) if get else None) for col, get in (("1200", f.at_1200), ("4800", f.at_4800))}
        out[f"{f.key}/paper"] = f.paper
        for col, figure in figures.items():
            out[f"{f.key}/{col}"] = figure.text if figure else (f.unrun if col == "1200" and not f.at_1200 else "-")
        late = figures["4800"]
        out[f"{f.key}/verdict"] = (verdict(list(late.diffs), than=f.than) if late and late.diffs
                                   and f.reads == "diff" else "-")
        # Not a column: the one-sided 95 % bound, "at most this much worse", for the prose that quotes it.
        out[f"{f.key}/bound"] = (fmt(upper_bound(list(late.diffs))) if late and late.diffs and f.reads == "diff"
                                 else "-")
    return out


def findings_markdown(results: Path) -> str:
    """The findings table (markdown) from the JSON under ``results``."""
    got = cells(results)
    rows = [[f.claim, *(got[f"{f.key}/{c}"] for c in COLUMNS)] for f in FINDINGS]
    return "\n".join([
        markdown_table(_HEADER, rows), "",
        (f"Each figure: the mean of paired per-seed differences (arm - sync unless the row says otherwise, nats "
         f"per byte) with its 95 % t interval and the number of seeds paired; a share with Fieller's 95 % interval. "
         f"Verdicts: *worse* / *better* when the 95 % interval excludes 0; *equivalent within {MARGIN:g}* when the "
         f"90 % interval lies inside ± {MARGIN:g}, the margin declared before the 4800-step runs; otherwise "
         f"*inconclusive*. *not run*: no tuned runs at that step count; *-*: runs still to come "
         f"(docs/results-log.md has the plan); *so far*: part of the seeds are in. Each cell is named "
         f"`ROW/COLUMN` for the prose that quotes it, ROW being "
         f"{', '.join(f'`{f.key}`' for f in FINDINGS[:3])}, ... in row order (`bubblefree.experiments.findings`)."),
    ])


def cell(results: Path, name: str) -> str:
    """One cell by name; a UserError naming the cells for an unknown name."""
    got = cells(results)
    if name not in got:
        raise UserError(f"Invalid cell: {name!r} (cells are ROW/COLUMN, ROW one of "
                        f"{', '.join(f.key for f in FINDINGS)}; COLUMN one of {', '.join(COLUMNS)})")
    return got[name]
