"""Fault injection (docs/reliability.md, "Faults"): what a careful user can do to a run, done as the user would.

Two writers racing for one run, data moved or changed under a run, a resume from an older checkpoint, output
folders that hold the user's own files, read-only and full filesystems (an OSError injected where the
filesystem would raise it: the tests run as any user, root included, whom permissions do not stop), special
files, names too long, and storms of SIGINT and SIGTERM. Every refused command must exit with its documented
code, print one line and no traceback, and leave every byte of the earlier run as it was (the run folder is
hashed before and after).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bubblefree.train.checkpoint import _save_torch, _write_synced, list_checkpoints
from bubblefree.train.folders import LOCK_FILE, hold, holder_pids
from bubblefree.train.metrics import read_metrics
from bubblefree.train.resume import resume_hint
from bubblefree.train.sim import SimExecutor
from helpers import folder_digest, killed_at_exit, run_cli

TINY = ["train.seq_len=32", "train.batch_size=4", "train.eval_batches=2", "train.eval_every=3",
        "train.log_every=1", "train.ckpt_every=3", "train.ckpt_keep=3", "log.progress=false"]
TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7919 % 1000} times.\n"
               for i in range(400))


@pytest.fixture(autouse=True)
def _session_cache(data_cache):
    """Every test here (and its subprocesses) uses the session's data cache (conftest.py)."""


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _cli(argv: list[str]) -> tuple[int, list[str]]:
    """Run the CLI in this process; return (exit code, stderr lines)."""
    code, err = run_cli(argv)
    return code, err.strip().splitlines()


def _refused(argv: list[str], folder: Path, code: int, message: str) -> str:
    """Run ``argv``: it must exit ``code`` with one line holding ``message`` and change nothing in ``folder``."""
    before = folder_digest(folder)
    got, err = _cli(argv)
    assert got == code and len(err) == 1 and "Traceback" not in err[0], (argv, got, err)
    assert message in err[0], (message, err)
    assert folder_digest(folder) == before, argv
    return err[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir) -> Path:
    """A finished 6-step run on a text file named by a relative path (checkpoints at 3 and 6)."""
    root = tmp_path_factory.mktemp("faults")
    (root / "corpus.txt").write_text(TEXT)
    here = os.getcwd()
    os.chdir(root)
    try:
        code, err = _cli(["train", "--preset", "smoke", *_sets([*TINY, "train.steps=6", "data.source=corpus.txt",
                                                                  f"data.cache_dir={cache_dir}"]), "--out", "run"])
    finally:
        os.chdir(here)
    assert code == 0, err
    return root / "run"


@pytest.fixture
def run(finished, tmp_path, monkeypatch) -> Path:
    """A copy of the finished run, from the working directory the original ran in (so its data.source names
    the same file)."""
    shutil.copytree(finished, tmp_path / "run")
    monkeypatch.chdir(finished.parent)
    return tmp_path / "run"


def _ckpt(run: Path, step: int) -> str:
    return str(run / "checkpoints" / f"step_{step:08d}.pt")


# One writer per run folder -----------------------------------------------------------------------------

