"""Reliability (docs/reliability.md): exact resume after a real SIGKILL, checkpoint manifests that refuse a
damaged file, non-finite steps that stop or skip, and distributed startup faults that end every rank.

The kill tests run ``python -m bubblefree train`` in a subprocess, SIGKILL it at a random logged step (the seed
is printed; the kill may land in a step, a metrics line or a checkpoint write), resume it with ``--resume``
and compare every line of its metrics.jsonl with an uninterrupted run made in this process: equal as floats
(bit for bit) for the simulation, relative 1e-5 (tests/test_distributed.py's tolerance) for two ranks.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from bubblefree.cli import main
from bubblefree.train.checkpoint import list_checkpoints, load_checkpoint, manifest_path
from bubblefree.train.loop import TrainingDiverged, train
from bubblefree.train.metrics import read_metrics
from bubblefree.train.presets import load_config
from bubblefree.train.sim import SimExecutor
from helpers import group_alive, killed_at_exit, wait_for

RTOL = 1e-5
TINY = ["train.seq_len=32", "train.batch_size=4", "train.eval_batches=2", "train.eval_every=10",
        "train.log_every=1", "train.ckpt_every=3", "train.ckpt_keep=2", "log.progress=false"]


@pytest.fixture(autouse=True)
def _session_cache(data_cache):
    """Every test here (and its subprocesses) uses the session's data cache (conftest.py)."""


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return max((r["step"] for r in read_metrics(path)), default=0) if path.exists() else 0


