"""The command line: the smoke run end to end, --help, Ctrl-C and resume, and every kind of bad input
(exit code 2, one line on stderr, no traceback, nothing already written changed)."""

from __future__ import annotations

import hashlib
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblefree.cli import main
from bubblefree.config import DataConfig, config_diff, config_from_dict, read_toml
from bubblefree.data import load_tokens
from bubblefree.train.metrics import read_metrics
from bubblefree.train.presets import smoke
from bubblefree.train.sim import SimExecutor

TINY = ["--set", "train.steps=8", "--set", "train.seq_len=32", "--set", "train.batch_size=4",
        "--set", "train.eval_batches=2", "--set", "train.ckpt_every=0", "--set", "log.progress=false"]


@pytest.fixture(autouse=True)
def _session_cache(data_cache):
    """Every test here (and its subprocesses) uses the session's data cache (conftest.py)."""


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, cache_dir):
    """``python -m bubblefree train --preset smoke`` once, in a subprocess, as a user would run it."""
    out = tmp_path_factory.mktemp("smoke") / "run"
    proc = subprocess.run([sys.executable, "-m", "bubblefree", "train", "--preset", "smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "BUBBLEFREE_CACHE": cache_dir})
    return out, proc


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (empty when it does not exist)."""
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_smoke_run_writes_every_output_and_learns(smoke_run):
    out, proc = smoke_run
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(out) in proc.stdout and "final validation loss" in proc.stdout
    # config.toml says what ran: the defaults the run took, as values (the registry's, the tokenizer's).
    written = config_from_dict(read_toml(out / "config.toml"))
    assert config_diff(smoke(), written) == {
        "model.vocab_size": (0, 256), "optim.lr": (0.0, 0.02), "optim.momentum": (-1.0, 0.95),
        "optim.adamw_lr": (0.0, 0.003), "train.device": ("auto", "cpu"), "train.dtype": ("auto", "float32")}
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(5, 41, 5))
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0] < math.log(256)  # evaluated at 20 and 40, falling
    assert val[1] < math.log(256) - 1.5  # well below a uniform guess over bytes
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "step_00000040.pt").is_file()


@pytest.mark.slow
def test_a_saved_config_trains_again_to_the_same_losses(smoke_run, tmp_path, capsys):
    out, _ = smoke_run
    again = tmp_path / "again"
    assert main(["train", "--config", str(out / "config.toml"), "--out", str(again)]) == 0
    first, second = read_metrics(out / "metrics.jsonl"), read_metrics(again / "metrics.jsonl")
    assert [(r["loss"], r.get("val_loss")) for r in second] == [(r["loss"], r.get("val_loss")) for r in first]
    assert (again / "config.toml").read_text() == (out / "config.toml").read_text()


@pytest.mark.slow
def test_no_terminal_gets_plain_progress_lines(smoke_run):
    _, proc = smoke_run  # stderr is a pipe: a log file, nohup
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("step ")] == \
        [f"step {n}/40" for n in range(5, 41, 5)]
    assert "llama-1m at vocabulary 256 (0.17M parameters)" in proc.stdout


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    listed = capsys.readouterr().out
    assert "train" in listed and "bench" in listed


def test_reproduce_help_names_every_suite(capsys):
    from bubblefree.experiments.suites import SUITES

    with pytest.raises(SystemExit):
        main(["reproduce", "--help"])
    listed = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert [name for name in SUITES if name not in listed] == []


def _expect_user_error(capsys, argv, fragment):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bubblefree: error: "), captured.err
    assert fragment in lines[0] and "Traceback" not in captured.err


@pytest.mark.slow
@pytest.mark.parametrize("args, fragment", [
    (["--preset", "smoky"], "Invalid preset: 'smoky' (did you mean 'smoke'?)"),
    (["--set", "optim.lrr=1"], "valid keys of [optim]"),
    (["--set", "train.steps=ten"], "train.steps: 'ten' (expected int in [1, 99999999])"),
    (["--set", "train.batch_size=0"], "train.batch_size: 0 (must be >= 1"),
    (["--set", "train.seq_len=-8"], "train.seq_len: -8 (must be >= 1"),
    (["--config", "/nonexistent/run.toml"], "does not exist"),
    (["--preset", "smoke"], "already holds a run"),
])
def test_bad_input_leaves_an_existing_run_untouched(smoke_run, capsys, args, fragment):
    out, _ = smoke_run
    before = tree_digest(out)
    _expect_user_error(capsys, ["train", *args, "--out", str(out)], fragment)
    assert tree_digest(out) == before


@pytest.mark.slow
def test_resume_refuses_a_different_config(smoke_run, capsys):
    out, _ = smoke_run
    before = tree_digest(out)
    _expect_user_error(capsys, ["train", "--resume", str(out), "--set", "train.seed=3"],
                       "differs from the checkpoint's in train.seed: 0 -> 3")
    _expect_user_error(capsys, ["train", "--resume", str(out), "--preset", "demo"], "only --set may change")
    _expect_user_error(capsys, ["train", "--resume", str(out)], "the run is complete at step 40")
    _expect_user_error(capsys, ["train", "--resume", str(out.parent / "elsewhere")], "holds no run")
    assert tree_digest(out) == before


def _shards(folder: Path, *, promised: int, written: int) -> None:
    """A modded-nanogpt style shard pair whose header may promise more tokens than the file holds."""
    folder.mkdir()
    for name in ("data_train_000.bin", "data_val_000.bin"):
        header = np.zeros(256, dtype="<i4")
        header[:3] = (20240520, 1, promised)
        tokens = np.arange(written, dtype="<u2") % 200
        (folder / name).write_bytes(header.tobytes() + tokens.tobytes())


def _damaged_tokenizer_cache(tmp_path: Path) -> list[str]:
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i * 13 % 11}."
                              for i in range(4000)))
    cache = tmp_path / "cache"
    load_tokens(DataConfig(source=str(text), vocab_size=300, cache_dir=str(cache)))
    (tokenizer,) = (cache / "tokenizers").glob("*.json")
    tokenizer.write_bytes(tokenizer.read_bytes()[:200])  # torn file
    return ["--set", f"data.source={text}", "--set", "data.vocab_size=300", "--set", f"data.cache_dir={cache}",
            "--set", "data.tokenizer=bpe"]


@pytest.mark.parametrize("case", ["missing path", "corrupt shard", "damaged tokenizer cache"])
def test_bad_data_fails_before_writing_anything(tmp_path, capsys, case):
    if case == "missing path":
        args, fragment = ["--set", f"data.source={tmp_path / 'nowhere'}"], "not found"
    elif case == "corrupt shard":
        _shards(tmp_path / "shards", promised=1000, written=600)
        args, fragment = ["--set", f"data.source={tmp_path / 'shards'}"], "Truncated or corrupt shard"
    else:
        args, fragment = _damaged_tokenizer_cache(tmp_path), "Damaged tokenizer cache"
    before = tree_digest(tmp_path)
    _expect_user_error(capsys, ["train", "--preset", "smoke", *TINY, *args, "--out", str(tmp_path / "run")],
                       fragment)
    assert tree_digest(tmp_path) == before and not (tmp_path / "run").exists()


def test_ctrl_c_checkpoints_and_resume_finishes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    step_fn = SimExecutor.train_step

    def interrupted_at_step_2(self, step, lr_scale):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of a step
        return step_fn(self, step, lr_scale)

    monkeypatch.setattr(SimExecutor, "train_step", interrupted_at_step_2)
    assert main(["train", "--preset", "smoke", *TINY, "--set", "train.log_every=1", "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "checkpoints").glob("*.pt")) == ["step_00000003.pt"]  # step 2 finished
    monkeypatch.setattr(SimExecutor, "train_step", step_fn)
    assert main(["train", "--resume", str(out)]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 9))


def test_tensorboard_without_the_extra_is_a_user_error(tmp_path, capsys):
    try:
        import tensorboard  # noqa: F401
        pytest.skip("tensorboard is installed")
    except ImportError:
        pass
    _expect_user_error(capsys, ["train", "--preset", "smoke", "--set", "log.tensorboard=true",
                                "--out", str(tmp_path / "run")], "pip install 'bubblefree[tensorboard]'")
    assert not (tmp_path / "run").exists()


def _documented_commands() -> list[tuple[str, str]]:
    """``(file, line)`` of each ``bubblefree ...`` command in a code block of README.md or docs/*.md (fenced or
    indented by four spaces), continuation lines joined."""
    root = Path(__file__).resolve().parents[1]
    out = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        fenced = False
        for line in path.read_text(encoding="utf-8").replace("\\\n", " ").splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif (fenced or line.startswith("    ")) and line.strip().startswith("bubblefree "):
                out.append((path.name, line.strip()))
    return out


def test_every_documented_command_parses_and_every_train_command_validates():
    """A renamed key, a refused value, a stale flag or preset in an example fails here, not in a reader's run."""
    import shlex

    from bubblefree.commandline import build_parser
    from bubblefree.config import validate
    from bubblefree.errors import UserError
    from bubblefree.train.presets import load_config

    commands = _documented_commands()
    trains = 0
    for name, line in commands:
        try:
            args = build_parser().parse_args(shlex.split(line, comments=True)[1:])
            if args.command == "train" and args.config is None and args.resume is None:  # no reader's own files
                validate(load_config(args.preset, None, args.overrides))  # the checks across sections too
                trains += 1
        except (SystemExit, UserError) as err:
            pytest.fail(f"{name}: `{line}`: {err}")
    assert len(commands) >= 40 and trains >= 20, (len(commands), trains)
