"""The ``mitigations`` and ``momentum`` suites: each method's knob, its untuned default and its sweep, and the
momentum points, build the runs they claim; the mitigations suite runs end to end at the smoke scale."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from bubblefree.cli import main
from bubblefree.config import apply_overrides
from bubblefree.experiments import SUITES, get_scale, run_id
from bubblefree.experiments.runner import Run
from bubblefree.experiments.suite_runs import MOMENTA
from bubblefree.optim import OPTIMIZERS


def test_momentum_at_the_optimizers_default_is_the_base_run_not_a_copy():
    """AdamW's 0.9 and Muon's 0.95 are their defaults: those momentum points are error-feedback's sync / async
    runs (same ids, so no run twice), while the other momenta set the key and get runs of their own."""
    sc, lrs = get_scale("long"), {"adamw": 2.4e-3, "muon": 0.02}
    momentum = SUITES["momentum"].runs(sc, lrs)
    base = {run_id(r) for r in SUITES["error-feedback"].runs(sc, lrs)}
    for opt, default in (("adamw", 0.9), ("muon", 0.95)):
        assert OPTIMIZERS[opt].momentum == default
        at_default = {run_id(r) for r in momentum if r.optimizer == opt and r.x == default}
        assert len(at_default) == 2 * sc.seeds and at_default <= base
        others = [r for r in momentum if r.optimizer == opt and r.x != default]
        assert others and {r.config.optim.momentum for r in others} == set(MOMENTA) - {default}
        assert not {run_id(r) for r in others} & base


def test_mitigation_defaults_are_the_runs_the_suite_made_before():
    """The untuned defaults keep the configs (hence the ids) of the runs the suite made before it swept knobs."""
    from bubblefree.experiments.suite_runs import TAYLOR_LAMBDA
    from bubblefree.experiments.sweeps import ASYNC, EF, SYNC

    for scale in ("smoke", "cpu", "long"):
        sc = get_scale(scale)
        k = max(1, sc.base.train.steps // 10)
        before = [SYNC, ASYNC, {**ASYNC, "delay.sync_start_steps": k}, {**ASYNC, "delay.sync_cooldown_steps": k},
                  {**ASYNC, "delay.correction": "taylor", "delay.taylor_lambda": TAYLOR_LAMBDA}, EF,
                  {**ASYNC, "delay.correction": "nesterov"}]
        lrs = {"adamw": 6e-4, "muon": 0.01}
        old = {run_id(Run(config=apply_overrides(sc.base, {"optim.name": o, "optim.lr": lr, "train.seed": seed,
                                                           **over}), variant="v"))
               for o, lr in lrs.items() for over in before for seed in range(max(2, sc.seeds))
               if seed < sc.seeds or over is SYNC}
        new = {run_id(r) for r in SUITES["mitigations"].runs(sc, lrs)}
        # + DC-ASGD-a, prediction and the bias-corrected update EMA per optimizer
        assert old <= new and len(new - old) == 3 * 2 * sc.seeds


def test_knob_sweep_extends_past_the_end_like_the_learning_rate():
    from bubblefree.experiments.suite_runs import mitigation_knobs
    from bubblefree.experiments.sweeps import knob_best_runs, knob_extension, knob_sweep_runs

    sc = get_scale("cpu")  # lr_extend 2: up to two ladder steps past each end of a knob's grid
    knobs = {k.method: k for k in mitigation_knobs()}
    nesterov, ef = knobs["update EMA (b_0 = 0)"], knobs["Error Feedback"]
    lrs = {"muon": 0.01}
    runs = knob_sweep_runs(sc, lrs, (nesterov, ef))
    assert [(r.variant, r.tags["value"], r.seed) for r in runs] == [
        (nesterov.method, 0.9, 0), (nesterov.method, 0.95, 0), (nesterov.method, 0.99, 0),
        (ef.method, 0.5, 0), (ef.method, 0.75, 0), (ef.method, 1.0, 0)]
    assert [r.config.delay.ema_beta for r in runs[:3]] == [0.9, 0.95, 0.99]

    def rows(method, losses):
        return [{"optimizer": "muon", "variant": method, "role": "sweep", "value": v, "final_val_loss": loss}
                for v, loss in losses.items()]

    # Nesterov best at the lowest gamma: try 0.8, then 0.5, then stop (the budget); EF best at 1 (the ladder's
    # end): nothing to add; a diverged point never wins.
    tried = rows(nesterov.method, {0.9: 3.2, 0.95: 3.5, 0.99: None}) + rows(ef.method, {0.5: 3.1, 0.75: 3.05, 1.0: 3.0})
    assert [r.tags["value"] for r in knob_extension(sc, lrs, (nesterov, ef), tried)] == [0.8]
    tried += rows(nesterov.method, {0.8: 3.1})
    assert [r.tags["value"] for r in knob_extension(sc, lrs, (nesterov, ef), tried)] == [0.5]
    tried += rows(nesterov.method, {0.5: 3.0})
    assert knob_extension(sc, lrs, (nesterov, ef), tried) == []
    best = knob_best_runs(sc, lrs, (nesterov, ef), tried)
    assert [(r.tags["value"], r.seed) for r in best] == [(0.5, 0), (0.5, 1), (1.0, 0), (1.0, 1)]
    assert run_id(best[2]) == run_id(runs[5])  # the best's seed 0 is its sweep run


def test_sync_switch_fractions_are_exact_step_counts():
    from bubblefree.experiments.suite_runs import mitigation_knobs

    start = mitigation_knobs()[0]
    for steps, frac, k in ((200, 0.1, 20), (40, 0.1, 4), (1200, 0.025, 30), (40, 0.025, 1), (70, 0.1, 7)):
        sc = replace(get_scale("smoke"), base=apply_overrides(get_scale("smoke").base, {"train.steps": steps}))
        assert start.overrides(sc, frac)["delay.sync_start_steps"] == k


@pytest.mark.slow
def test_mitigations_suite_end_to_end_at_smoke_scale(tmp_path):
    """Every method at its default and at its best sweep point, the sweep in the table, the budget stated."""
    from bubblefree.experiments.suite_runs import mitigation_knobs

    out = tmp_path / "results"
    assert main(["reproduce", "mitigations", "--scale", "smoke", "--out", str(out), "--optimizers", "muon"]) == 0
    runs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    knobs = mitigation_knobs()
    # 2 rate-sweep runs (one is sync seed 0), sync seed 1, async, each knob's grid and its default (6 of 7
    # defaults lie on their grid), nothing more at one seed without extensions (smoke: lr_extend 0)
    assert len(runs) == 2 + 1 + 1 + sum(len(set(k.grid) | {k.default}) for k in knobs)
    assert all(math.isfinite(r["final_val_loss"]) for r in runs)
    assert {r["config"]["delay"]["correction"] for r in runs} == {"none", "ef", "taylor", "nesterov", "predict",
                                                                  "update-ema"}
    text = (out / "mitigations.md").read_text()
    assert "Tuning budget:" in text
    results = text.partition("## Results")[2]
    for knob in knobs:
        row = next(line for line in results.splitlines() if line.startswith(f"| muon | {knob.method} |"))
        assert row.count("**") == 2 and len(row.split(";")) == len(knob.grid), row
    for plot in ("mitigations-curves.png", "mitigations-recovered.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from bubblefree.experiments.reproduce import tables

    assert tables(out, "mitigations") in text  # the knob sweep and the budget rebuilt from the JSON too