def _wait(predicate, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    # Generous: on a loaded machine a subprocess's start (torch import, data) has taken minutes.
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the process ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_first_and_the_lock_dies_with_it(run):
    """The issue's race: --resume RUN while RUN trains. The second writer (train, export, a fresh --out on it)
    is refused with the first one's pid and changes nothing; after a SIGKILL the lock is gone (never stale)."""
    first = subprocess.Popen([sys.executable, "-m", "bubblefree", "train", "--resume", str(run),
                              "--set", "train.steps=100000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        _wait(lambda: len(read_metrics(run / "metrics.jsonl")) > 6, first, "the first writer's step 7")
        assert holder_pids(run / LOCK_FILE) == [first.pid]
        for argv in (["train", "--resume", str(run), "--set", "train.steps=100000"],
                     ["train", "--resume", _ckpt(run, 6), "--set", "train.steps=100000"],
                     ["export", str(run), "--format", "hf", "--out", str(run.parent / "hf")]):
            got, err = _cli(argv)  # the first writer keeps writing: the folder is not compared here
            assert got == 2 and len(err) == 1 and f"in use by another bubblefree process (pid {first.pid})" \
                in err[0], (argv, got, err)
        assert not (run.parent / "hf").exists()
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert holder_pids(run / LOCK_FILE) == []
    with hold(run, what="--resume"):  # the kernel released it with the process
        pass


@pytest.mark.slow
@pytest.mark.parametrize(("command", "held"), [
    (["train", "--preset", "smoke", "--out", "EMPTY"], "."),
    (["train", "--preset", "smoke", "--set", "pipeline.runtime=distributed", "--out", "EMPTY"], "."),
    # a suite's lock is its own (two suites may fill one results folder; one suite has one writer)
    (["reproduce", "optimizers", "--scale", "smoke", "--out", "EMPTY"], "work/optimizers"),
], ids=["train", "distributed-launcher", "reproduce"])
def test_every_writer_takes_the_lock_before_it_writes(tmp_path, command, held):
    """A folder whose lock another process holds (here a bare holder, so nothing else differs) is refused by
    each kind of writer before it starts a rank or a run."""
    empty = tmp_path / "empty"
    (empty / held).mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from bubblefree.train.folders import hold\n"
                               "with hold(sys.argv[1], what='x'):\n print('held', flush=True); time.sleep(120)",
                               str(empty / held)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = [str(empty) if a == "EMPTY" else a for a in command]
        _refused(argv, empty, 2, f"is in use by another bubblefree process (pid {holder.pid})")
    finally:
        holder.kill()
        holder.communicate(timeout=60)


# Folders that are not runs -----------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["train", "--preset", "smoke", "--out", "MINE"],
    ["simulate", "--stages", "2", "--microbatches", "4", "--out", "MINE"],
    ["reproduce", "optimizers", "--scale", "smoke", "--out", "MINE"],
], ids=["train", "simulate", "reproduce"])
def test_a_folder_of_the_users_own_files_is_not_written_into(tmp_path, command):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "loss.png").write_bytes(b"the user's own plot")
    (mine / "notes.txt").write_text("notes")
    _refused([str(mine) if a == "MINE" else a for a in command], mine, 2,
             f"{mine} is not empty and holds no bubblefree output (loss.png, notes.txt)")


def test_simulate_replaces_its_own_earlier_output(tmp_path):
    out = tmp_path / "sim"
    for _ in range(2):
        assert _cli(["simulate", "--stages", "2", "--microbatches", "4", "--steps", "2", "--out", str(out)])[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["simulate.json", "timeline.png"]


# Checkpoint lineage ------------------------------------------------------------------------------------

def test_going_back_a_checkpoint_is_refused_and_branching_keeps_the_future_aside(run):
    old = folder_digest(run)
    _refused(["train", "--resume", _ckpt(run, 3), "--set", "train.steps=6"], run, 2,
             f"{run} went on past step 3 (checkpoint step_00000006.pt); continuing from step 3 would overwrite")
    code, err = _cli(["train", "--resume", _ckpt(run, 3), "--branch", "--set", "train.steps=6"])
    assert code == 0, err
    aside, = (run / "superseded").iterdir()
    for name in ("checkpoints/step_00000006.pt", "checkpoints/step_00000006.json", "metrics.jsonl"):
        assert hashlib.sha256((aside / name).read_bytes()).hexdigest() == old[name], name  # moved, byte for byte
    # The branch recomputed steps 4-6 from the same state: an exact resume gives the same lines again.
    strip = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_metrics(run / "metrics.jsonl")]
    assert strip == [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_metrics(aside / "metrics.jsonl")]


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_the_start(run):
    """Its hint says --resume; that command starts it over with its own config (and computes the same lines)."""
    before = read_metrics(run / "metrics.jsonl")
    shutil.rmtree(run / "checkpoints")
    assert "no checkpoint was written yet (start over with --resume" in resume_hint(run)
    code, err = _cli(["train", "--resume", str(run)])
    assert code == 0, err
    after = read_metrics(run / "metrics.jsonl")
    assert [r["loss"] for r in after] == [r["loss"] for r in before]


