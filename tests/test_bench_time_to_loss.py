"""``bench time-to-loss``: the per-seed ratio and its summary over seeds, ``--point`` building the ``steps``
suite's own runs at the rates its arms chose (and refusing an unfinished sweep), and one tiny two-seed run of
the whole bench on the distributed runtime."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics

import pytest

from bubblefree.bench import time_to_loss
from bubblefree.bench.time_to_loss import RUNS, compare, configs, summarize
from bubblefree.config import validate
from bubblefree.errors import UserError
from bubblefree.experiments import get_scale, get_suite, run_id
from bubblefree.experiments.suite_runs import steps_overrides
from bubblefree.experiments.sweeps import cell_run, cell_sweep_runs
from bubblefree.experiments.tables import t_quantile
from helpers import run_cli

GOAL = 1.05 * 4 / 5


def _curves(rng: random.Random, *, reach_at: int | None, n: int = 8) -> tuple[dict, float | None]:
    """Two made-up curves and the ratio they are built to give: 2BW + EF's loss is above 1F1B's final loss
    until its evaluation ``reach_at`` (never, if None), and its clock runs at 0.85 of 1F1B's."""
    sync_t = [(i + 1) * rng.uniform(9, 11) for i in range(n)]
    sync_t = sorted(sync_t)
    target = 2.0 + rng.random()
    sync = [{"step": 10 * (i + 1), "train_s": t, "val_loss": target + 0.1 * (n - 1 - i)} for i, t in enumerate(sync_t)]
    fast = [{"step": 10 * (i + 1), "train_s": 0.85 * t,
             "val_loss": target - 0.01 if reach_at is not None and i >= reach_at else target + 0.05 * (n - i)}
            for i, t in enumerate(sync_t)]
    ratio = None if reach_at is None else fast[reach_at]["train_s"] / sync_t[-1]
    return {"1f1b": sync, "2bw+ef": fast}, ratio


def test_each_seed_s_ratio_and_the_summary_over_seeds():
    rng = random.Random(0)
    built = [_curves(rng, reach_at=k) for k in (7, 5, 3, 6)]
    per_seed = [compare(curves, GOAL) for curves, _ in built]
    for got, (curves, ratio) in zip(per_seed, built):
        assert got["ratio"] == pytest.approx(ratio, rel=1e-12)
        assert got["target_val_loss"] == curves["1f1b"][-1]["val_loss"]
        assert got["goal_met"] == (ratio <= GOAL)
    ratios = [r for _, r in built]
    assert any(r <= GOAL for r in ratios) and any(r > GOAL for r in ratios)  # both verdicts are exercised
    s = summarize(per_seed)
    assert s["ratio_median"] == pytest.approx(statistics.median(ratios))
    assert (s["ratio_min"], s["ratio_max"]) == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))
    half = t_quantile(0.975, len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios))
    assert s["ratio_mean"] == pytest.approx(statistics.fmean(ratios))
    assert (s["ratio_low"], s["ratio_high"]) == (pytest.approx(statistics.fmean(ratios) - half),
                                                 pytest.approx(statistics.fmean(ratios) + half))
    assert s["seeds_goal_met"] == sum(r <= GOAL for r in ratios) and s["goal_met"] is False
    # Two seeds: a median and a range, no interval; a seed that never reaches the target is an infinite ratio.
    never = [compare(_curves(rng, reach_at=None)[0], GOAL), per_seed[2]]
    assert never[0]["ratio"] is None and never[0]["reached_at_step"] is None and not never[0]["goal_met"]
    s = summarize(never)
    assert s["ratio_median"] is None and s["ratio_max"] is None and s["ratio_min"] == per_seed[2]["ratio"]
    assert s["ratio_mean"] is s["ratio_low"] is s["ratio_high"] is None and s["goal_met"] is False
    assert summarize(per_seed[2:3])["goal_met"] is per_seed[2]["goal_met"] is True


def _sweep_folder(tmp_path, losses: dict[tuple[str, float], float]):
    """A results folder holding the steps suite's sweep runs at point 4 (Muon, long scale) with these final
    validation losses (``{(arm, lr): loss}``; other runs are left out)."""
    scale = get_scale("long")
    cells = [c for c in get_suite("steps").cells(scale) if c.x == 4]
    (tmp_path / "runs").mkdir(exist_ok=True)
    runs = cell_sweep_runs(scale, ("muon",), cells)
    extension = [cell_run(scale, "muon", c, lr, 0, "sweep") for c in cells for lr in (0.005, 0.08)]
    for run in runs + extension:
        key = (run.variant, run.tags["lr"])
        if key in losses:
            (tmp_path / "runs" / f"{run_id(run)}.json").write_text(
                json.dumps({"id": run_id(run), "final_val_loss": losses[key]}))
    return scale, cells


