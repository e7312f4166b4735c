"""Every number a user gives has a range (docs/reliability.md, Ranges), checked before anything is written.

The walks are generated: every number key of the config (``config.RANGES``, from the fields' metadata) and
every number option of the command line (``commandline.number_options``) gets ``nan``, ``inf``, negative, zero and
absurdly large values, so a new key or option is covered without touching this file. A value outside the
documented range, or an absurd one where the range says the machine or the model limits it, must be refused
with exit code 2 and one line naming the key (and the range) with no folder left; a value inside it must pass
validation. Then the limits themselves (the memory floor, the constants behind the caps), the one-line
messages of OS errors and of an unreachable dataset hub.
"""

from __future__ import annotations

import errno
import http.server
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bubblefree.commandline import Number, build_parser, number_options, options_markdown
from bubblefree.config import (
    FLOAT_MAX,
    INT_MAX,
    MAX_SEED,
    MAX_STEPS,
    MAX_VOCAB,
    MIN_BPE_VOCAB,
    RANGES,
    apply_overrides,
    ranges_markdown,
    validate,
)
from bubblefree.errors import UserError, describe_os_error, naming
from bubblefree.train.presets import load_config, smoke
from helpers import run_cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"

ABSURD_INT, ABSURD_FLOAT = 10**15, 1e30
"""Far past what any machine holds or any run needs, but inside the type's cap: refused only by a ``limit``."""
PROBES = {int: [-1, 0, ABSURD_INT, INT_MAX + 1, 10**30, "nan", "inf", "1e3"],
          float: [math.nan, math.inf, -math.inf, -1.0, 0.0, ABSURD_FLOAT, 1e39, 1e308]}
"""The values each number key is walked with, by its type (strings: text no integer parses from)."""


def _refused(argv: list[str], out: Path, *names: str) -> str:
    """Run the CLI in this process; check exit 2, one line naming each of ``names``, and no ``out`` left."""
    code, err = run_cli(argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (argv, code, err)
    assert all(name in lines[0] for name in names), (argv, lines[0])
    assert not out.exists(), argv
    return lines[0]


def _kind(key: str) -> type:
    return type(getattr(getattr(smoke(), key.split(".")[0]), key.split(".")[1]))


@pytest.mark.parametrize("key, value", [(k, v) for k in RANGES for v in PROBES[_kind(k)]], ids=str)
def test_every_config_number_is_refused_outside_its_range(data_cache, tmp_path, key, value):
    """Outside the documented range (or, for a key the machine or model limits, absurdly large): exit 2, one
    line naming the key and the range, no folder. Inside it: the config validates (zero is valid where the
    metadata says so, e.g. ``train.ckpt_every = 0``)."""
    r, out = RANGES[key], tmp_path / "run"
    text = value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)
    number = float(value) if isinstance(value, str) else value
    inside = (not isinstance(value, str)) and number in r
    absurd = number >= (ABSURD_INT if _kind(key) is int else ABSURD_FLOAT)
    argv = ["train", "--preset", "smoke", "--set", f"{key}={text}", "--out", str(out)]
    if not inside:
        line = _refused(argv, out, key)
        assert str(r) in line, line  # the range, as the docs list it
    elif r.limit and absurd:
        _refused(argv, out, key)  # refused by the model, the machine or another key, before any folder exists
    else:
        validate(apply_overrides(smoke(), {key: number}))