def test_an_unverified_checkpoint_is_never_called_good(run):
    (run / "checkpoints" / "step_00000006.json").unlink()
    hint = resume_hint(run)
    assert f"the last good checkpoint is {_ckpt(run, 3)}" in hint and "--branch" in hint, hint
    _refused(["export", _ckpt(run, 6), "--format", "hf", "--out", str(run.parent / "hf")], run, 2,
             "has no manifest (step_00000006.json), so it cannot be verified")


def test_exports_hint_names_an_export_command(run):
    newest = run / "checkpoints" / "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    line = _refused(["export", str(run), "--format", "hf", "--out", str(run.parent / "hf")], run, 2,
                    f"export the previous one: bubblefree export {_ckpt(run, 3)} --out DIR")
    assert "--resume" not in line


# The data pinned -------------------------------------------------------------------------------------

def test_the_run_records_its_data(finished):
    record = json.loads((finished / "data.json").read_text())
    assert record["source"] == str((finished.parent / "corpus.txt").resolve())
    assert len(record["sha256"]) == 64 and record["train_tokens"] > record["val_tokens"] > 0


def test_other_data_under_the_same_name_is_refused(run, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "corpus.txt").write_text(TEXT.upper())
    monkeypatch.chdir(elsewhere)
    line = _refused(["train", "--resume", str(run), "--set", "train.steps=9"], run, 2,
                    f"the data differs from the run's: data.source corpus.txt is {elsewhere / 'corpus.txt'}, "
                    f"the run trained on {json.loads((run / 'data.json').read_text())['source']}")
    assert "sha256" in line


