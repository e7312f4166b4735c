"""The ``steps`` suite (every arm tuned, choosing and reporting seeds apart), the test split, and the paired
statistics its table reads (checked against a numerically integrated t density and a hand count)."""

from __future__ import annotations

import functools
import json
import math
import statistics

import numpy as np
import pytest

from bubblefree.config import apply_overrides, validate
from bubblefree.data import eval_batches
from bubblefree.experiments import SCALES, get_scale, reproduce, run_id
from bubblefree.experiments.reproduce import report
from bubblefree.experiments.suite_runs import steps_overrides
from bubblefree.experiments.suites import SUITES
from bubblefree.experiments.sweeps import (
    CHOICE_SEED,
    cell_best,
    cell_extension,
    cell_report_runs,
    cell_sweep_runs,
)
from bubblefree.experiments.tables import (
    paired,
    paired_interval,
    share_interval,
    t_quantile,
    upper_bound,
    verdict,
)
from bubblefree.train.build import validation_batches
from bubblefree.train.presets import get_preset

STEPS = SUITES["steps"]


def _t_cdf(x: float, df: int) -> float:
    """Student's t CDF by the trapezoid rule on its density from 0 to x (an independent reference)."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    grid = np.linspace(0.0, x, 200_001)
    density = c * (1 + grid**2 / df) ** (-(df + 1) / 2)
    return 0.5 + float(np.trapezoid(density, grid))


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 9, 19, 30])
@pytest.mark.parametrize("q", [0.95, 0.975])
def test_t_quantiles_match_the_integrated_density(df, q):
    assert _t_cdf(t_quantile(q, df), df) == pytest.approx(q, abs=2e-5)


def test_paired_interval_by_hand():
    a, b = {0: 1.30, 1: 1.35, 2: 1.33, 7: 9.0}, {0: 1.28, 1: 1.30, 2: 1.32}
    diffs = paired(a, b)  # seed 7 has no partner
    assert diffs == pytest.approx([0.02, 0.05, 0.01])
    m, se = 0.08 / 3, statistics.stdev(diffs) / math.sqrt(3)
    assert paired_interval(diffs) == pytest.approx((m, m - 4.302653 * se, m + 4.302653 * se), abs=1e-6)
    assert paired_interval(diffs, 0.90) == pytest.approx((m, m - 2.919986 * se, m + 2.919986 * se), abs=1e-6)
    assert upper_bound(diffs) == pytest.approx(m + 2.919986 * se, abs=1e-6)  # one-sided 95 %
    assert math.isnan(paired_interval([0.1])[1])


@pytest.mark.parametrize("diffs, words", [
    ([0.02, 0.05, 0.01], "inconclusive (3 seeds)"),  # 95 % holds 0, 90 % reaches past 0.01
    ([0.001, -0.002, 0.0, 0.002, -0.001], "equivalent to sync within 0.01"),
    ([0.004, 0.005, 0.006], "equivalent to sync within 0.01 (worse than sync at 95 %)"),  # real but small
    ([0.04, 0.05, 0.06], "worse than sync"),
    ([-0.04, -0.05, -0.06, -0.05], "better than sync"),
    ([-0.003, 0.011, -0.017], "inconclusive (3 seeds)"),  # 95 % interval holds 0: not "matches"
    ([0.04, 0.05], "none (2 seeds)"),  # too few for any verdict
    ([0.01, math.inf, 0.0], "-"),  # a diverged run
])
def test_verdict_reads_the_two_intervals_at_the_margin(diffs, words):
    assert verdict(diffs) == words


def test_equivalence_is_the_90_percent_interval_inside_the_margin():
    # Two one-sided tests at 5 % each: equivalent exactly when m -/+ t(0.95, n-1) se lies inside the margin.
    rng = np.random.default_rng(0)
    for _ in range(200):
        diffs = list(rng.normal(rng.uniform(-0.02, 0.02), rng.uniform(0.001, 0.02), size=rng.integers(3, 8)))
        m, se, n = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs)
        inside = abs(m) + 2.0 * _t_inverse(0.95, n - 1) * se / 2.0 < 0.01
        assert verdict(diffs).startswith("equivalent") == inside


@functools.cache
def _t_inverse(q: float, df: int) -> float:
    """The ``q`` quantile of Student's t by bisection on the integrated density (independent of scipy)."""
    lo, hi = 0.0, 50.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def test_share_interval_is_fiellers():
    sync, delayed, ef = {0: 1.0, 1: 1.1, 2: 1.2}, {0: 1.2, 1: 1.3, 2: 1.4}, {0: 1.1, 1: 1.2, 2: 1.3}
    share, lo, hi = share_interval(sync, delayed, ef)
    assert share == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)  # no spread
    sync, delayed, ef = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.0}, {0: 1.2, 1: 1.32, 2: 1.37, 3: 1.21}, \
        {0: 1.1, 1: 1.25, 2: 1.2, 3: 1.12}
    share, lo, hi = share_interval(sync, delayed, ef)
    a = np.array([delayed[s] - ef[s] for s in range(4)])
    b = np.array([delayed[s] - sync[s] for s in range(4)])
    assert share == pytest.approx(a.mean() / b.mean())
    assert lo < share < hi
    # The ends are the roots of Fieller's quadratic (A - rho B)^2 = t^2 var(A - rho B), with t(0.975, 3).
    t = _t_inverse(0.975, 3)
    for rho in (lo, hi):
        d = a - rho * b
        assert d.mean() ** 2 == pytest.approx(t * t * d.var(ddof=1) / 4, rel=1e-4)
    # A gap not distinguishable from 0 leaves the share unbounded (NaN ends).
    delayed = {0: 1.05, 1: 1.05, 2: 1.25}
    assert all(math.isnan(v) for v in share_interval({0: 1.0, 1: 1.1, 2: 1.2}, delayed, delayed)[1:])


