"""The schedule table, the schedule IR and its timeline simulator: golden orders, closed-form bubbles, derived
delays."""

import ast
import gc
import itertools
import time
import tracemalloc
from pathlib import Path

import pytest

from bubblefree.schedules import SCHEDULES, n_partitions, stage_delays, weight_versions
from bubblefree.schedules.ir import SIMULATED_SCHEDULES, build_schedule, check_schedule, simulated_actions
from bubblefree.schedules.report import BYTES_PER_ACTION, simulate_schedules
from bubblefree.schedules.timeline import Costs, simulate
from timeline_reference import (
    recurrence,
    reference_open_steps,
    reference_peak_activations,
    reference_simulate,
    reference_weight_versions,
)


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


# The simulator's cost (issue 46): linear in its actions, equal to the reference, bounded in memory -------------

GRID = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 4), (3, 3), (3, 5), (4, 4), (4, 8), (5, 10)]
COSTS = [Costs(), Costs(1, 1, 0.5), Costs(0, 1, 1), Costs(1, 2, 1, comm=0.5, update=3),
         Costs(0.3, 0.7, 0.1, comm=0.1, update=0.2)]


@pytest.mark.parametrize("name", SIMULATED_SCHEDULES)
def test_the_simulator_equals_the_reference_event_for_event(name):
    """Every action at the same time on the same rank, in the same order, every update and version, and every
    analysis equal to its count from the definition, on a grid of sizes and costs (comm, update, a zero
    forward); the flushless ones also against the plain recursion of each rank's order."""
    compared = 0
    for (P, M), costs in itertools.product(GRID, COSTS):
        try:
            schedule = build_schedule(name, P, M, steps=3)
        except ValueError:  # interleaved needs M a multiple of P, 2BW at least P
            continue
        got, want = simulate(schedule, costs), reference_simulate(schedule, costs)
        case = (name, P, M, costs)
        assert list(got.spans.items()) == list(want.spans.items()), case
        assert list(got.rank_of.items()) == list(want.rank_of.items()), case
        assert list(got.updates.items()) == list(want.updates.items()), case
        assert list(got.versions_used.items()) == list(want.versions_used.items()), case
        assert got.peak_activations() == reference_peak_activations(want), case
        assert got.weight_versions() == reference_weight_versions(want), case
        assert got.open_steps() == reference_open_steps(want), case
        if not schedule.split_backward:
            assert recurrence(schedule, costs) == (got.spans, got.updates), case
        compared += 1
    assert compared >= 20


@pytest.mark.parametrize("name", SIMULATED_SCHEDULES)
def test_the_action_count_is_known_before_building(name):
    for P, M, steps in [(1, 1, 1), (2, 4, 3), (4, 8, 2), (3, 6, 5)]:
        expected = simulated_actions(name, P, M, steps=steps)
        assert len(simulate(build_schedule(name, P, M, steps=steps)).spans) == expected, (P, M, steps)


def test_the_simulators_cost_grows_linearly():
    """Four times the stages is four times the actions: the time grows about fourfold (the CPU time, so a busy
    machine does not decide it). Scanning every rank for every action, as the reference does, grew sixteenfold."""
    def seconds(P: int) -> float:
        schedule = build_schedule("2bw", P, 64, steps=2)
        start = time.process_time()
        tl = simulate(schedule)
        tl.weight_versions(), tl.peak_activations(), tl.open_steps(), tl.idle_fraction()
        return time.process_time() - start

    seconds(8)  # warm up
    small, large = min(seconds(8) for _ in range(3)), min(seconds(32) for _ in range(3))
    assert large / small < 8, (small, large)


@pytest.mark.parametrize("name", SIMULATED_SCHEDULES)
def test_the_memory_per_action_is_an_upper_bound(name):
    """What building, simulating and analysing one schedule holds at its peak, per action, stays under the
    estimate the refusal is made from, at sizes where the dictionaries' growth falls differently."""
    for P, M in [(4, 64), (8, 24), (16, 16)]:
        gc.collect()
        tracemalloc.start()
        try:
            tl = simulate(build_schedule(name, P, M, steps=4))
            tl.idle_fraction(), tl.staleness(), tl.weight_versions(), tl.peak_activations()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < BYTES_PER_ACTION * simulated_actions(name, P, M, steps=4), (P, M, peak)