def test_data_changed_in_place_is_refused(run, tmp_path, monkeypatch):
    """The same path with one byte changed: the run (pinned here to its own copy of the text) refuses it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    record = json.loads((run / "data.json").read_text())
    (run / "data.json").write_text(json.dumps({**record, "source": str(corpus)}))
    monkeypatch.chdir(tmp_path)
    corpus.write_text(TEXT[:-2] + "!\n")
    _refused(["train", "--resume", str(run), "--set", "train.steps=9"], run, 2,
             f"{corpus} changed since the run trained on it (sha256 ")


def test_moved_data_needs_the_users_word_and_matching_tokens(run, tmp_path, monkeypatch):
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "corpus.txt").write_text(TEXT)
    monkeypatch.chdir(moved)
    _refused(["train", "--resume", str(run), "--set", "train.steps=9"], run, 2,
             "the tokens are the same: continue on them with --data-moved")
    code, err = _cli(["train", "--resume", str(run), "--data-moved", "--set", "train.steps=9"])
    assert code == 0, err
    assert json.loads((run / "data.json").read_text())["source"] == str(moved / "corpus.txt")


def test_a_special_file_is_not_data(tmp_path):
    _refused(["train", "--preset", "smoke", "--set", "data.source=/dev/zero", "--out", str(tmp_path / "new")],
             tmp_path, 2, "Invalid data.source: /dev/zero is not a file or folder")


# Damaged run files -------------------------------------------------------------------------------------

RUN_FILES = {"config.toml": "config.toml", "data.json": "data.json", "metrics.jsonl": "metrics.jsonl",
             "manifest": "checkpoints/step_00000006.json"}
"""The files a resume reads, by the name the tests give them (the manifest: the newest checkpoint's)."""


def _middle(lines: list[bytes]) -> int:
    return len(lines) // 2


def _replace_middle(text: bytes) -> Callable[[bytes], tuple[bytes, int]]:
    def damage(raw: bytes) -> tuple[bytes, int]:
        lines = raw.split(b"\n")
        i = _middle(lines)
        return b"\n".join([*lines[:i], text, *lines[i + 1:]]), i + 1
    return damage


def _into_middle(raw: bytes) -> tuple[bytes, int]:
    lines = raw.split(b"\n")
    i = _middle(lines)
    return b"\n".join([*lines[:i], lines[i][:3] + b"\xff" + lines[i][3:], *lines[i + 1:]]), i + 1


def _drop_middle(raw: bytes) -> tuple[bytes, None]:
    lines = raw.split(b"\n")
    return b"\n".join(lines[:_middle(lines)] + lines[_middle(lines) + 1:]), None


DAMAGE_KINDS = {
    # name: raw bytes -> (damaged bytes, the line the refusal must name, or None); None: the file is deleted
    "deleted": None,
    "emptied": lambda raw: (b"", None),
    "cut in half": lambda raw: (raw[:len(raw) // 2], None),
    "not UTF-8": _into_middle,
    "not parseable": _replace_middle(b'{"oops'),
    "a line of null": _replace_middle(b"null"),
    "a line of {}": _replace_middle(b"{}"),
    "a line of [1,2]": _replace_middle(b"[1,2]"),
    "a line dropped": _drop_middle,
}


@pytest.mark.parametrize("kind", DAMAGE_KINDS)
@pytest.mark.parametrize("name", RUN_FILES)
def test_a_damaged_run_file_is_refused_by_name_and_line_until_the_loss_is_accepted(run, name, kind):
    """Each file a resume reads, each way a file is damaged: the resume refuses in one line naming the file
    (and the line, where there is one), with every byte of the folder as it was; with --accept-damaged it goes
    on, keeping the damaged file byte for byte beside the new one, and the metrics hold each readable record
    once, in order, up to the new end."""
    path = run / RUN_FILES[name]
    original = path.read_bytes()
    if DAMAGE_KINDS[kind] is None:
        path.unlink()
        damaged, line = None, None
    else:
        damaged, line = DAMAGE_KINDS[kind](original)
        path.write_bytes(damaged)
    resume = ["train", "--resume", str(run), "--set", "train.steps=8"]
    message = _refused(resume, run, 2, str(path))
    assert "--accept-damaged" in message and (line is None or f"line {line} " in message), message
    assert message.count(str(run)) == 1, message  # the damaged file, and no other
    readable = [r["step"] for r in read_metrics(run / "metrics.jsonl")] if name == "metrics.jsonl" and damaged else []

    code, err = _cli([*resume, "--accept-damaged"])
    assert code == 0, err
    kept = sorted(path.parent.glob(f"{path.name}.damaged-*"))
    assert [p.read_bytes() for p in kept] == ([] if damaged is None else [damaged])
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    if name != "metrics.jsonl":
        assert steps == list(range(1, 9))
    else:  # the readable records up to the checkpoint's step, then the new ones
        assert steps == [s for s in readable if s <= 6] + [7, 8], steps
    assert list_checkpoints(run)[-1][0] == 8


@pytest.mark.parametrize("edit", ["a record's loss", "a record repeated", "the first lines cut off"])
def test_metrics_that_parse_but_are_not_what_the_checkpoint_saw_are_refused(run, edit):
    """The checkpoint's manifest records metrics.jsonl's bytes as they were when it was written: a record
    changed, repeated, or lines cut at a line boundary are found though every line is a record."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    if edit == "a record's loss":
        record = json.loads(lines[2])
        lines[2] = json.dumps({**record, "loss": record["loss"] + 1}) + "\n"
    elif edit == "a record repeated":
        lines.insert(3, lines[2])
    else:
        lines = lines[2:]
    path.write_text("".join(lines))
    message = _refused(["train", "--resume", str(run), "--set", "train.steps=8"], run, 2, str(path))
    assert "--accept-damaged" in message


def test_a_torn_last_line_is_no_damage(run):
    """A run killed in the middle of writing a record leaves its last line without a newline; its step is past
    the checkpoint, so the resume computes it again, silently."""
    path = run / "metrics.jsonl"
    path.write_bytes(path.read_bytes() + b'{"step": 7, "lo')
    code, err = _cli(["train", "--resume", str(run), "--set", "train.steps=8"])
    assert code == 0 and err == [], err
    assert [r["step"] for r in read_metrics(path)] == list(range(1, 9))


# Filesystem faults ---------------------------------------------------------------------------------------

def _refuse_writes(monkeypatch, under: Path, err: int) -> None:
    """Make every write-like file operation below ``under`` fail with ``err``, as a read-only (EROFS) or full
    (ENOSPC) filesystem would: opening for writing, creating folders, renaming into it."""
    under = str(under)
    strerror = os.strerror(err)

    def inside(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(under)

    real_open, real_os_open, real_mkdir, real_replace = builtins.open, os.open, os.mkdir, os.replace

    def fake_open(file, mode="r", *args, **kwargs):
        if inside(file) and any(c in mode for c in "wax+"):
            raise OSError(err, strerror, os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and not str(path).endswith(LOCK_FILE):
            raise OSError(err, strerror, os.fspath(path))
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if inside(path):
            raise OSError(err, strerror, os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    def fake_replace(src, dst, *args, **kwargs):
        if inside(dst):
            raise OSError(err, strerror, os.fspath(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "replace", fake_replace)


def test_a_read_only_output_folder_is_one_line(tmp_path, monkeypatch):
    _refuse_writes(monkeypatch, tmp_path, errno.EROFS)
    _refused(["train", "--preset", "smoke", "--out", str(tmp_path / "new")], tmp_path, 4,
             f"{tmp_path / 'new'}: Read-only file system")
    assert not (tmp_path / "new").exists()


def test_read_only_checkpoints_on_resume_name_the_last_good_one(run, monkeypatch):
    """The issue's case: every step trains, then the save fails. One line, exit 4, the checkpoints untouched."""
    checkpoints = folder_digest(run / "checkpoints")
    _refuse_writes(monkeypatch, run / "checkpoints", errno.EROFS)
    got, err = _cli(["train", "--resume", str(run), "--set", "train.steps=8"])
    assert got == 4 and len(err) == 1 and "Traceback" not in err[0], err
    assert "Read-only file system" in err[0] and f"the last good checkpoint is {_ckpt(run, 6)}" in err[0], err
    assert folder_digest(run / "checkpoints") == checkpoints


def test_a_full_disk_at_the_final_save_names_the_last_good_checkpoint(run, monkeypatch):
    """ENOSPC as torch raises it (a RuntimeError of its own with the OSError in its context): one line, no
    temporary file left, the earlier checkpoints intact; after space is freed the resume continues."""
    import torch

    checkpoints = folder_digest(run / "checkpoints")
    real_save = torch.save

    def full(payload, f, *args, **kwargs):
        if payload.get("step") == 8:
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:  # torch's own error, with the OSError only as its context (as torch raises it)
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
        return real_save(payload, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full)
    got, err = _cli(["train", "--resume", str(run), "--set", "train.steps=8"])
    assert got == 4 and len(err) == 1 and "Traceback" not in err[0], err
    assert "No space left on device" in err[0] and f"the last good checkpoint is {_ckpt(run, 6)}" in err[0], err
    assert folder_digest(run / "checkpoints") == checkpoints  # no torn or temporary file
    monkeypatch.setattr(torch, "save", real_save)
    assert _cli(["train", "--resume", str(run), "--set", "train.steps=8"])[0] == 0
    assert [s for s, _ in list_checkpoints(run)] == [3, 6, 8]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) for a real ENOSPC")
def test_torchs_own_enospc_becomes_the_oserror_it_is():
    """The checkpoint writer's own path onto a device that is always full: torch's RuntimeError (or a failed
    flush) comes out as the ENOSPC it is, naming the file."""
    full = Path("/dev/full")
    with pytest.raises(OSError) as caught:
        _write_synced(full, lambda f: _save_torch({"w": list(range(100000))}, f, full))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(full)


def test_a_name_too_long_is_one_line(tmp_path):
    name = tmp_path / ("x" * 300)
    _refused(["train", "--preset", "smoke", "--out", str(name)], tmp_path, 4, "File name too long")


# Signals and endings ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("storm", [[signal.SIGTERM, signal.SIGINT], [signal.SIGINT] * 3 + [signal.SIGTERM] * 3],
                         ids=["term-then-int", "storm"])
def test_any_sequence_of_signals_stops_at_a_step_boundary(tmp_path, storm):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "bubblefree", "train", "--preset", "smoke",
                             *_sets([*TINY, "train.steps=100000", "train.ckpt_every=0"]), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (out / "metrics.jsonl").exists() and len(read_metrics(out / "metrics.jsonl")) >= 2, proc,
              "step 2")
        for sig in storm:  # back to back: the later ones land inside the step or the checkpoint
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1 and "Traceback" not in err, (proc.returncode, err)
    (stopped, _), = list_checkpoints(out)
    assert f"interrupted; checkpoint at step {stopped}" in lines[0]
    assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == stopped


