"""``bubblefree simulate``: compare schedules on paper, from the same IR the training's delays are checked against."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from bubblefree.schedules.ir import build_schedule
from bubblefree.schedules.render import draw_timelines
from bubblefree.schedules.timeline import Costs, simulate

__all__ = ["simulate_schedules"]


def simulate_schedules(schedules: Sequence[str], *, stages: int, microbatches: int, costs: Costs = Costs(),
                       steps: int = 8, out: str | Path | None = None) -> list[dict]:
    """Simulate each schedule for ``steps`` optimizer steps, print a table, and draw the timelines.

    The idle fraction counts the whole run, so the asynchronous schedules' single fill and drain are included
    (they shrink as ``steps`` grows; the synchronous ones pay a fill and drain every step).
    """
    rows, timelines = [], []
    for name in schedules:
        tl = simulate(build_schedule(name, stages, microbatches, steps=steps), costs)
        timelines.append(tl)
        rows.append({
            "schedule": name,
            "idle_fraction": tl.idle_fraction(),
            "throughput_vs_ideal": tl.relative_throughput(),
            "delay_per_stage": tl.staleness(),
            "weight_versions": tl.weight_versions(),
            "peak_activations": tl.peak_activations(),
        })
    header = f"{'schedule':<18}{'idle':>7}{'thru/ideal':>12}  {'delay/stage':<18}{'versions':<18}{'activations':<18}"
    print(f"P={stages} M={microbatches} steps={steps} costs F={costs.forward:g} B={costs.backward:g} "
          f"(W={costs.weight:g}) comm={costs.comm:g} update={costs.update:g}")
    print(header)
    for r in rows:
        print(f"{r['schedule']:<18}{r['idle_fraction']:>7.1%}{r['throughput_vs_ideal']:>12.3f}  "
              f"{_short(r['delay_per_stage']):<18}{_short(r['weight_versions']):<18}{_short(r['peak_activations']):<18}")
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        png = draw_timelines(timelines, out / "timeline.png")
        (out / "simulate.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(f"timelines: {png}")
    return rows


def _short(values: list[int]) -> str:
    text = ",".join(map(str, values))
    return text if len(text) <= 16 else text[:14] + ".."
