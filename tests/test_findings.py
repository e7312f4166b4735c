"""The findings table (``experiments.findings``) against an independent reading of the committed runs' JSON, and
the docs check on quoted cells: an edited figure and a figure typed by hand are both caught."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from bubblefree.docs import generate, unbacked_intervals
from bubblefree.experiments.findings import FINDINGS, cell, cells

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def _test_losses(schedule: str, correction: str, lr: float) -> dict[int, float]:
    """Muon's 1200-step runs of the steps suite read straight from the JSON files: ``{seed: final test loss}``."""
    out = {}
    for path in (RESULTS / "long" / "runs").glob("muon-*.json"):
        r = json.loads(path.read_text())
        c = r["config"]
        if (c["train"]["steps"], c["train"].get("test_split"), c["pipeline"]["schedule"], c["delay"]["correction"],
                c["optim"]["lr"]) == (1200, True, schedule, correction, lr) and c["train"]["seed"] >= 1:
            out[c["train"]["seed"]] = r["final_test_loss"]
    return out


def test_a_cell_is_the_paired_interval_of_the_runs_it_names():
    # The steps suite chose 0.02 for sync and 0.01 for 2BW at 1200 steps (results/long/steps.md's sweep).
    sync, delayed = _test_losses("sync", "none", 0.02), _test_losses("2bw", "none", 0.01)
    assert sorted(sync) == sorted(delayed) == [1, 2, 3]
    diffs = [delayed[s] - sync[s] for s in (1, 2, 3)]
    m = statistics.fmean(diffs)
    half = 4.302653 * statistics.stdev(diffs) / math.sqrt(3)  # t(0.975, 2), from a table
    assert cell(RESULTS, "muon-gap/1200") == f"{m:.3f} [{m - half:.3f}, {m + half:.3f}] (3)"


def test_every_row_has_every_column_and_a_unique_name():
    got = cells(RESULTS)
    assert len({f.key for f in FINDINGS}) == len(FINDINGS)
    assert set(got) == {f"{f.key}/{c}" for f in FINDINGS for c in ("paper", "1200", "4800", "verdict", "bound")}
    assert got["muon-gap/paper"] == "0.012" and got["muon-ef-share/paper"] == "58 %"  # docs/spec.md section 8
    with pytest.raises(ValueError, match="Invalid cell"):
        cell(RESULTS, "muon-gap/2400")


def test_docs_check_catches_an_edited_cell_and_a_figure_typed_by_hand(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "results").mkdir()
    (docs / "training.md").write_text("<!-- config-reference:begin -->\n<!-- config-reference:end -->\n")
    (docs / "optimizers.md").write_text("<!-- optimizer-defaults:begin -->\n<!-- optimizer-defaults:end -->\n")
    (docs / "reliability.md").write_text("<!-- config-ranges:begin -->\n<!-- config-ranges:end -->\n"
                                         "<!-- option-ranges:begin -->\n<!-- option-ranges:end -->\n")
    (docs / "throughput.md").write_text("<!-- depth-table:begin -->\n<!-- depth-table:end -->\n")
    (docs / "results.md").write_text("<!-- findings:begin -->\n<!-- findings:end -->\n\nMuon pays "
                                     "<!-- cell:muon-gap/1200 -->?<!-- /cell --> at 1200 steps.\n")
    (tmp_path / "README.md").write_text("Muon: <!-- cell:muon-gap/1200 --><!-- /cell -->.\n")
    for path, text in generate(docs, RESULTS).items():
        path.write_text(text)
    figure = cell(RESULTS, "muon-gap/1200")
    assert f"<!-- cell:muon-gap/1200 -->{figure}<!-- /cell -->" in (tmp_path / "README.md").read_text()
    assert all(path.read_text() == text for path, text in generate(docs, RESULTS).items())  # up to date
    assert unbacked_intervals(tmp_path) == []

    readme = (tmp_path / "README.md").read_text()
    edited = figure.replace(figure[:5], f"{float(figure[:5]) + 0.001:.3f}", 1)
    (tmp_path / "README.md").write_text(readme.replace(figure, edited))
    stale = [p for p, text in generate(docs, RESULTS).items() if p.read_text() != text]
    assert stale == [tmp_path / "README.md"]  # the edited figure is out of date

    (docs / "results.md").write_text((docs / "results.md").read_text() + "\nBy hand: 0.063 [0.050, 0.075].\n")
    assert unbacked_intervals(tmp_path) == [
        "typed by hand: 0.063 [0.050, 0.075] (docs/results.md; quote the findings table's cell: "
        "<!-- cell:ROW/COLUMN -->...<!-- /cell -->)"]
    (docs / "results.md").write_text((docs / "results.md").read_text() + "<!-- cell:muon-gap/9 --><!-- /cell -->")
    with pytest.raises(ValueError, match="no cell 'muon-gap/9'"):
        generate(docs, RESULTS)