@pytest.mark.slow
def test_sigterm_during_setup_is_exit_130_and_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "bubblefree", "train", "--preset", "smoke",
                             *_sets([*TINY, "train.steps=100000"]), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (out / LOCK_FILE).exists(), proc, "the run folder's lock")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1 and "Traceback" not in err, (proc.returncode, err)
    if "nothing was written" in lines[0]:  # it landed in the setup: no folder is left
        assert not out.exists()
    else:  # the setup was quicker: it stopped at the first step boundary
        assert "interrupted; checkpoint at step" in lines[0]


def _swallowing_signal(real, sig):
    """``real`` behind a stand-in that signals this process inside a ``try`` that swallows KeyboardInterrupt, as
    numpy's Cython imports do with one raised inside them."""
    def stand_in(*args, **kwargs):
        try:
            os.kill(os.getpid(), sig)
            time.sleep(0.05)  # the handler runs here, in this frame
        except KeyboardInterrupt:
            pass
        return real(*args, **kwargs)
    return stand_in


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_signal_in_the_setup_cannot_be_swallowed_by_a_library(tmp_path, monkeypatch, sig):
    import bubblefree.train.loop as loop

    monkeypatch.setattr(loop, "load_tokens", _swallowing_signal(loop.load_tokens, sig))
    out = tmp_path / "run"
    got, err = _cli(["train", "--preset", "smoke", *_sets([*TINY, "train.steps=3"]), "--out", str(out)])
    assert got == 130 and err == ["bubblefree: interrupted before the run started; nothing was written"], err
    assert not out.exists()