def test_a_request_beyond_the_machines_memory_is_refused_with_the_estimate(tmp_path, monkeypatch, capsys):
    import bubblefree.schedules.report as report
    from bubblefree.cli import main

    monkeypatch.setattr(report, "machine_memory", lambda: 10**9)
    out = tmp_path / "sim"
    assert main(["simulate", "--stages", "256", "--microbatches", "2048", "--schedules", "1f1b,2bw",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ("simulate --stages 256 --microbatches 2048 --steps 8 would need about 10.0 GiB of memory (the 2 "
            "timelines drawn together: 16,777,216 actions at up to 640 bytes each), more than this machine's "
            "953.7 MiB") in err, err
    assert not out.exists()
    # Without --out one timeline is held at a time.
    assert main(["simulate", "--stages", "256", "--microbatches", "2048", "--schedules", "1f1b,2bw"]) == 2
    assert "(1f1b: 8,388,608 actions at up to 640 bytes each)" in capsys.readouterr().err


def test_a_long_simulation_says_how_far_it_is(monkeypatch, capsys):
    import bubblefree.schedules.report as report

    monkeypatch.setattr(report, "PROGRESS_AFTER_S", 0.0)
    simulate_schedules(["1f1b", "2bw"], stages=2, microbatches=4, steps=3)
    err = capsys.readouterr().err.splitlines()
    assert "bubblefree: building 1f1b (1 of 2): 0 of 96 actions simulated (0%), 0 s" in err, err
    assert "bubblefree: analysing 2bw (2 of 2): 96 of 96 actions simulated (100%), 0 s" in err, err
    monkeypatch.setattr(report, "PROGRESS_AFTER_S", 3600.0)  # the default: a short one says nothing
    simulate_schedules(["1f1b"], stages=2, microbatches=4, steps=3)
    assert capsys.readouterr().err == ""


def test_check_schedule_refuses_as_building_would():
    for args in [("nope", 2, 2), ("1f1b", 0, 2), ("2bw", 4, 2), ("interleaved-1f1b", 4, 6), ("gpipe", 2, 2, 0)]:
        name, P, M, *steps = args
        with pytest.raises(ValueError) as built:
            build_schedule(name, P, M, steps=steps[0] if steps else 1)
        with pytest.raises(ValueError) as checked:
            check_schedule(name, P, M, steps=steps[0] if steps else 1)
        assert str(built.value) == str(checked.value)


def test_a_long_timeline_is_drawn_from_its_start(tmp_path, monkeypatch):
    """Past MAX_DRAWN_BLOCKS only the window holding that many is drawn, and the title says up to when."""
    import bubblefree.schedules.render as render

    monkeypatch.setattr(render, "MAX_DRAWN_BLOCKS", 50)
    tl = simulate(build_schedule("2bw", 2, 4, steps=8))
    panels = []
    monkeypatch.setattr(render, "draw_panels", lambda p, path, **kw: panels.extend(p) or path)
    render.draw_timelines([tl], tmp_path / "t.png")
    (panel,) = panels
    cut = sorted(start for start, _ in tl.spans.values())[50]
    assert len(panel.spans) == 50 and all(s.start < cut for s in panel.spans)
    assert panel.title.endswith(f"(up to time {cut:.4g} of {tl.makespan:.4g})"), panel.title


# A schedule is one object (issue 45): its name is interpreted by the schedule table alone ------------------------

def _names_interpreted(path, names: set[str]) -> list[int]:
    """The lines of ``path`` that compare a string of ``names`` (``==``, ``!=``, ``is``, ``in (...)``, a ``case``).
    Read with ``ast``: a name in a docstring, a message or a dict of labels is not a comparison."""
    def named(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in names

    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(named(x) for x in (node.left, *node.comparators)):
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and named(node.value):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_schedule_name_is_compared_as_a_string_outside_the_table():
    """Every fact about a schedule is a field of its row in ``schedules.table``: code elsewhere asks the object
    (``get_schedule(name).runtime is Runtime.ASYNC``); it does not compare the name, or a weight-version rule's
    name, with ``==``, ``!=`` or ``in (...)``. A name given as data (a preset's ``{"pipeline.schedule":
    "pipedream"}``, a loop over names, a message) is fine."""
    from bubblefree.schedules.table import SCHEDULE_SPECS, Versions

    names = {*SCHEDULE_SPECS, *(v.value for v in Versions)}
    src = Path(__file__).resolve().parents[1] / "src" / "bubblefree"
    found = [f"{path.relative_to(src)}:{line}: {path.read_text().splitlines()[line - 1].strip()}"
             for path in sorted(src.rglob("*.py"))
             if path != src / "schedules" / "table.py"
             # experiments/ labels the suites' arms (variant == "sync", an arm named "pipedream"): runs, not schedules
             and "experiments" not in path.relative_to(src).parts
             for line in _names_interpreted(path, names)]
    assert not found, "ask the schedule table instead of comparing names:\n" + "\n".join(found)
