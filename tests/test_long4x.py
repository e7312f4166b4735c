"""The tuned scales (``long4x`` and its miniature ``smoke4x``): every suite's arms as cells with their own rate
sweeps, the runs they share with the ``steps`` suite, the MoE's tokens per parameter, and one suite end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bubblefree.experiments import get_scale, reproduce, run_id
from bubblefree.experiments.reproduce import dry_run
from bubblefree.experiments.suite_runs import moe_overrides
from bubblefree.experiments.suites import SUITES
from bubblefree.experiments.sweeps import cell_run
from bubblefree.models.presets import build_model


def test_long4x_runs_are_the_steps_suites_4x_runs():
    """Same config, same id: the 4x runs committed by the steps suite are long4x's, not copies to redo."""
    long, long4x = get_scale("long"), get_scale("long4x")
    steps = {c.variant: c for c in SUITES["steps"].cells(long) if c.x == 4}
    for cell in SUITES["error-feedback"].tuned_cells(long4x):
        for opt, lr, seed in (("muon", 0.01, 0), ("adamw", 0.0012, 3)):
            assert run_id(cell_run(long4x, opt, cell, lr, seed, "best")) == run_id(
                cell_run(long, opt, steps[cell.variant], lr, seed, "best"))


def test_long4x_every_tuned_cell_is_valid_and_seeded_by_its_verdict():
    sc = get_scale("long4x")
    for name, suite in SUITES.items():
        if suite.cells is None:
            continue
        for cell in suite.tuned_cells(sc):
            opt = cell.optimizer or suite.optimizers[0]
            config = cell_run(sc, opt, cell, 1e-3, 0, "sweep").config
            assert config.train.test_split and config.train.batch_size == 8, name
    ef = {c.variant: c.seeds for c in SUITES["error-feedback"].tuned_cells(sc)}
    assert ef == {"sync": 5, "async": 0, "ef": 5}  # 5 reported seeds where the verdict turns, else the scale's 3
    depths = {(c.x, c.variant) for c in SUITES["schedules"].tuned_cells(sc)}
    assert {x for x, _ in depths} == {2, 8, 16} and len(depths) == 15


def test_tuned_moe_sees_the_dense_models_tokens_per_parameter():
    sc = get_scale("long4x")
    over = moe_overrides(sc, tokens_per_param=True)
    dense = build_model(sc.base.model.preset, device="meta").num_params()
    moe = build_model(over["model.preset"], device="meta").num_params()
    per_param = {n: steps * sc.base.train.batch_size * sc.base.train.seq_len / n
                 for n, steps in ((dense, sc.base.train.steps), (moe, over["train.steps"]))}
    assert per_param[moe] == pytest.approx(per_param[dense], rel=2e-4)  # one step's rounding
    assert moe_overrides(sc, tokens_per_param=False) == {"model.preset": over["model.preset"]}


def test_momentum_cells_at_the_default_momentum_are_the_error_feedback_runs():
    sc = get_scale("long4x")
    ef = {c.variant: c for c in SUITES["error-feedback"].tuned_cells(sc)}
    for cell in SUITES["momentum"].tuned_cells(sc):
        if cell.x in (0.9, 0.95) and {cell.optimizer, cell.x} in ({"adamw", 0.9}, {"muon", 0.95}):
            same = run_id(cell_run(sc, cell.optimizer, ef[cell.variant], 1e-3, 1, "best"))
            assert run_id(cell_run(sc, cell.optimizer, cell, 1e-3, 1, "best")) == same


def test_a_suite_without_a_tuned_form_is_one_line_at_a_tuned_scale(tmp_path):
    got = subprocess.run([sys.executable, "-m", "bubblefree", "reproduce", "sensitivity", "--scale", "smoke4x",
                          "--out", str(tmp_path / "r"), "--dry-run"], capture_output=True, text=True)
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert got.stderr.strip().count("\n") == 0 and "no tuned form" in got.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_smoke4x_error_feedback_end_to_end_then_optimizers_reuses_it(tmp_path):
    out, shorter = tmp_path / "results", ("train.steps=48",)  # the smoke4x run in a third of its steps
    got = reproduce("error-feedback", scale="smoke4x", out=out, optimizers=("muon",), progress=False, jobs=2,
                    overrides=shorter)
    reported = [r for r in got["rows"] if r["role"] == "best"]
    seeds = {v: sorted(r["seed"] for r in reported if r["variant"] == v) for v in ("sync", "async", "ef")}
    assert seeds == {"sync": [1, 2], "async": [1], "ef": [1, 2]}  # the scale's 1, the verdict arms' 2
    table = got["table"].read_text()
    assert "at most (one-sided 95 %)" in table and "Fieller" in table and "none (2 seeds)" in table
    record = json.loads((out / "error-feedback.json").read_text())
    assert record["scale"] == "smoke4x" and record["finished"]
    # The optimizers suite's tuned cells are error-feedback's sync and async: nothing left to run.
    assert dry_run("optimizers", scale="smoke4x", out=out, optimizers=("muon",), overrides=shorter)["to_run"] == []