def test_a_second_signal_in_the_setup_stops_it_at_once(tmp_path, monkeypatch):
    import bubblefree.train.loop as loop

    real, went_on = loop.load_tokens, []

    def slow_stage(*args, **kwargs):  # a long stage: the first signal waits for its end, the second does not
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        went_on.append("after the first")
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        went_on.append("after the second")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "load_tokens", slow_stage)
    out = tmp_path / "run"
    got, err = _cli(["train", "--preset", "smoke", *_sets([*TINY, "train.steps=3"]), "--out", str(out)])
    assert got == 130 and err == ["bubblefree: interrupted before the run started; nothing was written"], err
    assert went_on == ["after the first"] and not out.exists()


STORM_SEED = 46
"""The seed of the storms below: every run of the tests sends the same mixes at the same moments."""


def _storm(rng: random.Random, within_s: float) -> list[tuple[float, int]]:
    """A random mix: one to six signals, each SIGINT or SIGTERM, the first at a moment in ``[0, within_s)``
    seconds, each next one up to 0.3 s after the one before (so that they land during the stop too)."""
    at, storm = rng.uniform(0, within_s), []
    for _ in range(rng.randint(1, 6)):
        storm.append((at, rng.choice([signal.SIGINT, signal.SIGTERM])))
        at += rng.uniform(0, 0.3)
    return storm


