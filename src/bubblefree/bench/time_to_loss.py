"""Time to quality: wall-clock for 2BW + Error Feedback to reach synchronous 1F1B's final validation loss.

``bubblefree bench time-to-loss`` trains the real model of ``bench pipeline`` (the ``smoke`` preset with
``REAL_OVERRIDES``: Muon, the embedded corpus) on the distributed runtime at ``P = 2`` twice, for the same
number of steps and on the same data: with the stock ``Schedule1F1B`` (synchronous, no delay) and with our
PipeDream-2BW loop (delay 1) plus Error Feedback (arXiv 2606.30634). Both evaluate every ``eval_every``
steps; the wall-clock is rank 0's time inside ``train_step`` (evaluation excluded, the 2BW refill after each
evaluation's drain included). The headline is the training time at which 2BW + EF first reaches 1F1B's
final validation loss, over 1F1B's total training time; a bubble-free schedule that lost nothing to the
delay would reach ``M / (M+P-1)``, and the goal is at most ``1.05 M / (M+P-1)``. The first crossing is only
known to the resolution of the evaluations.

    bubblefree bench time-to-loss --out DIR    # bench_time_to_loss.json, time_to_loss.png, run folders
    bubblefree bench time-to-loss --point 4 --seeds 2 --out DIR
    python -m bubblefree.bench.time_to_loss --scale long --steps 1200 --eval-every 100 --out DIR
    python -m bubblefree.bench.time_to_loss --scale long --point 4 --seeds 2 --out DIR

``--scale long`` trains the long-horizon reproduction scale's base run (``byte-0.5m`` to 20 tokens per
parameter at 1200 steps; docs/results.md) instead, at the learning rate its sweep chose. ``--point K`` (long
scale) trains the base run of the ``steps`` suite's point ``K`` instead (the same tokens in ``K`` times the
steps, ``experiments.suite_runs.steps_overrides``), each schedule at the rate its arm chose on the suite's own sweep
(1F1B: the ``sync`` arm's, 2BW + EF: the ``ef`` arm's; ``--lr`` overrides both); the steps default to the
point's and the evaluations to :data:`POINT_EVALS` per run.

``--seeds N`` trains both schedules on ``N`` seeds, each pair on the same seed (initialisation and data order).
At a point they are the steps suite's reported seeds ``1 .. N``: seed 0 chose the rates, and each run here
has a simulated twin among the suite's runs. Otherwise they count up from the base run's seed (0), so one
seed is the bench as it always ran. Per seed: the ratio above and whether it meets the goal; over seeds: the
median and the range, and from :data:`~bubblefree.experiments.tables.VERDICT_SEEDS` seeds on the mean with
its 95 % t interval (``experiments.tables.paired_interval``). The goal is met overall when every seed meets it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bubblefree.bench.pipeline import REAL_OVERRIDES, run_cases
from bubblefree.config import Config, apply_overrides, parse_override, validate
from bubblefree.errors import UserError, exit_code
from bubblefree.experiments.order import chosen_rates
from bubblefree.experiments.scales import get_scale
from bubblefree.experiments.suites import get_suite
from bubblefree.experiments.sweeps import CHOICE_SEED, cell_run
from bubblefree.experiments.tables import VERDICT_SEEDS, paired_interval
from bubblefree.train.presets import load_config

__all__ = ["ARMS", "MICROBATCHES", "POINT_EVALS", "RUNS", "compare", "configs", "first_reach", "main", "run",
           "summarize"]

RUNS = {"1f1b": ["pipeline.schedule=1f1b", "delay.correction=none"],
        "2bw+ef": ["pipeline.schedule=2bw", "delay.correction=ef"]}
"""The two runs: the base run (the ``smoke`` preset with Muon, the long scale's, or a steps-suite point's arm)
with these overrides."""

ARMS = {"1f1b": "sync", "2bw+ef": "ef"}
"""The ``steps`` suite's arm whose chosen rate each run takes at ``--point``."""