@pytest.mark.parametrize("key", list(RANGES))
def test_config_file_values_are_checked_alike(tmp_path, key):
    """A TOML file gives typed values: non-finite floats, and integers past the cap, are refused the same way."""
    kind = _kind(key)
    values = [math.nan, math.inf, -math.inf, 1e39] if kind is float else [INT_MAX + 1, -(10**30)]
    for value in values:
        if value in RANGES[key]:
            continue
        path = tmp_path / "run.toml"
        section, name = key.split(".")
        literal = {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan" if value != value else repr(value))
        path.write_text(f"[{section}]\n{name} = {literal}\n")
        with pytest.raises(UserError, match=re.escape(key)):
            load_config("smoke", path)


def test_every_number_key_has_a_finite_documented_range():
    """A new number field gets a range from its metadata (the type's cap at the least), never none."""
    from bubblefree.config import config_to_dict

    numbers = [f"{s}.{k}" for s, table in config_to_dict(smoke()).items() for k, v in table.items()
               if type(v) in (int, float)]
    assert numbers == list(RANGES)
    for key, r in RANGES.items():
        assert r.hi <= (INT_MAX if _kind(key) is int else FLOAT_MAX) and math.isfinite(r.hi), key


# ----------------------------------------------------------------------------------------- the command line

BASE = {"simulate": ["--stages", "2", "--microbatches", "2"], "plan": ["--preset", "smoke"],
        "bench": ["time-to-loss"], "reproduce": ["optimizers", "--scale", "smoke"]}
"""The arguments each command with number options needs beside them (a new one must be added here)."""
OUT = {"simulate", "plan", "bench", "reproduce"}
"""The commands that take ``--out`` (a refused one must not create it)."""


def _options() -> list[tuple[str, Number]]:
    return [(command, n) for command, numbers in number_options(build_parser()).items() for n in numbers]


def test_every_number_option_has_a_range():
    """No option parses a bare int or float: each is a ranged :class:`Number`."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    for name, sub in commands.choices.items():
        for action in sub._actions:
            assert action.type not in (int, float), (name, action.option_strings)
    assert len(_options()) >= 8


@pytest.mark.parametrize("command, number", _options(), ids=lambda x: getattr(x, "flag", x))
@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "-1", "0", "1e30", str(10**30)])
def test_every_number_option_is_refused_outside_its_range(tmp_path, command, number, text):
    out = tmp_path / "out"
    try:
        value = number.kind(text)
    except ValueError:
        value = None
    if value is not None and math.isfinite(value) and number.lo <= value <= number.high:
        pytest.skip(f"{text} is inside {number}")  # no current option: each starts at 1
    argv = [command, *BASE[command], f"{number.flag}={text}", *(["--out", str(out)] if command in OUT else [])]
    line = _refused(argv, out, number.flag)
    assert f"[{number.lo}, " in line, line


@pytest.mark.parametrize("command", ["simulate", "plan"])
@pytest.mark.parametrize("costs", ["nan:1:1", "1:inf:1", "-1:1:1", "0:0:0", "1e308:1:1", "1:1:1:nan", "1:1:1:1e13"])
def test_costs_are_finite_and_bounded(tmp_path, command, costs):
    """``simulate --costs nan:1:1`` printed a table of nan % (and with --out a renderer's traceback)."""
    out = tmp_path / "out"
    _refused([command, *BASE[command], f"--costs={costs}", "--out", str(out)], out, "--costs", costs)


def test_argparse_refusals_are_one_line():
    for argv in (["trian"], ["simulate", "--stages", "2"], ["train", "--stepz", "3"]):
        code, err = run_cli(argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("bubblefree: error: "), err


# ----------------------------------------------------------------------------------------- the docs' tables

def _part(name: str) -> str:
    match = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", DOC.read_text(encoding="utf-8"), re.S)
    assert match, f"docs/reliability.md has no {name} part"
    return match.group(1)


def test_the_docs_list_the_ranges_the_code_has():
    """docs/reliability.md's tables are the code's ranges (regenerate: config.ranges_markdown,
    commandline.options_markdown)."""
    assert _part("config-ranges") == ranges_markdown()
    assert _part("option-ranges") == options_markdown()


# ----------------------------------------------------------------------------------------- the limits

def test_the_caps_are_the_limits_they_name():
    from bubblefree.data.cache import stream_dtype
    from bubblefree.data.tokenizer import MIN_BPE_VOCAB as TOKENIZER_MIN
    from bubblefree.train.checkpoint import _NAME

    assert MIN_BPE_VOCAB == TOKENIZER_MIN
    assert np.iinfo(stream_dtype(MAX_VOCAB)).max == MAX_VOCAB - 1  # the largest id fits the stream's dtype
    assert _NAME.match(f"step_{MAX_STEPS:08d}.pt") and not _NAME.match(f"step_{MAX_STEPS + 1:08d}.pt")
    state = np.random.get_state()
    np.random.seed(MAX_SEED)
    with pytest.raises(ValueError):
        np.random.seed(MAX_SEED + 1)
    np.random.set_state(state)
    assert float(np.finfo(np.float32).max) == FLOAT_MAX


@pytest.mark.parametrize("overrides", [
    ["model.preset=llama-1m"], ["model.preset=moe-1m", "pipeline.stages=2"],
    ["model.preset=llama-5m", "pipeline.schedule=pipedream", "pipeline.stages=4", "pipeline.microbatches=4"],
    ["model.preset=llama-1m", "pipeline.runtime=distributed", "pipeline.schedule=gpipe"],
    ["model.preset=llama-1m", "optim.name=soap", "delay.correction=taylor", "delay.taylor_lambda=0.1",
     "delay.taylor_adaptive=true"],
])
def test_the_memory_floor_is_below_the_plan(overrides):
    """The floor a run checks (``train.memory.memory_floor``) stays below the plan of the same run, which the
    plan's tests measure against real tensors; the cheap floor (counted before the data is read) below the full."""
    from bubblefree.models.presets import model_args
    from bubblefree.train.memory import PARTS, memory_floor, plan_memory

    config = load_config("smoke", None, ["train.batch_size=8", "pipeline.microbatches=4", "train.seq_len=32",
                                         "model.vocab_size=256", *overrides])
    args = model_args(config.model, vocab_size=256)
    full, cheap = memory_floor(config, args), memory_floor(config, args, activations=False)
    assert 0 < cheap["batch"] <= full["batch"] and cheap["model"] == full["model"]
    (row,) = plan_memory(config, schedules=[config.pipeline.schedule])
    stages = row["stages"]
    state = [sum(getattr(st, p) for p in PARTS if p != "activations") for st in stages]
    if config.pipeline.runtime == "distributed":
        assert full["model"] <= max(state)
    else:
        assert full["model"] <= sum(state)
    windows = 8 // 4 * 33 * 8  # the microbatch's token windows, which the plan does not count
    assert full["batch"] - windows <= sum(st.activations for st in stages)


def test_the_memory_refusal_names_the_heaviest_key(monkeypatch):
    """With the device's memory made small, each part's key is named: the batch, the evaluation, the vocabulary,
    SOAP's preconditioner."""
    import torch

    from bubblefree.models.presets import model_args
    from bubblefree.train import memory

    monkeypatch.setattr(memory, "device_memory", lambda device: 1 << 20)
    cpu = torch.device("cpu")
    cases = [(["train.batch_size=4096", "pipeline.microbatches=1"], "train.batch_size"),
             (["train.eval_batches=100000"], "train.eval_batches"),
             (["model.vocab_size=200000"], "model.vocab_size"),
             (["model.preset=llama-5m", "model.vocab_size=300", "optim.name=soap", "optim.max_precond_dim=100000",
               "train.batch_size=2", "train.eval_batches=1", "pipeline.microbatches=1"], "optim.max_precond_dim")]
    for overrides, key in cases:
        config = load_config("smoke", None, overrides)
        args = model_args(config.model, vocab_size=config.model.vocab_size or 256)
        with pytest.raises(UserError, match=rf"^Invalid {re.escape(key)}: .*more than this machine's 1.0 MiB"):
            memory.check_memory(config, args, cpu, vocab_key="model.vocab_size")


def test_device_memory_is_the_machine_s():
    import torch

    from bubblefree.train.memory import device_memory

    have = device_memory(torch.device("cpu"))
    assert 0 < have <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ----------------------------------------------------------------------------------------- messages

class _Writer:
    """A writer that keeps its file open, as the metrics writer does."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("w")

    def log(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")  # what write() raises on a full disk


def test_an_os_error_without_a_filename_names_the_file_being_written(tmp_path):
    writer = _Writer(tmp_path / "metrics.jsonl")
    try:
        writer.log()
    except OSError as e:
        line = describe_os_error(e)
    writer._file.close()
    assert line.startswith(f"{tmp_path / 'metrics.jsonl'}: No space left on device (its filesystem is full")
    with pytest.raises(OSError) as info, naming(tmp_path / "x.tmp"):
        raise OSError(errno.EFBIG, "File too large")
    assert describe_os_error(info.value).startswith(f"{tmp_path / 'x.tmp'}: File too large (the file reached")
    assert describe_os_error(OSError(errno.EFBIG, "File too large")).startswith(
        "a file the system did not name: File too large")


@pytest.mark.slow
@pytest.mark.parametrize("argv, named", [
    (["simulate", "--stages", "2", "--microbatches", "4", "--out", "OUT"], "OUT/timeline.png"),
    (["train", "--preset", "smoke", "--set", "train.steps=2", "--out", "OUT"], "CACHE/tokens/."),
])
def test_a_file_size_limit_names_the_file_and_what_to_do(tmp_path, argv, named):
    """The report's "error: a file: File too large": a process under ``ulimit -f`` (Python ignores SIGXFSZ, so the
    write fails with EFBIG) exits 4 with one line naming the file and the limit."""
    import resource

    out, cache = tmp_path / "out", tmp_path / "cache"  # a fresh cache: the token streams are written
    argv = [a.replace("OUT", str(out)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "bubblefree", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "BUBBLEFREE_CACHE": str(cache)},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048)))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 4 and len(lines) == 1, proc.stderr
    assert named.replace("OUT", str(out)).replace("CACHE", str(cache)) in lines[0], lines[0]
    assert "File too large (the file reached the largest size this process may write (ulimit -f)" in lines[0]


def test_an_unreachable_hub_fails_in_seconds_and_says_how_to_go_offline(monkeypatch, tmp_path):
    """``hf:`` offline took 26 s of retries; now one request, the local cache, and one line."""
    datasets = pytest.importorskip("datasets")
    from huggingface_hub import constants

    from bubblefree.data.sources import load_hf

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        load_hf("hf:bubblefree-tests/no-such-dataset")
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "http://127.0.0.1:9) is unreachable" in message and "HF_HUB_OFFLINE=1" in message, message
    assert constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False  # restored


def test_a_hub_that_answers_is_reachable_whatever_its_status():
    from bubblefree.data.sources import _hub_unreachable

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert _hub_unreachable(f"http://127.0.0.1:{server.server_port}") is None
    finally:
        server.shutdown()
        server.server_close()
    assert _hub_unreachable("http://127.0.0.1:9")  # nothing listens: why, in words