def _kill_at_random_step(out: Path, overrides: list[str], *, steps: int, kill_in: tuple[int, int],
                         whole_group: bool) -> int:
    """Start the run in a new session, SIGKILL it once a random step in ``kill_in`` is logged; return the
    step logged at the kill. ``whole_group`` kills every process (a lost node); else only the launcher."""
    seed = zlib.crc32(" ".join(overrides).encode())  # fixed per case (and printed): every run aims at one step
    target = random.Random(seed).randint(*kill_in)
    print(f"kill seed {seed}: SIGKILL after step {target} of {steps}")
    proc = subprocess.Popen([sys.executable, "-m", "bubblefree", "train", "--preset", "smoke",
                             *_sets([*overrides, f"train.steps={steps}"]), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    with proc.stderr, killed_at_exit(proc):
        wait_for(lambda: _steps_logged(out) >= target or proc.poll() is not None, timeout_s=120, poll_s=0.002)
        (os.killpg if whole_group else os.kill)(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL, proc.stderr.read().decode()
        killed_at = _steps_logged(out)
        if not whole_group:  # the ranks notice that their launcher is gone and exit by themselves
            assert wait_for(lambda: not group_alive(proc.pid), timeout_s=30, poll_s=0.1), \
                "ranks outlived their killed launcher"
    assert target <= killed_at < steps, (target, killed_at)  # killed mid-run, at or after the chosen step
    return killed_at


def _resume(out: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "bubblefree", "train", "--resume", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["pipeline.schedule=sync", "delay.correction=none"],
    ["pipeline.schedule=2bw", "delay.correction=ef"],
    ["pipeline.schedule=pipedream", "pipeline.stages=3", "delay.correction=ef"],
], ids=["sync", "2bw-ef", "pipedream"])
def test_sigkill_then_resume_is_bit_exact(tmp_path, overrides):
    steps, overrides = 60, [*TINY, *overrides]
    killed = tmp_path / "killed"
    at = _kill_at_random_step(killed, overrides, steps=steps, kill_in=(4, 14), whole_group=True)
    start = list_checkpoints(killed)[-1][0]
    assert "resuming" in _resume(killed) and start <= at
    train(load_config("smoke", None, [*overrides, f"train.steps={steps}"]), out_dir=tmp_path / "full")
    want, got = read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert _without_timing(got) == _without_timing(want)  # every loss, norm, lr, validation loss: equal floats


@pytest.mark.slow
def test_distributed_sigkill_of_the_launcher_then_resume_matches(tmp_path):
    """Killing only the launcher: its ranks exit by themselves; the resumed run continues the trajectory."""
    # The ranks notice within their watchdog's 1 s poll and may train on until then (a TINY step takes tens
    # of ms): the run is long enough that they stop mid-run, not that they stop at the step of the kill.
    steps = 60
    overrides = [*TINY, "pipeline.stages=2", "train.ckpt_every=2", "train.ckpt_keep=3"]
    killed = tmp_path / "killed"
    _kill_at_random_step(killed, [*overrides, "pipeline.runtime=distributed"], steps=steps, kill_in=(3, 8),
                         whole_group=False)
    assert list_checkpoints(killed)[-1][0] < steps
    assert "resuming" in _resume(killed)
    # The simulation is the reference (tests/test_distributed.py: the runtime equals it to 1e-5).
    train(load_config("smoke", None, [*overrides, f"train.steps={steps}"]), out_dir=tmp_path / "sim")
    want, got = read_metrics(tmp_path / "sim" / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    measured = {"stage_busy", "bubble", "stage_peak_bytes"}  # what only the distributed runtime logs
    for g, w in zip(got, want):
        assert g.keys() - measured == w.keys()
        for key in ("loss", "grad_norm", "lr", "val_loss"):
            assert key not in w or abs(g[key] - w[key]) <= RTOL * abs(w[key]), (key, g, w)


_TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "-m", "bubblefree.distributed"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_sigint_stops_every_rank_after_one_step_with_one_hint_then_resume(tmp_path, launcher):
    """SIGINT to the launcher (ours, or torchrun's agent) of a run started in the background (SIGINT ignored,
    as a shell's ``&`` leaves it): every rank stops after the same step, that step is checkpointed, one line
    says where and how to continue, no rank is left; ``--resume`` (under torchrun every rank reads the run's
    own config.toml) finishes the run."""
    out = tmp_path / "run"
    start = [sys.executable, "-m", "bubblefree", "train"] if launcher == "local" else _TORCHRUN
    overrides = [*TINY, "pipeline.stages=2", "train.ckpt_every=0", "train.eval_every=0"]
    proc = subprocess.Popen([*start, "--preset", "smoke", *_sets([*overrides, "train.steps=2000"]),
                             *(["--set", "pipeline.runtime=distributed"] if launcher == "local" else []),
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    with killed_at_exit(proc):
        wait_for(lambda: _steps_logged(out) >= 3 or proc.poll() is not None, timeout_s=120)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert wait_for(lambda: not group_alive(proc.pid), timeout_s=30, poll_s=0.1), "ranks outlived the stop"
    if launcher == "local":
        assert proc.returncode == 130 and "Traceback" not in err, err
    hints = [line for line in err.splitlines() if "bubblefree: interrupted;" in line]
    assert len(hints) == 1 and f"continue with --resume {out}" in hints[0], err
    (stopped, _), = list_checkpoints(out)
    assert 3 <= stopped < 2000 and _steps_logged(out) == stopped  # the last step logged is the one kept

    resume = [sys.executable, "-m", "bubblefree", "train"] if launcher == "local" else _TORCHRUN
    done = subprocess.run([*resume, "--resume", str(out), "--set", f"train.steps={stopped + 2}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "resuming" in done.stdout, done.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, stopped + 3))


@pytest.mark.slow
def test_torchrun_user_error_is_one_line(tmp_path):
    """A refused resume under torchrun: the ranks agree, the node's first process says it once."""
    out = tmp_path / "run"
    train(load_config("smoke", None, [*TINY, "train.steps=2"]), out_dir=out)
    proc = subprocess.run([*_TORCHRUN, "--resume", str(out), "--set", "train.seed=4"], capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("bubblefree: error:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "differs from the checkpoint's in train.seed: 0 -> 4" in lines[0]


# Checkpoint manifests -------------------------------------------------------------------------------------

@pytest.fixture
def finished_run(tmp_path) -> Path:
    out = tmp_path / "run"
    train(load_config("smoke", None, [*TINY, "train.steps=9", "train.ckpt_keep=3"]), out_dir=out)
    return out


def test_manifest_records_the_file_and_the_run(finished_run):
    import hashlib

    import bubblefree

    (step, path), = list_checkpoints(finished_run)[-1:]
    manifest = json.loads(manifest_path(path).read_text())
    assert manifest["step"] == step == 9 and manifest["file"] == path.name
    assert manifest["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["bytes"] == path.stat().st_size
    assert manifest["bubblefree"] == bubblefree.__version__ and manifest["torch"] == torch.__version__
    # only the kept checkpoints have manifests, and no temporary file is left behind
    names = sorted(p.name for p in (finished_run / "checkpoints").iterdir())
    assert names == [f"step_{s:08d}.{ext}" for s in (3, 6, 9) for ext in ("json", "pt")]


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_damaged_checkpoint_is_refused_and_the_previous_one_resumes_exactly(finished_run, capsys, damage):
    newest = finished_run / "checkpoints" / "step_00000009.pt"
    data = newest.read_bytes()
    if damage == "truncated":
        newest.write_bytes(data[:len(data) // 2])
    else:  # one flipped byte in the middle: torch.load would read it without complaint
        newest.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:])
    before = (finished_run / "metrics.jsonl").read_bytes()
    assert main(["train", "--resume", str(finished_run)]) == 2
    err = capsys.readouterr().err
    assert str(newest) in err and ("truncated" in err if damage == "truncated" else "altered" in err)
    previous = finished_run / "checkpoints" / "step_00000006.pt"
    assert f"--resume {previous} --branch" in err and "Traceback" not in err
    assert (finished_run / "metrics.jsonl").read_bytes() == before

    want = read_metrics(finished_run / "metrics.jsonl")
    # The hint as printed: recomputes steps 7-9; the damaged file is moved aside, byte for byte, not deleted.
    assert main(["train", "--resume", str(previous), "--branch"]) == 0
    assert _without_timing(read_metrics(finished_run / "metrics.jsonl")) == _without_timing(want)
    assert load_checkpoint(newest)["step"] == 9
    aside, = (finished_run / "superseded").iterdir()
    assert (aside / "checkpoints" / newest.name).read_bytes() != newest.read_bytes()


def test_resume_lists_every_key_that_differs(finished_run, capsys):
    assert main(["train", "--resume", str(finished_run), "--set", "train.seed=1", "--set", "optim.lr=0.01",
                 "--set", "train.steps=12"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr: 0.02 -> 0.01" in err and "train.seed: 0 -> 1" in err and "train.steps" not in err


# Non-finite losses --------------------------------------------------------------------------------------

def _poison(monkeypatch, at: int) -> None:
    """Make the loss of 0-based step ``at`` NaN (so its gradients are NaN too)."""
    step_fn = SimExecutor.train_step

    def train_step(self, step, lr_scale):
        if step != at:
            return step_fn(self, step, lr_scale)
        loss_fn = self._loss
        self._loss = lambda x, y: loss_fn(x, y) * math.nan
        try:
            return step_fn(self, step, lr_scale)
        finally:
            del self._loss

    monkeypatch.setattr(SimExecutor, "train_step", train_step)


def test_nonfinite_loss_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    _poison(monkeypatch, at=4)
    out = tmp_path / "run"
    assert main(["train", "--preset", "smoke", *_sets([*TINY, "train.steps=9"]), "--out", str(out)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training stopped at step 5: the loss is nan" in err[0], err
    assert str(out / "checkpoints" / "step_00000003.pt") in err[0]
    assert [s for s, _ in list_checkpoints(out)] == [3]  # nothing of the diverged state is kept
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_nonfinite_skip_leaves_the_whole_state_unchanged_and_counts_it(tmp_path, monkeypatch):
    _poison(monkeypatch, at=4)
    out = tmp_path / "run"
    config = load_config("smoke", None, [*TINY, "train.steps=8", "train.ckpt_every=1", "train.ckpt_keep=20",
                                         "train.nonfinite=skip"])
    train(config, out_dir=out)
    before, after = (load_checkpoint(out / "checkpoints" / f"step_{s:08d}.pt") for s in (4, 5))
    _assert_equal(before["executor"], after["executor"])  # weights, optimizer, stash, EF: untouched
    records = read_metrics(out / "metrics.jsonl")
    assert [r["skipped"] for r in records] == [0] * 4 + [1] * 4
    assert math.isnan(records[4]["loss"]) and all(math.isfinite(r["loss"]) for r in records[5:])
    with pytest.raises(TrainingDiverged):  # the default policy on the same run stops
        train(load_config("smoke", None, [*TINY, "train.steps=8"]), out_dir=tmp_path / "stop")


def _assert_equal(a, b, where="state"):
    """Equal tensors and values, except each group's ``lr``: the loop sets it from the schedule every step."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            if not (k == "lr" and "groups" in where):  # the optimizer's param groups, by name
                _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), (where, a, b)


@pytest.mark.slow
def test_a_diverging_distributed_run_stops_every_rank_with_exit_code_3(tmp_path, capsys):
    """A learning rate of 1e30 makes the weights overflow: the writer rank stops the run, naming the step."""
    out = tmp_path / "run"
    args = [*TINY, "optim.lr=1e30", "optim.adamw_lr=1e30", "train.steps=6", "train.ckpt_every=2",
            "pipeline.runtime=distributed"]
    assert main(["train", "--preset", "smoke", *_sets(args), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    found = re.search(r"training stopped at step (\d+): .* the last good checkpoint is (\S+);", err)
    assert found, err
    assert Path(found.group(2)) == list_checkpoints(out)[-1][1] and int(found.group(1)) > list_checkpoints(out)[-1][0]


def test_skip_is_refused_by_the_distributed_runtime(tmp_path, capsys):
    assert main(["train", "--preset", "smoke", *_sets([*TINY, "train.nonfinite=skip",
                                                       "pipeline.runtime=distributed"]),
                 "--out", str(tmp_path / "run")]) == 2
    assert "Invalid train.nonfinite: 'skip' needs pipeline.runtime = 'sim'" in capsys.readouterr().err


# Distributed startup faults: two "nodes" started by hand, each with its own disk (cwd, cache, run folder) ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path: Path, args: list[list[str]]) -> list[tuple[int, str, float]]:
    """Start rank r with ``args[r]`` in its own folder; return each rank's (exit code, stderr, seconds)."""
    port, tic, procs = _free_port(), time.monotonic(), []
    for rank, extra in enumerate(args):
        node = tmp_path / f"node{rank}"
        node.mkdir(exist_ok=True)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "BUBBLEFREE_CACHE": str(node / "cache")}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "bubblefree.distributed", "--preset", "smoke",
             *_sets([*TINY, "pipeline.stages=2", "train.steps=4", "train.device=cpu"]), *extra,
             "--out", str(node / "run")], cwd=node, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True))
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        results.append((proc.returncode, err, time.monotonic() - tic))
    return results


@pytest.mark.slow
def test_data_missing_on_one_node_ends_every_rank_naming_it(tmp_path):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "corpus.txt").write_text("It is a truth universally acknowledged. " * 400)
    results = _two_nodes(tmp_path, [["--set", "data.source=corpus.txt"]] * 2)
    for rank, (code, err, seconds) in enumerate(results):
        assert code == 2 and seconds < 60, (rank, code, err)
        assert "Data path not found: corpus.txt" in err and "Traceback" not in err, (rank, err)
    assert "rank 1: Data path not found" in results[0][1]


@pytest.mark.slow
def test_ranks_with_different_configs_all_exit_listing_the_difference(tmp_path):
    results = _two_nodes(tmp_path, [[], ["--set", "train.seed=1"]])
    for rank, (code, err, seconds) in enumerate(results):
        assert code == 2 and seconds < 60, (rank, code, err)
        assert "different configs; rank 1 differs from rank 0 in train.seed: 0 -> 1" in err, (rank, err)
