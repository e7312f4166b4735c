"""The schedule table, the schedule IR and its timeline simulator: golden orders, closed-form bubbles, derived
delays."""

import pytest

from bubblefree.schedules import SCHEDULES, n_partitions, stage_delays, weight_versions
from bubblefree.schedules.ir import build_schedule
from bubblefree.schedules.report import simulate_schedules
from bubblefree.schedules.timeline import Costs, simulate


def test_schedule_table():
    """Each schedule's delays and weight versions per stage, the table every consumer reads."""
    assert SCHEDULES == ("sync", "gpipe", "1f1b", "2bw", "pipedream", "wpipe")
    for name in ("sync", "gpipe", "1f1b"):
        assert stage_delays(name, 4) == [0] * 4 and weight_versions(name, 4) == [1] * 4
    assert stage_delays("2bw", 4) == [1] * 4 and weight_versions("2bw", 4) == [2] * 4
    assert stage_delays("pipedream", 4) == [3, 2, 1, 0] and weight_versions("pipedream", 4) == [4, 3, 2, 1]
    assert n_partitions("wpipe", 3) == 6 and stage_delays("wpipe", 3) == [1, 1, 1, 0, 0, 0]
    assert weight_versions("wpipe", 3) == [2, 2, 2, 1, 1, 1] and n_partitions("2bw", 3) == 3
    assert stage_delays("pipedream", 1) == [0]
    for bad in (("zb", 2), ("2bw", 0), ("2bw", -1), ("2bw", 1.5)):
        with pytest.raises(ValueError, match="Invalid (schedule|n_stages)"):
            stage_delays(*bad)


def test_golden_orders():
    assert build_schedule("1f1b", 3, 4).format() == (
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )
    assert build_schedule("gpipe", 2, 2).format() == "0F0 0F1 0B0 0B1\n1F0 1F1 1B0 1B1"
    # Megatron's interleaved order: rank 0 holds virtual stages 0 and 2, microbatches in groups of P = 2.
    assert build_schedule("interleaved-1f1b", 2, 4).format().splitlines()[0] == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    )
    # 2BW never flushes: step 1's forwards (microbatches 2, 3) interleave with step 0's backwards.
    assert build_schedule("2bw", 2, 2, steps=2).format().splitlines()[0] == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    # WPipe: rank 0 holds partitions 0 (first half) and 2 (second half); step 1's first-half forwards (2, 3)
    # run before step 0's first-half backwards, the second half finishes step 0 before its step-1 forwards.
    assert build_schedule("wpipe", 2, 2, steps=2).format() == (
        "0F0 0F1 2F0 2F1 2B0 2B1 0F2 0F3 0B0 0B1 2F2 2F3 2B2 2B3 0B2 0B3\n"
        "1F0 1F1 3F0 3F1 3B0 3B1 1F2 1F3 1B0 1B1 3F2 3F3 3B2 3B3 1B2 1B3"
    )


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8)])
@pytest.mark.parametrize("costs", [Costs(1, 1), Costs(1, 2), Costs(0.5, 1.5)])
def test_flush_bubble_matches_closed_form(name, P, M, costs):
    tl = simulate(build_schedule(name, P, M, steps=3), costs)
    assert tl.idle_fraction() == pytest.approx((P - 1) / (M + P - 1), abs=1e-12)


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("costs", [Costs(1, 2, 0, update=0.5), Costs(0.5, 1.5, 0, update=3)])
def test_update_cost_adds_to_every_step(P, M, costs):
    """A stage's update keeps its rank busy after the step's last backward there: a flushing step takes
    (M+P-1)(F+B) + U and a 2BW step M(F+B) + U, so no schedule hides the optimizer."""
    per_mb, T = costs.forward + costs.backward, 6
    for name, step in (("1f1b", (M + P - 1) * per_mb + costs.update), ("gpipe", (M + P - 1) * per_mb + costs.update),
                       ("2bw", M * per_mb + costs.update)):
        tl = simulate(build_schedule(name, P, M, steps=T), costs)
        for s in range(P):
            assert [tl.updates[(s, t + 1)] - tl.updates[(s, t)] for t in range(1, T - 1)] == \
                pytest.approx([step] * (T - 2), abs=1e-9), (name, s)
        assert max(tl.busy()) == pytest.approx(T * (M * per_mb + costs.update), abs=1e-9)