P = 2
"""Pipeline stages, one process each."""

MICROBATCHES = 4
"""Microbatches per step by default (``M``); at a point whose batch is smaller, the batch."""

POINT_EVALS = 48
"""Evaluations per run at ``--point`` by default: the count of the long scale's 1200-step run (every 25 steps,
docs/throughput.md), so a point's crossing is known to the same share of its run."""


def first_reach(evals: list[dict], target: float) -> dict | None:
    """The first evaluation whose validation loss is at most ``target`` (None if none is)."""
    return next((e for e in evals if e["val_loss"] <= target), None)


def compare(curves: dict[str, list[dict]], goal: float) -> dict:
    """One seed's result from its two curves: 1F1B's final validation loss is the target; ``ratio`` is the
    training time at which 2BW + EF's first evaluation at or below it ran, over 1F1B's whole training time
    (None if it never reaches it), met when at most ``goal``."""
    sync, fast = curves["1f1b"], curves["2bw+ef"]
    target, sync_s = sync[-1]["val_loss"], sync[-1]["train_s"]
    reach = first_reach(fast, target)
    ratio = reach and reach["train_s"] / sync_s
    return {"curves": curves, "target_val_loss": target, "sync_train_s": sync_s,
            "async_final_val_loss": fast[-1]["val_loss"], "async_train_s": fast[-1]["train_s"],
            "reached_at_step": reach and reach["step"], "reached_at_s": reach and reach["train_s"],
            "ratio": ratio, "goal_met": ratio is not None and ratio <= goal}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no infinity: None is "never reached"


def summarize(per_seed: list[dict]) -> dict:
    """Over seeds (:func:`compare`'s results): the median ratio and its range, a seed that never reached the
    target counting as an infinite ratio (None in the JSON); with at least ``VERDICT_SEEDS`` seeds the mean
    with its 95 % t interval (None while any seed never reached it); the goal met when every seed meets it."""
    ratios = [math.inf if s["ratio"] is None else s["ratio"] for s in per_seed]
    mean, low, high = paired_interval(ratios) if len(ratios) >= VERDICT_SEEDS else (math.nan,) * 3
    return {"ratio_median": _finite(statistics.median(ratios)), "ratio_min": _finite(min(ratios)),
            "ratio_max": _finite(max(ratios)), "ratio_mean": _finite(mean), "ratio_low": _finite(low),
            "ratio_high": _finite(high), "seeds_goal_met": sum(s["goal_met"] for s in per_seed),
            "goal_met": all(s["goal_met"] for s in per_seed)}


def _plot(per_seed: list[dict], path: Path) -> Path:
    """Validation loss against training wall-clock, one colour per schedule and a line per seed (dotted grey:
    each seed's 1F1B final loss); the right panel zooms on the last half of 1F1B's runs, where the question
    (does 2BW + EF reach 1F1B's final loss first?) is decided."""
    # Imported here: matplotlib costs half a second, which only the plot should spend.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    colours = dict(zip(RUNS, ("C0", "C1")))
    end = max(s["sync_train_s"] for s in per_seed)
    for ax in axes:
        for i, s in enumerate(per_seed):
            for name, evals in s["curves"].items():
                ax.plot([e["train_s"] for e in evals], [e["val_loss"] for e in evals], marker="o", ms=3,
                        color=colours[name], alpha=0.85, label=name if i == 0 else None)
            ax.axhline(s["target_val_loss"], color="grey", ls=":", lw=1, label="1F1B final" if i == 0 else None)
        ax.set_xlabel("training wall-clock, rank 0 (s)")
        ax.grid(alpha=0.3)
    late = [e["val_loss"] for s in per_seed for evals in s["curves"].values() for e in evals
            if e["train_s"] >= end / 2]
    targets = [s["target_val_loss"] for s in per_seed]
    axes[1].set_xlim(end / 2, end * 1.02)
    axes[1].set_ylim(min(late + targets) - 0.005, max(late + targets) + 0.005)
    axes[1].set_title("last half of 1F1B's run" + (f"s ({len(per_seed)} seeds)" if len(per_seed) > 1 else ""),
                      fontsize=9)
    axes[0].set_ylabel("validation loss")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _long_base(steps: int, lr: float | None) -> Config:
    """The ``long`` reproduction scale's base run (``byte-0.5m``, 32 x 256 tokens, compiled blocks) with Muon,
    ``steps`` long, at ``lr`` (default: the rate the scale's sweep chose, if ``results/long`` holds it)."""
    if lr is None:
        chosen = Path("results/long/error-feedback.json")
        lr = json.loads(chosen.read_text())["lrs"].get("muon", 0.0) if chosen.exists() else 0.0
        print(f"learning rate: {f'{lr:g}, the sweep chose it ({chosen})' if lr else 'the registry default'}"
              " (set it with --lr)")
    return apply_overrides(get_scale("long").base, {"optim.name": "muon", "optim.lr": lr, "train.steps": steps})


