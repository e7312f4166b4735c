"""``bench depth``: the depth table's cells against the closed forms of a pipeline with equal stages, and the
cost profile's measurement."""

from __future__ import annotations

import pytest

from bubblefree.bench.depth import depth_markdown, depth_rows, measure_block

PROFILE = {"preset": "byte-0.5m", "batch": 8, "seq_len": 256, "reps": 1, "threads": 1, "load_average": None,
           "forward_s": 1.0, "input_grad_s": 1.0, "weight_grad_s": 1.0, "update_s": 0.0}
"""F = B = W: a microbatch costs F + B + W = 3 on each stage."""


@pytest.mark.parametrize(("P", "k", "steps"), [(4, 1, 4), (8, 2, 3)])
def test_cells_are_the_closed_forms_of_equal_stages(P, k, steps):
    """1F1B flushes every step: (M + P - 1) microbatch times, idle (P - 1) / (M + P - 1). 2BW fills and drains
    once: (steps * M + P - 1) microbatch times over ``steps`` steps (PipeDream-2BW, Narayanan et al. 2021)."""
    M, unit = k * P, 3.0
    rows = {r["schedule"]: r for r in depth_rows(PROFILE, depths=(P,), per_stage=(k,), steps=steps)}
    assert rows["1f1b"]["step_s"] == pytest.approx((M + P - 1) * unit, rel=1e-12)
    assert rows["1f1b"]["idle"] == pytest.approx((P - 1) / (M + P - 1), rel=1e-12)
    assert rows["2bw"]["step_s"] == pytest.approx((steps * M + P - 1) * unit / steps, rel=1e-12)
    assert rows["1f1b"]["activations"] == P and rows["1f1b"]["versions"] == 1 and rows["2bw"]["versions"] == 2
    best = min(rows[s]["step_s"] for s in ("1f1b", "interleaved-1f1b", "zero-bubble"))
    assert rows["2bw"]["vs_best_sync"] == pytest.approx(rows["2bw"]["step_s"] / best, rel=1e-12)
    assert rows["2bw"]["vs_best_sync"] < 1
    assert "vs_best_sync" not in rows["1f1b"]
    table = depth_markdown(PROFILE, list(rows.values()))
    assert table.count("\n| ") == 4 + 1 and f"| {P} | {M} | 2bw |" in table


def test_the_profile_is_measured():
    profile = measure_block(reps=2, batch=2, seq_len=16)
    assert all(profile[k] > 0 for k in ("forward_s", "weight_grad_s", "update_s")) and profile["input_grad_s"] >= 0