@pytest.mark.parametrize("P,M,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_interleaved_bubble_matches_closed_form(P, M, v):
    tl = simulate(build_schedule("interleaved-1f1b", P, M, chunks=v), Costs(1, 2))
    assert tl.idle_fraction() == pytest.approx((P - 1) / (v * M + P - 1), abs=1e-12)


@pytest.mark.parametrize("P,M,T", [(2, 2, 5), (4, 4, 3), (4, 8, 4), (8, 8, 2)])
def test_async_schedules_fill_and_drain_once(P, M, T):
    for name in ("2bw", "pipedream"):
        tl = simulate(build_schedule(name, P, M, steps=T), Costs(1, 2))
        assert tl.idle_fraction() == pytest.approx((P - 1) / (T * M + P - 1), abs=1e-12)


def test_zero_bubble_beats_1f1b_at_the_same_memory():
    P, M = 4, 8
    zb = simulate(build_schedule("zero-bubble", P, M, steps=2), Costs(1, 2, 1))
    base = simulate(build_schedule("1f1b", P, M, steps=2), Costs(1, 2, 1))
    assert zb.idle_fraction() < base.idle_fraction()
    assert zb.peak_activations() == base.peak_activations() == [P - s for s in range(P)]


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_derived_delays_versions_and_activations(P):
    M, T = 2 * P, 6
    two_bw = simulate(build_schedule("2bw", P, M, steps=T))
    assert two_bw.staleness() == [1] * P
    assert two_bw.weight_versions() == [2] * P
    assert two_bw.peak_activations() == [P - s for s in range(P)]
    pipedream = simulate(build_schedule("pipedream", P, M, steps=T))
    assert pipedream.staleness() == [P - 1 - s for s in range(P)]
    assert pipedream.weight_versions() == [P - s for s in range(P)]
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"):
        assert set(simulate(build_schedule(name, P, M, steps=T)).staleness()) == {0}


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "2bw", "pipedream", "wpipe"])
def test_timeline_agrees_with_the_training_delay_table(name, P):
    """The delays the training runs are the delays the schedule's timeline produces: one definition, checked.
    (WPipe: one entry per partition, 2P of them, the first half one step stale with two versions.)"""
    tl = simulate(build_schedule(name, P, 2 * P, steps=P + 2))
    assert tl.staleness() == stage_delays(name, P)
    assert tl.weight_versions() == weight_versions(name, P)


@pytest.mark.parametrize("P,M", [(1, 1), (2, 1), (2, 3), (3, 3), (4, 4)])
@pytest.mark.parametrize("costs", [Costs(1, 2), Costs(1, 1, comm=0.5), Costs(1, 2, update=3)])
def test_wpipe_delays_hold_for_any_microbatches_and_costs(P, M, costs):
    """Every microbatch of a step at a partition sees one version (the simulator asserts it), and which one
    does not depend on timing: the first half is always one step stale, the second never."""
    tl = simulate(build_schedule("wpipe", P, M, steps=4), costs)
    assert tl.staleness() == [1] * P + [0] * P and tl.weight_versions() == [2] * P + [1] * P
    assert {tl.versions_used[(s, j)] for s in range(P) for j in range(M, 2 * M)} == {0}  # step 1 sees x_0


def test_bad_input():
    with pytest.raises(ValueError, match="schedule"):
        build_schedule("nope", 2, 2)
    with pytest.raises(ValueError, match="stages"):
        build_schedule("1f1b", 0, 2)
    with pytest.raises(ValueError, match="at least one per stage"):
        build_schedule("2bw", 4, 2)
    with pytest.raises(ValueError, match="multiple"):
        build_schedule("interleaved-1f1b", 4, 6)
    for text in ("1:2", "a:b:c", "-1:1:1", "0:0:0", "1:1:1:-1", "1:1:1:1:1"):
        with pytest.raises(ValueError, match="costs"):
            Costs.parse(text)
    assert Costs.parse("1:1:1") == Costs(1, 2, 1)
    assert Costs.parse("1:1:1:0.5") == Costs(1, 2, 1, update=0.5)


def test_report_writes_table_and_png(tmp_path, capsys):
    rows = simulate_schedules(["1f1b", "2bw"], stages=2, microbatches=4, steps=3, out=tmp_path)
    assert [r["schedule"] for r in rows] == ["1f1b", "2bw"]
    assert rows[1]["idle_fraction"] < rows[0]["idle_fraction"]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert "2bw" in capsys.readouterr().out


def test_cli_simulate(tmp_path, capsys):
    from bubblefree.cli import main

    assert main(["simulate", "--stages", "2", "--microbatches", "4", "--schedules", "1f1b,2bw",
                 "--out", str(tmp_path)]) == 0
    assert (tmp_path / "simulate.json").exists() and (tmp_path / "timeline.png").exists()
    capsys.readouterr()
    assert main(["simulate", "--stages", "2", "--microbatches", "2", "--schedules", "wpipe,2bw"]) == 0
    out = capsys.readouterr().out
    assert "1,1,0,0" in next(line for line in out.splitlines() if line.startswith("wpipe"))  # delay per partition
    assert main(["simulate", "--stages", "4", "--microbatches", "2", "--schedules", "2bw"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at least one per stage" in err
