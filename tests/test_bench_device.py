"""``bubblefree bench device``: the accelerator check, end to end in its CPU mode (``--tiny``), and its
handling of a part that outlives its budget and of the global deadline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bubblefree.bench.device import PARTS, run
from bubblefree.bench.device_report import summary_markdown
from bubblefree.bench.parity import CHECKS
from bubblefree.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_device_check_script_tiny_end_to_end(tmp_path, data_cache):
    """The script a GPU machine runs, in its CPU mode: it runs ``bubblefree bench device`` from the source
    tree and leaves the three records and the environment (what a short session brings back)."""
    out = tmp_path / "device"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), str(out), "--tiny"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{len(PARTS)}/{len(PARTS)} parts passed" in proc.stdout and "# Device check: CPU (--tiny)" in proc.stdout
    record = json.loads((out / "device.json").read_text())
    parts = record["parts"]
    assert list(parts) == list(PARTS) and all(p["status"] == "ok" for p in parts.values())
    assert len(parts["checks"]["results"]) == len(CHECKS) and all(r["ok"] for r in parts["checks"]["results"])
    memory = {r["dtype"]: r for r in parts["memory"]["rows"]}
    assert memory["float32"]["planned"] == memory["float32"]["measured"]  # the CPU: exact (tests/test_plan.py)
    assert list(memory) == ["bf16 autocast", "float32"] and abs(memory["bf16 autocast"]["ratio"] - 1) <= 0.10
    assert [r["compile"] for r in parts["train"]["rows"]] == ["eager", "torch.compile (eager) per block"]
    for row in parts["train"]["rows"]:
        assert row["ours_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0
    assert {r["optimizer"] for r in parts["optim"]["devices"]["cpu"]} >= {"muon", "adamw"}
    runs = parts["quality"]["runs"]
    assert [(r["optimizer"], r["run"]) for r in runs] == [(o, n) for o in ("muon", "adamw")
                                                          for n in ("sync", "2bw", "2bw+ef")]
    assert all(r["steps"] == parts["quality"]["steps"] >= 2 and 0 < r["final_val_loss"] < 10 for r in runs)
    assert set(parts["quality"]["gaps"]) == {"muon", "adamw"}
    summary = (out / "device.md").read_text()
    for heading in ("## Parity", "## Activation memory", "## Training throughput", "## Optimizer step time",
                    "## Quality"):
        assert heading in summary
    # Every part's record is merged into device.json: four files.
    assert sorted(p.name for p in out.iterdir()) == ["device.json", "device.log", "device.md", "environment.txt"]
    assert "torch" in (out / "environment.txt").read_text()


def test_a_part_past_its_budget_is_recorded_and_the_deadline_skips_the_rest(tmp_path, capsys):
    result = run(tmp_path, tiny=True, parts=("checks", "quality"), budgets_s={"checks": 1.0}, deadline_s=10.0)
    checks, quality = result["parts"]["checks"], result["parts"]["quality"]
    assert checks["status"] == "timeout" and checks["wall_s"] < 12  # killed at its budget, not at the end
    assert quality["status"] == "skipped" and "before the deadline" in quality["note"]
    saved = json.loads((tmp_path / "device.json").read_text())
    assert saved["parts"]["checks"]["status"] == "timeout"
    summary = (tmp_path / "device.md").read_text()
    assert "| checks | timeout |" in summary and "| quality | skipped |" in summary
    assert "0/2 parts passed" in capsys.readouterr().out


def test_summary_shows_a_failed_part_with_its_error():
    record = {"command": "c", "started": "now", "deadline_s": 1.0, "wall_s": 1.0,
              "environment": {"torch": "t", "torch_cuda": None, "transformers": None, "commit": "x", "cpus": 1},
              "parts": {"train": {"status": "failed", "wall_s": 1, "budget_s": 2, "error": "ImportError: no hf",
                                  "log_tail": "Traceback ..."}}}
    text = summary_markdown(record)
    assert "| train | failed |" in text and "ImportError: no hf" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_device_check_needs_cuda_or_tiny(tmp_path, capsys):
    assert main(["bench", "device", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--tiny" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


def test_tiny_is_only_for_the_device_check(capsys):
    assert main(["bench", "optim", "--tiny"]) == 2
    assert "only 'bench device'" in capsys.readouterr().err