def _point_bases(point: int, lr: float | None, results: Path) -> dict[str, Config]:
    """Run name -> the ``steps`` suite's run of its arm at ``point`` (seed 0), at the rate the arm chose on the
    suite's sweep in ``results`` (or ``lr``): built by the suite's own ``sweeps.cell_run``."""
    scale = get_scale("long")
    if point not in scale.step_factors:
        raise UserError(f"Invalid --point: {point} (the steps suite's points at the long scale are "
                        f"{', '.join(map(str, scale.step_factors))})")
    cells = {c.variant: c for c in get_suite("steps").cells(scale) if c.x == point}
    if lr is None:
        rates = chosen_rates(results, scale, ("muon",), list(cells.values()),
                             what=f"the steps suite's learning-rate sweep at point {point}",
                             hint=f"bubblefree reproduce steps --scale long --out {results} runs it (or set --lr)")
        lrs = {name: rates[("muon", arm, point)] for name, arm in ARMS.items()}
        print("learning rates: " + ", ".join(f"{name} {lr:g} ({ARMS[name]} arm)" for name, lr in lrs.items())
              + f", chosen on the steps suite's sweep at point {point} ({results}; set both with --lr)")
    else:
        lrs = dict.fromkeys(ARMS, lr)
    return {name: cell_run(scale, "muon", cells[arm], lrs[name], CHOICE_SEED, "best").config
            for name, arm in ARMS.items()}


def configs(*, steps: int | None = None, microbatches: int | None = None, scale: str | None = None,
            point: int | None = None, seeds: int = 1, lr: float | None = None,
            results: Path = Path("results/long")) -> list[tuple[str, int, Config]]:
    """``(run name, seed, validated config)`` of every run, seed after seed (1F1B first): see :func:`run`."""
    if point is not None:
        if scale != "long":
            raise UserError(f"Invalid --point: {point} needs --scale long (the steps suite's points are the long "
                            f"scale's)")
        bases = _point_bases(point, lr, results)
        if steps is not None:
            bases = {name: apply_overrides(b, {"train.steps": steps}) for name, b in bases.items()}
        if microbatches is None:  # the default, unless the point's batch is smaller (the suite caps it there too)
            microbatches = min(MICROBATCHES, bases["1f1b"].train.batch_size)
        first = CHOICE_SEED + 1  # the suite's reported seeds: seed 0 chose the rates
    else:
        steps = 200 if steps is None else steps
        if scale == "long":
            base = _long_base(steps, lr)
        else:
            base = load_config("smoke", None, [*REAL_OVERRIDES, f"train.steps={steps}", "train.eval_batches=8",
                                               *([f"optim.lr={lr}"] if lr is not None else [])])
        bases, first = dict.fromkeys(RUNS, base), base.train.seed
    pipeline = {"pipeline.runtime": "distributed", "pipeline.stages": P,
                "pipeline.microbatches": MICROBATCHES if microbatches is None else microbatches}
    out = []
    for seed in range(first, first + seeds):
        for name, overrides in RUNS.items():
            config = apply_overrides(bases[name], {**pipeline, "train.seed": seed})
            out.append((name, seed, validate(apply_overrides(config, dict(parse_override(config, o)
                                                                          for o in overrides)))))
    return out


