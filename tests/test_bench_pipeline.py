"""The measured-throughput bench: synthetic stages, the trace accounting, and one tiny run of the whole bench.

The smoke run (P = 2, M = 2, 4 steps of 5 ms / 10 ms stages) checks the runtime's counts of activations in
flight and weight versions against the schedule simulator exactly, and its step time within a loose 50 %
(the machine is shared; docs/throughput.md has the real figures).
"""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch

from bubblefree.bench.pipeline import peak_in_flight, run
from bubblefree.bench.synthetic import SyntheticModel, SyntheticStage, _Sleep
from bubblefree.bench.time_to_loss import first_reach


def test_sleep_function_is_h_times_w_and_takes_its_time():
    h = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: _Sleep.apply(a, b, 0.0, 0.0), (h, w))
    tic = time.perf_counter()
    y = _Sleep.apply(h, w, 0.03, 0.05)
    forward_s = time.perf_counter() - tic
    tic = time.perf_counter()
    y.sum().backward()
    backward_s = time.perf_counter() - tic
    assert 0.03 <= forward_s < 0.03 + 0.5 and 0.05 <= backward_s < 0.05 + 0.5
    torch.testing.assert_close(h.grad, w.detach().expand(2, 3, 4), rtol=0, atol=0)


def test_synthetic_stages_map_tokens_to_logits_and_run_on_meta():
    model = SyntheticModel(3, vocab=5, t_forward=0.0, t_backward=0.0)
    tokens = torch.tensor([[0, 4, 2]])
    h = tokens
    for s in range(3):
        h = model.stage(s)(h)
    torch.testing.assert_close(h, tokens.unsqueeze(-1).expand(1, 3, 5).float() / 5)  # weights start at one
    assert copy.deepcopy(model.stage(0)).to("meta")(tokens.to("meta")).shape == (1, 3, 5)  # shape inference
    with pytest.raises(ValueError, match="Invalid t_forward"):
        SyntheticStage(first=True, vocab=5, t_forward=-1.0, t_backward=0.0)


def test_peak_in_flight_counts_forwards_whose_backward_has_not_ended():
    def rec(stage, kind, unit, start, end):
        return {"stage": stage, "kind": kind, "step": 0, "unit": unit, "start": start, "end": end}

    # stage 0: F0 F1 B0 F2 B1 B2 -> at most 2 in flight; stage 1: F B F B -> 1; updates are ignored.
    records = [rec(0, "F", 0, 0, 1), rec(0, "F", 1, 1, 2), rec(0, "B", 0, 4, 6), rec(0, "F", 2, 6, 7),
               rec(0, "B", 1, 7, 9), rec(0, "B", 2, 9, 11), rec(0, "U", -1, 11, 12),
               rec(1, "F", 0, 1, 2), rec(1, "B", 0, 2, 4), rec(1, "F", 1, 4, 5), rec(1, "B", 1, 5, 7)]
    assert peak_in_flight(records, 2, "1f1b", 3) == [2, 1]


def test_first_reach_is_the_first_evaluation_at_or_below_the_target():
    evals = [{"step": 10, "val_loss": 3.0}, {"step": 20, "val_loss": 2.5}, {"step": 30, "val_loss": 2.4}]
    assert first_reach(evals, 2.5)["step"] == 20
    assert first_reach(evals, 2.0) is None


@pytest.mark.slow
def test_bench_pipeline_smoke_matches_the_simulator(tmp_path):
    # Sleeps long enough that a loaded machine's per-action overhead (a few ms of Python and transfers) stays a
    # small part of each step: this checks the machinery, docs/throughput.md has the real measurement.
    result = run(tmp_path, stages=(2,), multiples=(1,), t_forward=0.02, t_backward=0.04, steps=4, real=False)
    rows = {r["schedule"]: r for r in result["rows"]}
    assert set(rows) == {"gpipe", "1f1b", "2bw"}
    for r in rows.values():
        assert r["peak_activations"] == r["sim_peak_activations"], r
        assert r["weight_versions"] == r["sim_weight_versions"], r
        assert r["prediction_error"] < 0.5, r
    assert rows["2bw"]["weight_versions"] == [2, 2] and rows["1f1b"]["weight_versions"] == [1, 1]
    assert rows["2bw"]["ideal_vs_1f1b"] == 1.5
    saved = json.loads((tmp_path / "bench_pipeline.json").read_text())
    assert [r["schedule"] for r in saved["rows"]] == ["gpipe", "1f1b", "2bw"]
    assert (tmp_path / "pipeline_P2.png").stat().st_size > 1000


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_real_rows_are_predicted_from_their_own_measured_costs(tmp_path, schedule):
    """A real run is predicted from the forward, backward and update times its traces measured. Traces written
    from a simulated timeline must give back those costs and that step time exactly."""
    from bubblefree.bench.pipeline import _analyse
    from bubblefree.schedules.ir import build_schedule
    from bubblefree.schedules.timeline import Costs, simulate
    from bubblefree.train.presets import load_config

    P, M, T, costs = 2, 4, 6, Costs(0.007, 0.013, 0.0, update=0.047)
    tl = simulate(build_schedule(schedule, P, M, steps=T), costs)
    lines = {s: [] for s in range(P)}
    for action, (start, end) in tl.spans.items():
        step, unit = divmod(action.microbatch, M)
        lines[action.stage].append({"rank": action.stage, "replica": 0, "stage": action.stage, "kind": action.kind,
                                    "step": step, "unit": action.microbatch if schedule == "2bw" else unit,
                                    "start": start, "end": end})
    for (stage, step), end in tl.updates.items():
        lines[stage].append({"rank": stage, "replica": 0, "stage": stage, "kind": "U", "step": step, "unit": -1,
                             "start": end - costs.update, "end": end})
    (tmp_path / "trace").mkdir()
    for stage, records in lines.items():
        (tmp_path / "trace" / f"rank{stage}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = load_config("smoke", None, [f"pipeline.stages={P}", f"pipeline.microbatches={M}",
                                         f"pipeline.schedule={schedule}", f"train.steps={T}"])
    row = _analyse({"config": config, "dir": str(tmp_path)}, T)
    assert row["measured_costs"] == pytest.approx({"forward": 0.007, "backward": 0.013, "update": 0.047}, rel=1e-9)
    per_mb = 0.007 + 0.013
    assert row["step_s"] == pytest.approx((M + (P - 1) * (schedule != "2bw")) * per_mb + 0.047, rel=1e-9)
    assert row["prediction_error"] < 1e-9
    assert row["peak_activations"] == row["sim_peak_activations"] == [2, 1]
