"""``bubblefree bench depth``: the schedules on paper at the depths users run, from a cost profile measured here.

The profile is one transformer block of a preset (default ``byte-0.5m``, the long scale's model, at its
microbatch of 8 x 256 tokens): the medians over ``reps`` timings of its forward ``F``, its backward's
input-gradient part ``B`` (``autograd.grad`` to the block's input alone), its weight-gradient part ``W``
(to its parameters alone) and one optimizer update ``U`` of its parameters (AdamW, torch's). The simulator
(``schedules.timeline``) then lays out 1F1B, interleaved 1F1B (two chunks per rank), zero bubble (ZB-H1: the
backward split, weight gradients filling the bubble at 1F1B's activation memory) and PipeDream-2BW at
``P`` = 4, 8, 16, 32 stages and ``M`` = P, 2P, 4P microbatches per step, one block per stage (the model grows
with the pipeline, as it does when stages are added to hold a larger model; each rank's costs are the
block's). Per cell: the step time in the profile's seconds, the idle share of the ranks, the most
microbatches whose activations a stage holds at once, and the weight versions a stage keeps; and, for 2BW,
its step time over the best synchronous schedule's at the same ``P`` and ``M``.

Synchronous schedules pay a fill and drain every step; 2BW pays one for the whole run, which ``steps``
optimizer steps of simulation share (default 16, as a real run's thousands of steps would share it less).
The figures are the simulator's, from the measured profile: the distributed runtime is measured against the
simulator by ``bench pipeline``. Timings are noisy on a shared machine; the load average is recorded.

    bubblefree bench depth [--out DIR]      # DIR/depth.json, DIR/depth.md
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bubblefree.schedules.table import get_schedule

__all__ = ["DEPTHS", "PER_STAGE", "SCHEDULES", "SYNCHRONOUS", "depth_markdown", "depth_rows", "measure_block",
           "run"]

DEPTHS = (4, 8, 16, 32)
"""Pipeline stages ``P`` of the table."""
PER_STAGE = (1, 2, 4)
"""Microbatches per step as multiples of ``P``."""
SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble", "2bw")
"""The schedules compared: the best synchronous ones the simulator lays out, and 2BW."""
SYNCHRONOUS = tuple(name for name in SCHEDULES if get_schedule(name).flushes)
"""The schedules that flush every step (2BW's step time is compared with the best of them)."""


def _median_s(fn: Callable[[], Any], reps: int) -> float:
    fn()  # the first call allocates and warms caches
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def measure_block(preset: str = "byte-0.5m", *, batch: int = 8, seq_len: int = 256, reps: int = 30
                  ) -> dict[str, Any]:
    """Seconds of one block's forward, input-gradient, weight-gradient and AdamW update (medians of ``reps``)."""
    from bubblefree.models.layers import rope_cos_sin
    from bubblefree.models.llama import Block
    from bubblefree.models.presets import PRESETS

    torch.manual_seed(0)
    args = PRESETS[preset]()
    block = Block(args, layer=0)
    params = list(block.parameters())
    cos, sin = rope_cos_sin(seq_len, args.head_dim, theta=args.rope_theta, device="cpu")
    x = torch.randn(batch, seq_len, args.dim, requires_grad=True)
    grad_out = torch.randn(batch, seq_len, args.dim)

    def forward() -> torch.Tensor:
        return block(x, cos, sin)

    def input_grad() -> None:
        torch.autograd.grad(forward(), x, grad_out)

    def weight_grad() -> None:
        torch.autograd.grad(forward(), params, grad_out)

    f = _median_s(forward, reps)  # as in training: the graph the backward needs is built
    b = max(_median_s(input_grad, reps) - f, 0.0)  # each gradient's timing includes its own forward
    w = max(_median_s(weight_grad, reps) - f, 0.0)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    u = _median_s(optimizer.step, reps)
    return {"preset": preset, "batch": batch, "seq_len": seq_len, "reps": reps, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "forward_s": f, "input_grad_s": b, "weight_grad_s": w, "update_s": u}


def depth_rows(profile: dict[str, Any], *, depths: Sequence[int] = DEPTHS, per_stage: Sequence[int] = PER_STAGE,
               schedules: Sequence[str] = SCHEDULES, steps: int = 16) -> list[dict[str, Any]]:
    """One row per ``(P, M, schedule)``: step time (the profile's seconds), idle share, peak microbatches in
    flight and weight versions (the most over the stages); 2BW's rows add its step time over the best
    synchronous schedule's."""
    from bubblefree.schedules.ir import build_schedule
    from bubblefree.schedules.timeline import Costs, simulate

    costs = Costs(forward=profile["forward_s"], backward=profile["input_grad_s"] + profile["weight_grad_s"],
                  weight=profile["weight_grad_s"], update=profile["update_s"])
    rows = []
    for P in depths:
        for k in per_stage:
            M = k * P
            cell = []
            for name in schedules:
                timeline = simulate(build_schedule(name, P, M, steps=steps), costs)
                cell.append({"P": P, "M": M, "schedule": name, "step_s": timeline.makespan / steps,
                             "idle": timeline.idle_fraction(), "activations": max(timeline.peak_activations()),
                             "versions": max(timeline.weight_versions())})
            best = min((r for r in cell if r["schedule"] in SYNCHRONOUS), key=lambda r: r["step_s"], default=None)
            for r in cell:
                if r["schedule"] not in SYNCHRONOUS and best is not None:
                    r.update(best_sync=best["schedule"], vs_best_sync=r["step_s"] / best["step_s"])
            rows += cell
    return rows


def depth_markdown(profile: dict[str, Any], rows: list[dict[str, Any]], **_: Any) -> str:
    """The table of docs/throughput.md ("The depths users run"), from :func:`run`'s record."""
    us = 1e6
    load = "" if profile["load_average"] is None else f", load average {profile['load_average']:.1f}"
    head = (f"Profile: one `{profile['preset']}` block, {profile['batch']} x {profile['seq_len']} tokens, "
            f"{profile['threads']} thread(s){load}: F {profile['forward_s'] * us:.0f} us, "
            f"B {profile['input_grad_s'] * us:.0f} us, W {profile['weight_grad_s'] * us:.0f} us, "
            f"U {profile['update_s'] * us:.0f} us (medians of {profile['reps']}).")
    lines = [head, "", "| P | M | schedule | step (ms) | idle | activations held | weight versions | "
             "2BW / best synchronous |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['vs_best_sync']:.3f} (vs {r['best_sync']})" if "vs_best_sync" in r else ""
        lines.append(f"| {r['P']} | {r['M']} | {r['schedule']} | {r['step_s'] * 1e3:.2f} | {r['idle']:.1%} | "
                     f"{r['activations']} | {r['versions']} | {vs} |")
    return "\n".join(lines) + "\n"


def run(out: Path | None = None, *, preset: str = "byte-0.5m", reps: int = 30, steps: int = 16) -> dict[str, Any]:
    """Measure the profile, simulate every cell, print the table; with ``out`` write depth.json and depth.md."""
    profile = measure_block(preset, reps=reps)
    rows = depth_rows(profile, steps=steps)
    text = depth_markdown(profile, rows)
    print(text, end="")
    result = {"profile": profile, "steps": steps, "rows": rows}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "depth.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "depth.md").write_text(text)
    return result