def _command(**options) -> str:
    """The module command that reruns this bench (the options given; --out left out: a committed result names
    no path of this machine)."""
    return " ".join(["python -m bubblefree.bench.time_to_loss"] + [
        f"--{key.replace('_', '-')} {value}" for key, value in options.items() if value is not None])


def run(out: Path | None = None, *, steps: int | None = None, eval_every: int | None = None,
        microbatches: int | None = None,
        scale: str | None = None, lr: float | None = None, point: int | None = None, seeds: int = 1,
        results: Path = Path("results/long")) -> dict:
    """Train both runs on each of ``seeds`` seeds, print the table, and write ``bench_time_to_loss.json`` and
    ``time_to_loss.png`` to ``out`` (a temporary folder if None).

    ``scale="long"`` trains the long-horizon scale's base run instead of the ``smoke`` preset with
    :data:`REAL_OVERRIDES` (``lr``: its learning rate, see :func:`_long_base`); with ``point`` the ``steps``
    suite's point instead, each run at its arm's chosen rate read from ``results`` (a UserError while that
    sweep is unfinished; ``lr`` overrides both). ``steps`` defaults to 200 (the point's steps at a point),
    ``eval_every`` to 20 (``steps // POINT_EVALS`` at a point)."""
    for name, value in (("steps", steps), ("eval_every", eval_every), ("seeds", seeds)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"Invalid {name}: {value!r} (must be an integer >= 1)")
    if scale not in (None, "long"):
        raise UserError(f"Invalid scale: {scale!r} (expected 'long' or none)")
    runs = configs(steps=steps, microbatches=microbatches, scale=scale, point=point, seeds=seeds, lr=lr,
                   results=results)
    first = runs[0][2]
    n_steps, M = first.train.steps, first.pipeline.microbatches
    command = _command(scale=scale, point=point, seeds=seeds if seeds != 1 else None, steps=steps,
                       eval_every=eval_every, microbatches=microbatches, lr=lr)
    if eval_every is None:
        eval_every = max(1, n_steps // POINT_EVALS) if point is not None else 20
    root = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="bench_ttl-"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cases = [{"config": config, "eval_every": eval_every, "lr_schedule": True,
              "dir": str(root / "runs" / stamp / f"{name}-s{seed}")} for name, seed, config in runs]
    load = os.getloadavg()[0]
    run_cases(cases, P)
    goal = 1.05 * M / (M + P - 1)
    per_seed = []
    for i in range(0, len(cases), len(RUNS)):
        curves = {name: json.loads((Path(c["dir"]) / "rank0.json").read_text())["evals"]
                  for (name, _, _), c in zip(runs[i:i + len(RUNS)], cases[i:i + len(RUNS)])}
        per_seed.append({"seed": runs[i][1], **compare(curves, goal)})
    lrs = {name: config.optim.lr for name, _, config in runs[:len(RUNS)]}
    result = {"command": command, "preset": first.model.preset, "optimizer": first.optim.name,
              # "lr": the one rate both runs trained at (None where the arms chose different ones: see "lrs")
              "lr": lrs["1f1b"] if len(set(lrs.values())) == 1 else None, "lrs": lrs, "point": point,
              "batch_size": first.train.batch_size, "P": P, "M": M, "steps": n_steps, "eval_every": eval_every,
              "load_before": load, "load_after": os.getloadavg()[0], "goal_ratio": goal, "seeds": per_seed,
              **summarize(per_seed)}
    if len(per_seed) == 1:  # one seed: the fields the bench wrote before it had seeds, at the top level too
        result.update({k: v for k, v in per_seed[0].items() if k != "seed"})
    _report(result)
    if out is not None:
        root.mkdir(parents=True, exist_ok=True)
        picture = _plot(per_seed, root / "time_to_loss.png")
        result["picture"] = picture.name  # beside the JSON: a committed result names no path of this machine
        (root / "bench_time_to_loss.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {root / 'bench_time_to_loss.json'}, {picture}")
    return result


def _report(result: dict) -> None:
    """The table: per seed and run the final validation loss, training time and time per step; per seed the
    ratio; over seeds the median, range and interval."""
    steps, goal = result["steps"], result["goal_ratio"]
    print(f"{'seed':>4}  {'run':<8}{'final val':>10}{'train s':>9}{'s/step':>8}")
    for s in result["seeds"]:
        for name, evals in s["curves"].items():
            last = evals[-1]
            print(f"{s['seed']:>4}  {name:<8}{last['val_loss']:>10.4f}{last['train_s']:>9.1f}"
                  f"{last['train_s'] / steps:>8.3f}")
    for s in result["seeds"]:
        if s["ratio"] is None:
            print(f"seed {s['seed']}: 2bw+ef never reached 1f1b's final validation loss {s['target_val_loss']:.4f} "
                  f"in {steps} steps")
        else:
            print(f"seed {s['seed']}: 2bw+ef reached {s['target_val_loss']:.4f} at step {s['reached_at_step']} after "
                  f"{s['reached_at_s']:.1f} s: {s['ratio']:.3f} x 1f1b's {s['sync_train_s']:.1f} s (goal <= "
                  f"{goal:.3f}: {'met' if s['goal_met'] else 'not met'})")
    if len(result["seeds"]) > 1:
        def fmt(v: float | None) -> str:
            return "never" if v is None else f"{v:.3f}"

        interval = (f"; mean {fmt(result['ratio_mean'])} [{fmt(result['ratio_low'])}, {fmt(result['ratio_high'])}] "
                    f"(95 % t)" if len(result["seeds"]) >= VERDICT_SEEDS else "")
        print(f"over {len(result['seeds'])} seeds: ratio median {fmt(result['ratio_median'])} (range "
              f"{fmt(result['ratio_min'])} to {fmt(result['ratio_max'])}){interval}; goal met on "
              f"{result['seeds_goal_met']} of {len(result['seeds'])} seeds: "
              f"{'met' if result['goal_met'] else 'not met'}")
    print(f"load average {result['load_before']:.1f} before, {result['load_after']:.1f} after, on "
          f"{os.cpu_count()} cpus")


def main(argv: list[str] | None = None) -> int:
    """``python -m bubblefree.bench.time_to_loss``: the exit codes of the ``bubblefree`` command (2: invalid
    input, in one line)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--scale", choices=("long",), default=None)
    parser.add_argument("--point", type=int, default=None, metavar="K",
                        help="with --scale long: the steps suite's point K, at the rates its arms chose")
    parser.add_argument("--seeds", type=int, default=1, metavar="N", help="seeds per schedule (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="default 200; at --point, the point's steps")
    parser.add_argument("--eval-every", type=int, default=None,
                        help=f"default 20; at --point, steps / {POINT_EVALS}")
    parser.add_argument("--microbatches", type=int, default=None,
                        help=f"default {MICROBATCHES} (at --point, at most the point's batch)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--results", type=Path, default=Path("results/long"),
                        help="the steps suite's results folder read at --point (default results/long)")
    a = parser.parse_args(argv)
    try:
        run(a.out, steps=a.steps, eval_every=a.eval_every, microbatches=a.microbatches, scale=a.scale, lr=a.lr,
            point=a.point, seeds=a.seeds, results=a.results)
    except (Exception, KeyboardInterrupt) as e:
        return exit_code(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
