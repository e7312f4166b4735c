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
    python -m bubblefree.bench.time_to_loss --scale long --steps 1200 --eval-every 100 --out DIR

``--scale long`` trains the long-horizon reproduction scale's base run (``byte-0.5m`` to 20 tokens per
parameter at 1200 steps; docs/results.md) instead, at the learning rate its sweep chose.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from bubblefree.bench.pipeline import REAL_OVERRIDES, run_cases
from bubblefree.config import Config, apply_overrides, parse_override, validate
from bubblefree.experiments.scales import get_scale
from bubblefree.train.presets import load_config

__all__ = ["RUNS", "first_reach", "run"]

RUNS = {"1f1b": ["pipeline.schedule=1f1b", "delay.correction=none"],
        "2bw+ef": ["pipeline.schedule=2bw", "delay.correction=ef"]}
"""The two runs: the ``smoke`` preset (Muon) with these overrides."""


def first_reach(evals: list[dict], target: float) -> dict | None:
    """The first evaluation whose validation loss is at most ``target`` (None if none is)."""
    return next((e for e in evals if e["val_loss"] <= target), None)


def _plot(curves: dict[str, list[dict]], target: float, path: Path) -> Path:
    """Validation loss against training wall-clock; the right panel zooms on the last half of 1F1B's run,
    where the question (does 2BW + EF reach 1F1B's final loss first?) is decided."""
    # Imported here: matplotlib costs half a second, which only the plot should spend.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    end = curves["1f1b"][-1]["train_s"]
    for ax in axes:
        for name, evals in curves.items():
            ax.plot([e["train_s"] for e in evals], [e["val_loss"] for e in evals], marker="o", ms=3, label=name)
        ax.axhline(target, color="grey", ls=":", lw=1, label="1F1B final")
        ax.set_xlabel("training wall-clock, rank 0 (s)")
        ax.grid(alpha=0.3)
    late = [e["val_loss"] for evals in curves.values() for e in evals if e["train_s"] >= end / 2]
    axes[1].set_xlim(end / 2, end * 1.02)
    axes[1].set_ylim(min(late + [target]) - 0.005, max(late) + 0.005)
    axes[1].set_title("last half of 1F1B's run", fontsize=9)
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


def run(out: Path | None = None, *, steps: int = 200, eval_every: int = 20, microbatches: int = 4,
        scale: str | None = None, lr: float | None = None) -> dict:
    """Train both runs, print the table, and write ``bench_time_to_loss.json`` and ``time_to_loss.png`` to
    ``out`` (a temporary folder if None). ``scale="long"`` trains the long-horizon scale's base run instead
    of the ``smoke`` preset with :data:`REAL_OVERRIDES` (``lr``: its learning rate, see :func:`_long_base`)."""
    if steps < 1 or eval_every < 1:
        raise ValueError(f"Invalid steps/eval_every: {steps}/{eval_every} (must be >= 1)")
    if scale not in (None, "long"):
        raise ValueError(f"Invalid scale: {scale!r} (expected 'long' or none)")
    root = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="bench_ttl-"))
    stamp, P = time.strftime("%Y%m%d-%H%M%S"), 2
    pipeline = {"pipeline.runtime": "distributed", "pipeline.stages": P, "pipeline.microbatches": microbatches}
    if scale == "long":
        base = apply_overrides(_long_base(steps, lr), {**pipeline, "log.progress": False})
    else:
        base = load_config("smoke", None, [*REAL_OVERRIDES, f"train.steps={steps}", "train.eval_batches=8"])
        base = apply_overrides(base, pipeline)
    cases = [{"config": validate(apply_overrides(base, dict(parse_override(base, o) for o in overrides))),
              "eval_every": eval_every, "lr_schedule": True, "dir": str(root / "runs" / stamp / name)}
             for name, overrides in RUNS.items()]
    load = os.getloadavg()[0]
    run_cases(cases, P)
    curves = {name: json.loads((Path(c["dir"]) / "rank0.json").read_text())["evals"]
              for name, c in zip(RUNS, cases)}
    sync, fast = curves["1f1b"], curves["2bw+ef"]
    target, sync_s = sync[-1]["val_loss"], sync[-1]["train_s"]
    reach = first_reach(fast, target)
    goal = 1.05 * microbatches / (microbatches + P - 1)
    result = {"command": "bubblefree bench time-to-loss" + (f" --scale {scale}" if scale else ""),
              "preset": cases[0]["config"].model.preset, "lr": cases[0]["config"].optim.lr,
              "optimizer": cases[0]["config"].optim.name,
              "P": P, "M": microbatches, "steps": steps, "eval_every": eval_every, "load_before": load,
              "load_after": os.getloadavg()[0], "curves": curves, "target_val_loss": target, "sync_train_s": sync_s,
              "async_final_val_loss": fast[-1]["val_loss"], "async_train_s": fast[-1]["train_s"],
              "reached_at_step": reach and reach["step"], "reached_at_s": reach and reach["train_s"],
              "ratio": reach and reach["train_s"] / sync_s, "goal_ratio": goal}
    result["goal_met"] = result["ratio"] is not None and result["ratio"] <= goal
    print(f"{'run':<8}{'final val':>10}{'train s':>9}{'s/step':>8}")
    for name, evals in curves.items():
        last = evals[-1]
        print(f"{name:<8}{last['val_loss']:>10.4f}{last['train_s']:>9.1f}{last['train_s'] / steps:>8.3f}")
    if reach is None:
        print(f"2bw+ef never reached 1f1b's final validation loss {target:.4f} in {steps} steps")
    else:
        print(f"2bw+ef reached {target:.4f} at step {reach['step']} after {reach['train_s']:.1f} s: "
              f"{result['ratio']:.3f} x 1f1b's {sync_s:.1f} s (goal <= {goal:.3f}: "
              f"{'met' if result['goal_met'] else 'not met'})")
    print(f"load average {load:.1f} before, {result['load_after']:.1f} after, on {os.cpu_count()} cpus")
    if out is not None:
        root.mkdir(parents=True, exist_ok=True)
        picture = _plot(curves, target, root / "time_to_loss.png")
        result["picture"] = picture.name  # beside the JSON: a committed result names no path of this machine
        (root / "bench_time_to_loss.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {root / 'bench_time_to_loss.json'}, {picture}")
    return result


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--scale", choices=("long",), default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=None)
    a = parser.parse_args()
    run(a.out, steps=a.steps, eval_every=a.eval_every, microbatches=a.microbatches, scale=a.scale, lr=a.lr)