def _send(storm: list[tuple[float, int]], kill) -> None:
    start = time.monotonic()
    for at, sig in storm:
        time.sleep(max(0.0, start + at - time.monotonic()))
        kill(sig)


def _check_ending(lines: list[str], out: Path) -> None:
    """One line saying how the run ended, and a run folder that agrees with it."""
    assert len(lines) == 1 and lines[0].startswith("bubblefree: interrupted"), lines
    if "nothing was written" in lines[0]:
        assert not out.exists()
    if "interrupted; checkpoint at step" in lines[0]:
        (stopped, _), *_ = reversed(list_checkpoints(out))
        assert f"checkpoint at step {stopped} " in lines[0]
        assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == stopped


def _storm_command(kind: str, out: Path) -> list[str]:
    return (["simulate", "--stages", "8", "--microbatches", "16", "--schedules", "1f1b,2bw,pipedream"]
            if kind == "simulate" else
            ["train", "--preset", "smoke", *_sets([*TINY, "train.steps=4", "train.ckpt_every=2"]), "--out", str(out)])


@pytest.fixture(scope="module")
def command_seconds(tmp_path_factory, cache_dir) -> dict[str, float]:
    """How long each command of the storms takes here undisturbed, so that the storms span all of it (the second
    of two runs: the first also imports and tokenizes)."""
    seconds = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BUBBLEFREE_CACHE", cache_dir)
        for kind in ("train", "simulate"):
            for _ in range(2):
                start = time.monotonic()
                assert _cli(_storm_command(kind, tmp_path_factory.mktemp("quiet") / "run"))[0] == 0
                seconds[kind] = time.monotonic() - start
    return seconds


@pytest.mark.parametrize("trial", range(24))
def test_a_storm_at_any_moment_of_a_command_in_this_process(tmp_path, trial, command_seconds):
    """Random mixes of SIGINT and SIGTERM at random moments of a whole command (its setup, steps, checkpoints,
    the lines it prints; a simulation, outside any run), over 1.2 times its undisturbed length: exit code 130
    and one line, or, where every signal came before main had its handler or after it returned, the command's
    own success. main puts back the handlers it found, here a stand-in that counts what comes outside it (so
    that pytest never sees one)."""
    rng = random.Random(STORM_SEED + trial)
    kind = "simulate" if trial % 4 == 3 else "train"
    out = tmp_path / "run"
    storm, outside = _storm(rng, 1.2 * command_seconds[kind]), []
    previous = {sig: signal.signal(sig, lambda signum, frame: outside.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    sender = threading.Thread(target=_send, args=(storm, lambda sig: os.kill(os.getpid(), sig)))
    try:
        sender.start()
        code, err = _cli(_storm_command(kind, out))
        sender.join()
        time.sleep(0.05)  # a signal sent last is handled at this thread's next bytecode
    finally:
        sender.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert not any("Traceback" in line for line in err), err
    if len(outside) == len(storm):
        assert code == 0 and err == [], (code, err)
    else:
        assert code == 130, (code, err, storm, outside)
        _check_ending(err, out)


def _handles_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has its own SIGTERM handler yet (``SigCgt`` of /proc): bubblefree's main installs
    it first thing; before, Python is still starting, which no handler can cover (docs/reliability.md)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="tells when main has started from /proc")
@pytest.mark.parametrize("trial", range(4))
def test_a_storm_at_any_moment_of_a_process_ends_it_with_130_and_one_line(tmp_path, trial):
    """As a user or a supervisor would: random mixes from the moment the process has its handler (imports,
    setup, steps, the stop itself); trial 0 is the case of issue 46, SIGTERM after step 2 and another SIGTERM
    0.1-0.6 s later, during the stop. Never 143 (the signal's own ending), never a traceback."""
    rng = random.Random(STORM_SEED * 100 + trial)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "bubblefree", "train", "--preset", "smoke",
                             *_sets([*TINY, "train.steps=100000", "train.ckpt_every=2"]), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with killed_at_exit(proc):
        if trial == 0:
            _wait(lambda: (out / "metrics.jsonl").exists() and len(read_metrics(out / "metrics.jsonl")) >= 2, proc,
                  "step 2")
            storm = [(0.0, signal.SIGTERM), (rng.uniform(0.1, 0.6), signal.SIGTERM)]
        else:
            _wait(lambda: _handles_sigterm(proc.pid), proc, "main's handler")
            storm = _storm(rng, 6.0)
        _send(storm, lambda sig: proc.poll() is None and proc.send_signal(sig))
        _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err, storm)
    _check_ending(err.strip().splitlines(), out)