def test_share_interval_agrees_with_the_delta_method_on_many_seeds():
    # With 400 seeds and a gap far from 0, Fieller's interval and the delta method's are the same to 2 %.
    rng = np.random.default_rng(1)
    b = rng.normal(0.06, 0.01, 400)
    a = 0.5 * b + rng.normal(0.0, 0.01, 400)
    sync = {i: 1.0 for i in range(400)}
    delayed = {i: 1.0 + b[i] for i in range(400)}
    ef = {i: 1.0 + b[i] - a[i] for i in range(400)}
    share, lo, hi = share_interval(sync, delayed, ef)
    r = a.mean() / b.mean()
    se = np.sqrt(np.var(a - r * b, ddof=1) / 400) / b.mean()
    assert (lo, hi) == pytest.approx((r - 1.966 * se, r + 1.966 * se), rel=0.02)


def test_test_split_halves_the_same_windows_at_every_batch():
    tokens = np.arange(5000, dtype=np.uint16)
    base = apply_overrides(get_preset("smoke"), {"train.seq_len": 16})
    whole = [x for x, _ in eval_batches(tokens, n_batches=4, batch_size=8, seq_len=16)]
    starts = [int(row[0]) for x in whole for row in x]
    for batch, n in ((8, 4), (4, 8), (2, 16)):
        cfg = apply_overrides(base, {"train.batch_size": batch, "train.eval_batches": n, "train.test_split": True})
        got = {split: [int(row[0]) for x, _ in validation_batches(cfg.train, tokens, "cpu", split) for row in x]
               for split in ("val", "test")}
        assert got["val"] == starts[0::2] and got["test"] == starts[1::2]
        assert all(len(x) == batch for x, _ in validation_batches(cfg.train, tokens, "cpu", "test"))
    with pytest.raises(ValueError, match="test_split"):
        validation_batches(base.train, tokens, "cpu", "test")


@pytest.mark.parametrize("scale", list(SCALES))
def test_steps_points_keep_tokens_windows_and_warmup_share(scale):
    sc = get_scale(scale)
    runs = cell_sweep_runs(sc, STEPS.optimizers, STEPS.cells(sc))
    by_point = {}
    for run in runs:
        c = validate(run.config)
        assert c.train.seed == CHOICE_SEED and c.train.test_split
        by_point.setdefault(run.x, set()).add((c.train.steps * c.train.batch_size,
                                               c.train.eval_batches * c.train.batch_size,
                                               c.train.steps // c.train.eval_every if c.train.eval_every else 1,
                                               c.train.warmup_frac))
    assert set(by_point) == set(sc.step_factors)
    assert len(set.union(*by_point.values())) == 1  # tokens, windows, evaluations and warmup share agree
    with pytest.raises(ValueError, match="steps factor"):
        steps_overrides(sc, 3 * sc.base.train.batch_size)


