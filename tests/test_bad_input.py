"""Bad input: the table of docs/reliability.md is the single source of truth; this test parses it and runs every
row. Then hypothesis generates invalid ``--set`` overrides and command lines. Every case must exit 2 with no
traceback, change no existing file and create no output folder."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from bubblefree.config import CHOICES, Config, config_to_dict
from bubblefree.train.loop import train
from bubblefree.train.presets import load_config
from helpers import folder_digest, run_cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
MARKER = "<!-- bad-input table"


def table_rows() -> list[tuple[str, str, str, int]]:
    """``(case, command, message, exit code)`` of every row of the bad-input table."""
    lines = DOC.read_text().split(MARKER, 1)[1].splitlines()[1:]
    rows = []
    for line in lines[2:]:  # after the header and the separator
        if not line.startswith("|"):
            break
        case, command, message, code = (cell.strip() for cell in line.strip("|").split("|"))
        rows.append((case, command.strip("`"), message.strip("`"), int(code)))
    return rows


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, Path]:
    """The placeholders of the table: a finished run, a damaged copy, a folder that does not exist, bad TOML."""
    root = tmp_path_factory.mktemp("bad-input")
    cache = os.environ.get("BUBBLEFREE_CACHE") or str(tmp_path_factory.getbasetemp() / "bubblefree-cache")
    run = root / "run"
    train(load_config("smoke", None, ["train.steps=6", "train.seq_len=32", "train.batch_size=4",
                                      "train.eval_batches=2", "train.ckpt_every=3", "log.progress=false",
                                      f"data.cache_dir={cache}"]), out_dir=run)
    damaged = root / "damaged"
    shutil.copytree(run, damaged)
    newest = damaged / "checkpoints" / "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    bare = root / "bare"  # truncated, and without the manifest that would have said so
    shutil.copytree(damaged, bare)
    (bare / "checkpoints" / "step_00000006.json").unlink()
    (root / "bad.toml").write_text("[train\nsteps = \n")
    (root / "short.txt").write_text("A text file far shorter than one sequence of the smoke preset.\n" * 3)
    mine = root / "mine"  # a folder of the user's own files
    mine.mkdir()
    (mine / "loss.png").write_bytes(b"the user's own plot")
    (mine / "notes.txt").write_text("notes")
    simulated = root / "simulated"  # what `bubblefree simulate --out` leaves
    assert run_cli(["simulate", "--stages", "2", "--microbatches", "2", "--schedules", "1f1b", "--steps", "1",
                    "--out", str(simulated)])[0] == 0
    return {"RUN": run, "DAMAGED": damaged, "BARE": bare, "NEW": root / "new", "BADTOML": root / "bad.toml",
            "SHORT": root / "short.txt", "MINE": mine, "SIMULATED": simulated, "LONG": root / ("x" * 300)}


def _substitute(text: str, places: dict[str, Path]) -> str:
    return re.sub(r"\b(RUN|DAMAGED|BARE|NEW|BADTOML|SHORT|MINE|SIMULATED|LONG)\b", lambda m: str(places[m.group(1)]),
                  text)


def _check_refused(argv: list[str], places: dict[str, Path], code: int = 2) -> str:
    root = places["RUN"].parent
    before = folder_digest(root)
    got, err = run_cli(argv)
    assert got == code, (argv, got, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)  # one line, never none
    assert folder_digest(root) == before, argv  # nothing changed, nothing new (NEW is under root)
    assert not places["NEW"].exists(), argv
    return err


def test_the_table_covers_the_cases():
    rows = table_rows()
    assert len(rows) >= 30 and len({r[0] for r in rows}) == len(rows)  # one row per case, none lost to parsing
    assert all(command.startswith("bubblefree ") for _, command, _, _ in rows)


@pytest.mark.parametrize("case, command, message, code", table_rows(), ids=[r[0] for r in table_rows()])
def test_every_row_of_the_table(places, case, command, message, code):
    argv = [_substitute(arg, places) for arg in shlex.split(command)[1:]]
    err = _check_refused(argv, places, code)
    assert _substitute(message, places) in " ".join(err.split()), (case, err)


# Hypothesis: invalid overrides and command lines ---------------------------------------------------------

FLAT = {f"{s}.{k}": v for s, table in config_to_dict(Config()).items() for k, v in table.items()}
ALLOWED = CHOICES
POSITIVE = {"data.vocab_size", "train.steps", "train.batch_size", "train.seq_len", "train.eval_batches",
            "train.log_every", "train.ckpt_keep", "pipeline.stages", "pipeline.microbatches"}
# Any text is a path (a missing one is tested in the table) or a digest of one, and empty is the default.
FREE_TEXT = {"data.source", "data.cache_dir", "model.init_from", "model.init_sha256"}


def _parses(kind: type, raw: str) -> bool:
    try:
        kind(raw.strip())
    except ValueError:
        return False
    return True


text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)


@st.composite
def invalid_override(draw) -> str:
    key = draw(st.sampled_from(sorted(set(FLAT) - FREE_TEXT)))
    default = FLAT[key]
    if isinstance(default, bool):
        value = draw(text.filter(lambda v: v.strip().lower() not in {"true", "false", "1", "0", "yes", "no"}))
    elif isinstance(default, int):
        value = draw(st.one_of(text.filter(lambda v: not _parses(int, v)),
                               st.integers(max_value=0 if key in POSITIVE else -1).map(str)))
    elif isinstance(default, float):  # negative momentum means "the default": there too large is invalid
        out_of_range = ["1", "1.5", "nan"] if key == "optim.momentum" else ["nan", "inf", "-inf", "-1e-9", "-3"]
        value = draw(st.one_of(text.filter(lambda v: not _parses(float, v)), st.sampled_from(out_of_range)))
    else:
        value = draw(text.filter(lambda v: v.strip() not in ALLOWED.get(key, ())))
    return f"{key}={value}"


unknown_key = st.from_regex(r"[a-z_]{1,8}\.[a-z_]{1,8}", fullmatch=True).filter(lambda k: k not in FLAT)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(override=st.one_of(invalid_override(), unknown_key.map(lambda k: f"{k}=1"),
                          text.filter(lambda t: "=" not in t)))
def test_invalid_overrides_are_refused(places, override):
    _check_refused(["train", "--preset", "smoke", "--set", override, "--out", str(places["NEW"])], places)
    _check_refused(["train", "--resume", str(places["RUN"]), "--set", override], places)


WORDS = ["train", "simulate", "bench", "reproduce", "--preset", "--config", "--set", "--resume", "--out",
         "--stages", "--costs", "--seeds", "smoke", "-x", "--", "=", "train.steps", "1", "0", "-1", "nan"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(st.one_of(st.sampled_from(WORDS), text.filter(lambda t: not t.startswith("-"))),
                     max_size=6))
def test_random_command_lines_exit_2_without_a_traceback(places, args):
    """Any command line ending in an existing run's --out or --resume is refused without a traceback."""
    if args[:1] == ["train"]:
        args = [*args, "--out", str(places["RUN"])]  # a run may only be refused: the folder holds one
    elif args[:1] in (["simulate"], ["bench"], ["reproduce"]):
        args = [args[0], "--no-such-option", *args[1:]]  # keep the valid subcommands from running
    _check_refused(args, places)