def test_a_signal_inside_an_import_is_counted_and_stops_the_command_after_it(tmp_path, monkeypatch):
    """Raised inside an import a KeyboardInterrupt can abort the process from C++ (torch's pybind11 callbacks) or
    make CPython end it by SIGINT: the import finishes, and the next check stops the command."""
    from bubblefree import interrupts

    (tmp_path / "signals_itself.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n"
                                                "for _ in range(10_000):\n    pass\nFINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with interrupts.command(program=False):
        import signals_itself  # noqa: F401  # the handler runs inside the import, at a bytecode boundary

        assert signals_itself.FINISHED and interrupts.signalled() == 1
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
    with interrupts.command(program=False):  # outside an import the signal stops the code where it lands
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):
                pass
    sys.modules.pop("signals_itself", None)


def test_the_program_leaves_both_signals_ignored_as_it_ends():
    """Without argv main is the program: nothing after its outcome may end the process by a signal (143) or
    raise where the interpreter shuts down."""
    from bubblefree.cli import main

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    argv = sys.argv
    try:
        sys.argv = ["bubblefree", "simulate", "--stages", "2", "--microbatches", "2", "--schedules", "1f1b"]
        with contextlib.redirect_stdout(io.StringIO()):
            assert main() == 0
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in previous)
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: this process goes on
    finally:
        sys.argv = argv
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    with contextlib.redirect_stdout(io.StringIO()):  # with argv (a caller in this process): its handlers back
        assert main(["simulate", "--stages", "2", "--microbatches", "2", "--schedules", "1f1b"]) == 0
    assert {sig: signal.getsignal(sig) for sig in previous} == previous


def test_a_final_validation_loss_that_is_not_finite_is_not_done(tmp_path, monkeypatch):
    monkeypatch.setattr(SimExecutor, "evaluate", lambda self, split="val": float("nan"))
    got, err = _cli(["train", "--preset", "smoke", *_sets([*TINY, "train.steps=3"]), "--out", str(tmp_path / "r")])
    assert got == 3 and len(err) == 1 and "final validation loss of nan" in err[0], err


def test_a_distributed_run_whose_final_validation_loss_is_not_finite_is_not_done(tmp_path, monkeypatch):
    """The launcher reads the verdict from the run's metrics (its ranks' summary stays with them): a stand-in
    launch writes the lines a run whose evaluation gave nan leaves behind."""
    import bubblefree.distributed as distributed

    def launch(config, out_dir, **options):
        Path(out_dir).mkdir()
        lines = [{"step": 1, "loss": 5.0, "val_loss": 5.1}, {"step": 2, "loss": 4.9, "val_loss": float("nan")}]
        (Path(out_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

    monkeypatch.setattr(distributed, "launch_local", launch)
    monkeypatch.delenv("RANK", raising=False)
    argv = ["train", "--preset", "smoke", *_sets([*TINY, "train.steps=2", "pipeline.runtime=distributed",
                                                  "pipeline.stages=2"]), "--out", str(tmp_path / "r")]
    got, err = _cli(argv)
    assert got == 3 and len(err) == 1 and "ended at step 2 with a final validation loss of nan" in err[0], err