def _row(run, loss):
    return {"optimizer": run.optimizer, "variant": run.variant, "x": run.x, "seed": run.seed, **run.tags,
            "final_val_loss": loss}


def test_every_arm_sweeps_extends_and_reports_on_other_seeds():
    sc = get_scale("long", seeds=3)
    cells = [c for c in STEPS.cells(sc) if c.x == 4]
    swept = cell_sweep_runs(sc, ("muon",), cells)
    assert len(swept) == 9 and {r.tags["lr"] for r in swept} == {0.01, 0.02, 0.04}
    # sync best inside its grid; async best at the low edge (extends); ef best at 0.02
    loss = {("sync", 0.01): 1.30, ("sync", 0.02): 1.28, ("sync", 0.04): 1.29,
            ("async", 0.01): 1.31, ("async", 0.02): 1.33, ("async", 0.04): 1.40,
            ("ef", 0.01): 1.31, ("ef", 0.02): 1.30, ("ef", 0.04): 1.35}
    rows = [_row(r, loss[r.variant, r.tags["lr"]]) for r in swept]
    (more,) = cell_extension(sc, ("muon",), cells, rows)
    assert (more.variant, more.tags["lr"], more.seed) == ("async", 0.005, CHOICE_SEED)
    rows.append(_row(more, 1.32))  # the extension is worse: the best stays at 0.01
    assert cell_extension(sc, ("muon",), cells, rows) == []
    best = cell_best(rows)
    assert [best["muon", v, 4] for v in ("sync", "async", "ef")] == [0.02, 0.01, 0.02]
    report = cell_report_runs(sc, ("muon",), cells, rows)
    assert {r.seed for r in report} == {1, 2, 3}  # the choice seed never reports
    own = {(r.variant, r.config.optim.lr) for r in report if r.tags["role"] == "best"}
    assert own == {("sync", 0.02), ("async", 0.01), ("ef", 0.02)}
    at_sync = [r for r in report if r.tags["role"] == "sync-lr"]
    assert {(r.variant, r.config.optim.lr) for r in at_sync} == {("async", 0.02)} and len(at_sync) == 3
    assert not {run_id(r) for r in report} & {run_id(r) for r in swept}


@pytest.mark.slow
def test_smoke_steps_suite_end_to_end(tmp_path):
    out = tmp_path / "results"
    got = reproduce("steps", scale="smoke", out=out, optimizers=("muon",), progress=False, jobs=2)
    runs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert all(r["config"]["train"]["test_split"] and math.isfinite(r["final_test_loss"]) for r in runs)
    assert all(r["test_curve"][-1][2] == r["final_test_loss"] for r in runs)
    reported = [r for r in got["rows"] if r["role"] == "best"]
    assert {r["seed"] for r in reported} == {1} and len(reported) == 6  # 3 arms x 2 points x 1 seed
    table = (out / "steps.md").read_text()
    assert table.count("| muon | 40 (8 x 64)") == 1 and table.count("| muon | 80 (4 x 64)") == 1
    assert (out / "steps-gap.png").stat().st_size > 10_000
    again = reproduce("steps", scale="smoke", out=out, optimizers=("muon",), progress=False, jobs=2)
    assert [r["id"] for r in again["rows"]] == [r["id"] for r in got["rows"]]  # nothing re-ran, same choices

    # Under way, as --report sees it: one point's reported runs gone, then every reported run gone.
    for row in got["rows"]:
        if row["x"] == 2 and row["variant"] != "sync":
            (out / "runs" / f"{row['id']}.json").unlink()
    (out / "steps-gap.png").unlink()
    partial = report(out, "steps")
    assert partial["plots"] == [out / "steps-gap.png"] and (out / "steps-gap.png").exists()
    assert "In progress: " in (out / "steps.md").read_text()
    for row in got["rows"]:
        (out / "runs" / f"{row['id']}.json").unlink(missing_ok=True)
    (out / "steps-gap.png").unlink()
    sweep_only = report(out, "steps")
    assert sweep_only["plots"] == [] and not (out / "steps-gap.png").exists()
    text = (out / "steps.md").read_text()
    assert "model `llama-1m`" in text and "| muon | 2 | ef |" in text and "Final test loss" in text
