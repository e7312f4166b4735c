"""A results folder across the sessions a study spans: the tables rebuilt from its runs' JSON (also while the
suite is under way), parallel runs that stop cleanly, one record per suite that several commands fill,
``--dry-run``'s count of what is left, and no path of the machine that made a committed file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bubblefree.cli import main
from bubblefree.experiments import SUITES, get_scale, reproduce, run_id, runner as runner_module
from bubblefree.experiments.sweeps import sweep_runs
from bubblefree.optim import OPTIMIZERS
from helpers import finished_run


def test_docs_tables_are_rebuilt_from_the_results_json(tmp_path, monkeypatch):
    """``python -m bubblefree.docs`` splices into docs/ exactly the tables ``reproduce`` wrote, from the JSON
    alone (stand-in runs: a loss that depends on the optimizer, rate, schedule, correction and seed)."""
    from bubblefree.docs import generate
    from bubblefree.experiments.reproduce import tables

    def fake(run, work, **kw):
        c = run.config
        loss = (4.0 + abs(math.log2(c.optim.lr / OPTIMIZERS[c.optim.name].lr) - 0.7)
                + 0.3 * (c.pipeline.schedule != "sync") - 0.2 * (c.delay.correction == "ef") + 0.01 * c.train.seed)
        return finished_run(run, loss)

    monkeypatch.setattr(runner_module, "_execute", fake)
    out = tmp_path / "results" / "smoke"
    reproduce("error-feedback", scale="smoke", out=out, optimizers=("adamw", "muon"), progress=False, jobs=1)
    written = (out / "error-feedback.md").read_text()
    assert tables(out, "error-feedback") in written and "| adamw |" in tables(out, "error-feedback")

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "training.md").write_text("<!-- config-reference:begin -->\n<!-- config-reference:end -->\n")
    (docs / "optimizers.md").write_text("<!-- optimizer-defaults:begin -->\n<!-- optimizer-defaults:end -->\n")
    (docs / "reliability.md").write_text("<!-- config-ranges:begin -->\n<!-- config-ranges:end -->\n"
                                         "<!-- option-ranges:begin -->\n<!-- option-ranges:end -->\n")
    _depth_part(docs, tmp_path / "results")
    part = "results:smoke/error-feedback"
    findings = "<!-- findings:begin -->\n<!-- findings:end -->\n"
    (docs / "results.md").write_text(f"{findings}Before.\n\n<!-- {part}:begin -->\nstale\n<!-- {part}:end -->\n\n"
                                     f"After.\n")
    new = generate(docs, tmp_path / "results")[docs / "results.md"]
    assert new.endswith(f"Before.\n\n<!-- {part}:begin -->\n{tables(out, 'error-feedback', heading='####')}"
                        f"<!-- {part}:end -->\n\nAfter.\n")

    from bubblefree.docs import stale_results

    assert stale_results(tmp_path / "results") == []  # the suite's own table matches its JSON
    (out / "error-feedback.md").write_text(written.replace("| adamw |", "| adamw (edited) |"))
    assert stale_results(tmp_path / "results") == [
        "out of date: results/smoke/error-feedback.md (bubblefree reproduce error-feedback --report --out "
        "results/smoke)"]

    (out / "runs" / f"{min(p.stem for p in (out / 'runs').glob('*.json'))}.json").unlink()
    with pytest.raises(ValueError, match="lacks 1 run"):
        tables(out, "error-feedback")


def test_an_interrupted_suite_is_tabulated_from_the_runs_it_finished(tmp_path, monkeypatch):
    """The suite's record is written once the rates are chosen, so a suite stopped half-way (a study spanning
    sessions) still has its tables: ``-`` for the runs to come and a count of them."""
    from bubblefree.docs import generate
    from bubblefree.experiments.reproduce import tables

    done = []

    def fake(run, work, **kw):  # the async runs of the long horizon never finish
        c = run.config
        if c.train.steps > 20 and c.pipeline.schedule != "sync":
            raise KeyboardInterrupt
        done.append(run_id(run))
        loss = 3.0 + abs(math.log2(c.optim.lr / OPTIMIZERS[c.optim.name].lr)) + 0.5 * (c.pipeline.schedule != "sync")
        return finished_run(run, loss, final=loss + 0.01 * c.train.seed, params=10, params_non_embedding=5,
                       tokens_per_param=c.train.steps / 10)

    monkeypatch.setattr(runner_module, "_execute", fake)
    out = tmp_path / "results" / "smoke"
    with pytest.raises(KeyboardInterrupt):
        reproduce("horizon", scale="smoke", out=out, optimizers=("muon",), progress=False, jobs=1)
    assert json.loads((out / "horizon.json").read_text())["finished"] is False
    with pytest.raises(ValueError, match="lacks"):
        tables(out, "horizon")
    text = tables(out, "horizon", partial=True)
    rows = [line for line in text.partition("Results")[2].splitlines() if line.startswith("| muon |")]
    assert [row.split(" | ")[1] for row in rows] == ["20", "40"]
    assert rows[0].split(" | ")[5] != "-" and rows[1].split(" | ")[4] == "-"  # 40 steps: sync only, no async
    lrs = json.loads((out / "horizon.json").read_text())["lrs"]
    planned = {run_id(r) for r in SUITES["horizon"].runs(get_scale("smoke"), lrs) + sweep_runs(get_scale("smoke"),
                                                                                              ("muon",))}
    missing = planned - set(done)
    assert missing and f"In progress: {len(planned) - len(missing)} of {len(planned)} runs finished" in text

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "training.md").write_text("<!-- config-reference:begin -->\n<!-- config-reference:end -->\n")
    (docs / "optimizers.md").write_text("<!-- optimizer-defaults:begin -->\n<!-- optimizer-defaults:end -->\n")
    (docs / "reliability.md").write_text("<!-- config-ranges:begin -->\n<!-- config-ranges:end -->\n"
                                         "<!-- option-ranges:begin -->\n<!-- option-ranges:end -->\n")
    _depth_part(docs, tmp_path / "results")
    (docs / "results.md").write_text("<!-- findings:begin -->\n<!-- findings:end -->\n"
                                     "<!-- results:smoke/horizon:begin -->\n<!-- results:smoke/horizon:end -->\n")
    assert tables(out, "horizon", heading="####", partial=True) in generate(docs, tmp_path / "results")[
        docs / "results.md"]

    # --report: the table and the plot from the finished runs, nothing run
    before = sorted((out / "runs").iterdir())
    assert main(["reproduce", "horizon", "--report", "--scale", "smoke", "--out", str(out)]) == 0
    assert sorted((out / "runs").iterdir()) == before
    md = (out / "horizon.md").read_text()
    assert tables(out, "horizon", partial=True) in md and "nothing ran" in md
    assert (out / "horizon-gap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["reproduce", "horizon", "--report", "--seeds", "3", "--out", str(out)]) == 2
    assert main(["reproduce", "moe", "--report", "--out", str(out)]) == 2  # no record: never started


@pytest.mark.slow
def test_parallel_runs_hand_the_pool_no_more_than_jobs_at_a_time(tmp_path, monkeypatch):
    """Work handed to a process pool moves into its workers' queue where cancelling cannot reach it, so a
    Ctrl-C used to let queued runs start after the ones in flight had stopped. ``run_all`` keeps at most
    ``jobs`` runs submitted; a failed run stops the rest (a stand-in pool of threads counts what it holds)."""
    import concurrent.futures
    import threading

    held, most, lock = [0], [0], threading.Lock()

    class CountingPool(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, max_workers, mp_context=None):
            super().__init__(max_workers=max_workers)

        def submit(self, fn, *args, **kwargs):
            with lock:
                held[0] += 1
                most[0] = max(most[0], held[0])

            def counted():
                try:
                    return fn(*args, **kwargs)
                finally:
                    with lock:
                        held[0] -= 1
            return super().submit(counted)

    started, both = [], threading.Barrier(2)

    def fake(run, work, **kw):
        with lock:
            started.append(run_id(run))
            n = len(started)
        if n <= 2:  # the first two wait for each other: both are in flight at once, whatever the machine's load
            both.wait(timeout=30)
        if n == 4:
            raise RuntimeError("run 4 failed")
        return finished_run(run, 1.0)

    monkeypatch.setattr(runner_module, "ProcessPoolExecutor", CountingPool)
    monkeypatch.setattr(runner_module, "_execute", fake)
    runs = sweep_runs(get_scale("smoke"), ("adamw", "muon", "soap", "adan"))
    assert len(runs) >= 8
    with pytest.raises(RuntimeError, match="run 4 failed"):
        runner_module.run_all(runs, tmp_path, jobs=2)
    assert most[0] == 2  # two in flight, never more
    assert len(started) <= 5  # at most the one run in flight beside the failed one; nothing new after it
    saved = {p.stem for p in (tmp_path / "runs").glob("*.json")}
    assert saved and saved <= set(started[:3] + started[4:])  # finished runs are saved, the failed one is not


def test_a_suite_run_one_optimizer_at_a_time_records_them_all(tmp_path, monkeypatch):
    """``--optimizers muon`` then ``--optimizers adamw`` into one folder: the record keeps both (the suite's
    order), so the tables rebuilt from it show both. Another study of the suite (other seeds or base run) that
    would replace the record is refused before it runs anything, unless it only adds seeds for every
    optimizer the record holds."""
    from bubblefree.experiments.reproduce import tables

    def fake(run, work, **kw):
        c = run.config
        loss = 3.0 + abs(math.log2(c.optim.lr / OPTIMIZERS[c.optim.name].lr)) + 0.1 * (c.pipeline.schedule != "sync")
        return finished_run(run, loss, final=loss + 0.01 * c.train.seed)

    monkeypatch.setattr(runner_module, "_execute", fake)
    for opt in ("muon", "adamw"):
        reproduce("momentum", scale="smoke", out=tmp_path, optimizers=(opt,), progress=False, jobs=1)
    record = json.loads((tmp_path / "momentum.json").read_text())
    assert record["optimizers"] == ["adamw", "muon"] and set(record["lrs"]) == {"adamw", "muon"}
    results = tables(tmp_path, "momentum").partition("Results")[2]
    assert "| adamw | 0.8 |" in results and "| muon | 0.8 |" in results
    before = (tmp_path / "momentum.json").read_bytes(), sorted((tmp_path / "runs").iterdir())
    for other in (["--seeds", "3"], ["--set", "train.steps=12"]):
        assert main(["reproduce", "momentum", "--scale", "smoke", "--out", str(tmp_path), "--optimizers", "muon",
                     *other]) == 2
        assert ((tmp_path / "momentum.json").read_bytes(), sorted((tmp_path / "runs").iterdir())) == before
    # more seeds of the same study for every optimizer it records: the new record tabulates all the old one did
    seeds = json.loads(before[0])["seeds"]
    reproduce("momentum", scale="smoke", out=tmp_path, seeds=seeds + 1, progress=False, jobs=1)
    record = json.loads((tmp_path / "momentum.json").read_text())
    assert (record["seeds"], record["optimizers"]) == (seeds + 1, ["adamw", "muon"])
    # every optimizer at fewer seeds, or at another base run, would replace the record: refused as well
    before = (tmp_path / "momentum.json").read_bytes(), sorted((tmp_path / "runs").iterdir())
    for other in (["--seeds", str(seeds)], ["--seeds", str(seeds + 1), "--set", "train.steps=12"]):
        assert main(["reproduce", "momentum", "--scale", "smoke", "--out", str(tmp_path), *other]) == 2
        assert ((tmp_path / "momentum.json").read_bytes(), sorted((tmp_path / "runs").iterdir())) == before


def test_no_committed_result_or_doc_names_a_path_of_the_machine_that_made_it():
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        files = subprocess.run(["git", "ls-files", "docs", "results", "README.md"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    absolute = re.compile(r"(?<![\w.])/(?:work|root|home|tmp|Users)/")
    found = [f for f in files if f.endswith((".md", ".json", ".toml", ".txt"))
             and absolute.search((root / f).read_text(encoding="utf-8", errors="replace"))]
    assert not found, f"absolute paths in {found}: write them relative to the repository"


def test_dry_run_counts_the_runs_reproduce_then_runs_and_times_them_by_their_shape(tmp_path, monkeypatch, capsys):
    """``--dry-run`` runs nothing; where every sweep lands inside its grid its count is exact: on a fresh folder and
    on one a stopped suite left, the runs it lists are the ones ``reproduce`` goes on to execute, in order, and
    each is timed by the finished runs of its shape (here a run's time is its step count in seconds)."""
    from bubblefree.experiments.reproduce import dry_run

    executed, stop_after = [], [5]

    def fake(run, work, **kw):  # every sweep's best is the registry's rate, the centre of its grid
        if len(executed) == stop_after[0]:
            raise KeyboardInterrupt
        executed.append(run_id(run))
        c = run.config
        loss = 3.0 + abs(math.log2(c.optim.lr / OPTIMIZERS[c.optim.name].lr)) + 0.01 * c.train.seed
        return {**finished_run(run, loss), "wall_time_s": float(c.train.steps)}

    monkeypatch.setattr(runner_module, "_execute", fake)
    kw = dict(scale="smoke", out=tmp_path, optimizers=("muon",))
    fresh = dry_run("steps", **kw)
    assert fresh["finished"] == 0 and fresh["untimed"] == len(fresh["to_run"]) > 5 and fresh["minutes"] == 0
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing ran
    with pytest.raises(KeyboardInterrupt):
        reproduce("steps", progress=False, jobs=1, **kw)
    assert executed == fresh["to_run"][:5]

    stopped = dry_run("steps", **kw)
    assert stopped["finished"] == 5 and stopped["to_run"] == fresh["to_run"][5:]
    stop_after[0] = 10**6
    reproduce("steps", progress=False, jobs=1, **kw)
    assert executed[5:] == stopped["to_run"]

    def shape(rid):
        c = json.loads((tmp_path / "runs" / f"{rid}.json").read_text())["config"]
        return c["model"]["preset"], c["train"]["steps"], c["train"]["batch_size"], c["pipeline"]["schedule"]

    timed = {shape(rid) for rid in executed[:5]}
    expected = [shape(rid)[1] / 60 for rid in stopped["to_run"] if shape(rid) in timed]
    assert expected and stopped["minutes"] == pytest.approx(sum(expected))
    assert stopped["untimed"] == len(stopped["to_run"]) - len(expected) > 0
    assert dry_run("steps", **kw)["to_run"] == []

    before = sorted((tmp_path / "runs").iterdir())
    assert main(["reproduce", "steps", "--scale", "smoke", "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out  # AdamW's runs are still to come, each of a shape Muon's runs have timed
    assert f"{len(executed)} run(s) finished, at least {len(fresh['to_run'])} to run" in out, out
    assert f"about {sum(int(shape(rid)[1]) for rid in executed) / 60:.0f} core-minutes" in out, out
    assert sorted((tmp_path / "runs").iterdir()) == before
    assert main(["reproduce", "steps", "--dry-run", "--report", "--out", str(tmp_path)]) == 2


def test_a_figure_with_its_interval_written_by_hand_must_be_in_a_table(tmp_path):
    """``docs --check``'s prose check: an interval quoted in a doc's prose is found in a results table (line
    breaks aside), and one the tables do not hold (a typo, a table re-run since) is named; code blocks and
    generated parts are not prose. (README.md and docs/results.md quote only cells: tests/test_findings.py.)"""
    from bubblefree.docs import unbacked_intervals

    (tmp_path / "results" / "long").mkdir(parents=True)
    (tmp_path / "results" / "long" / "steps.md").write_text(
        "| muon | 0.063 [0.050, 0.075] | 53 % [48 %, 57 %] |\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "delay.md").write_text("the delay costs 0.063 [0.050,\n0.075] and EF recovers 53 % "
                                                "[48 %,\n  57 %] of it.\n")
    assert unbacked_intervals(tmp_path) == []
    (tmp_path / "docs" / "schedules.md").write_text(
        "A gap of 0.063 [0.050, 0.076] here.\n```\nx = 1 [2, 3]\n```\n"
        "<!-- results:long/steps:begin -->\n0.5 [0.1, 0.9]\n<!-- results:long/steps:end -->\n")
    assert unbacked_intervals(tmp_path) == [
        "not in any table under results/: 0.063 [0.050, 0.076] (docs/schedules.md)"]


def _depth_part(docs: Path, results: Path) -> None:
    """The depth table's page and its record (``docs.PARTS``), as the repository holds them."""
    (docs / "throughput.md").write_text("<!-- depth-table:begin -->\n<!-- depth-table:end -->\n")
    (results / "bench" / "depth").mkdir(parents=True)
    record = Path(__file__).resolve().parents[1] / "results" / "bench" / "depth" / "depth.json"
    (results / "bench" / "depth" / "depth.json").write_bytes(record.read_bytes())