def test_point_builds_the_steps_suite_s_runs_at_each_arm_s_chosen_rate(tmp_path, capsys):
    # sync's best rate is inside its grid; ef's is at the top end, so the sweep wants 0.08 before it is done
    losses = {("sync", 0.01): 1.31, ("sync", 0.02): 1.29, ("sync", 0.04): 1.30,
              ("async", 0.01): 1.31, ("async", 0.02): 1.30, ("async", 0.04): 1.32,
              ("ef", 0.01): 1.33, ("ef", 0.02): 1.32, ("ef", 0.04): 1.31}
    scale, cells = _sweep_folder(tmp_path, losses)
    (wanted,) = [cell_run(scale, "muon", c, 0.08, 0, "sweep") for c in cells if c.variant == "ef"]
    with pytest.raises(UserError, match=rf"Unfinished sweep: .* point 4 is not finished: 1 run\(s\) missing .*"
                                        rf"e\.g\. {run_id(wanted)}; bubblefree reproduce steps"):
        configs(scale="long", point=4, results=tmp_path)
    # The module's command: one line on stderr, exit 2, nothing trained.
    assert time_to_loss.main(["--scale", "long", "--point", "4", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bubblefree: error: Unfinished sweep") and "Traceback" not in err

    _sweep_folder(tmp_path, {("ef", 0.08): 1.36})  # the extension is worse: ef keeps 0.04
    runs = configs(scale="long", point=4, seeds=2, results=tmp_path)
    assert [(name, seed) for name, seed, _ in runs] == [("1f1b", 1), ("2bw+ef", 1), ("1f1b", 2), ("2bw+ef", 2)]
    arm = {"1f1b": ("sync", 0.02), "2bw+ef": ("ef", 0.04)}  # the rates the made-up sweep chose
    point = steps_overrides(scale, 4)
    for name, seed, config in runs:
        variant, lr = arm[name]
        (cell,) = [c for c in cells if c.variant == variant]
        suite = validate(cell_run(scale, "muon", cell, lr, seed, "best").config)
        assert dataclasses.replace(config, pipeline=suite.pipeline) == suite  # all but the runtime's keys
        assert (config.pipeline.schedule, config.pipeline.runtime, config.pipeline.stages,
                config.pipeline.microbatches) == ({"1f1b": "1f1b", "2bw+ef": "2bw"}[name], "distributed", 2, 4)
        assert (config.train.steps, config.train.batch_size) == (point["train.steps"], point["train.batch_size"])
    # --steps shortens the runs and changes nothing else; --lr sets both runs' rate.
    short = configs(scale="long", point=4, steps=40, results=tmp_path)
    assert [dataclasses.replace(c, train=dataclasses.replace(c.train, steps=full.train.steps))
            for (_, _, c), (_, _, full) in zip(short, runs)] == [c for _, _, c in runs[:2]]
    assert {c.optim.lr for _, _, c in configs(scale="long", point=4, lr=0.003, results=tmp_path)} == {0.003}


@pytest.mark.parametrize("argv, message", [
    (["bench", "train", "--point", "4"], "Invalid --point: only 'bench time-to-loss' takes it"),
    (["bench", "pipeline", "--seeds", "2"], "Invalid --seeds: only 'bench time-to-loss' takes it"),
    (["bench", "time-to-loss", "--seeds", "0"], "Invalid --seeds: 0"),
    (["bench", "time-to-loss", "--point", "16"], "Invalid --point: 16"),
])
def test_bad_bench_options_exit_2_in_one_line(argv, message):
    code, err = run_cli(argv)
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_two_seeds_smoke_run_reports_what_its_curves_say(tmp_path):
    result = time_to_loss.run(tmp_path, steps=4, eval_every=2, seeds=2)
    saved = json.loads((tmp_path / "bench_time_to_loss.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert [s["seed"] for s in saved["seeds"]] == [0, 1] and saved["M"] == 4 and saved["steps"] == 4
    for s in saved["seeds"]:
        assert set(s["curves"]) == set(RUNS)
        assert all([e["step"] for e in evals] == [2, 4] for evals in s["curves"].values())
        assert all(0 < evals[0]["train_s"] < evals[1]["train_s"] for evals in s["curves"].values())
        recomputed = compare(s["curves"], saved["goal_ratio"])
        assert {k: s[k] for k in recomputed} == recomputed  # the ratio and verdict follow from the curves
    # Each seed is its own initialisation and data: the two seeds' curves differ.
    assert saved["seeds"][0]["curves"]["1f1b"][0]["val_loss"] != saved["seeds"][1]["curves"]["1f1b"][0]["val_loss"]
    assert {k: saved[k] for k in summarize(saved["seeds"])} == summarize(saved["seeds"])
    assert "curves" not in saved and saved["picture"] == "time_to_loss.png"  # per-seed fields only in "seeds"
    assert (tmp_path / "time_to_loss.png").stat().st_size > 1000
