"""A resume reads the run's own files strictly, all of them, before it writes anything (docs/reliability.md,
"Damaged run files").

The files: ``config.toml`` (the resolved config), ``data.json`` (the data the run is pinned to),
``metrics.jsonl`` (one record per logged step) and the manifest of the checkpoint the run continues from. Each is
read whole; one that is missing, not UTF-8, not parseable, not of its shape, or (``metrics.jsonl``) no longer
the bytes the checkpoint's manifest recorded of it, is a :class:`Damage` naming the file and, where there is one,
the line. A resume refuses damage (exit 2, one line listing every damaged file; the folder unchanged) unless the
user accepts the loss (``--accept-damaged``): each damaged file is then kept beside its replacement as
``NAME.damaged-<time>`` (:func:`keep_aside`), and the run goes on from what could be read:

* ``config.toml``: the checkpoint's own config (every checkpoint holds the run's resolved config);
* ``data.json``: the run is pinned anew to the data it reads now;
* ``metrics.jsonl``: its readable records up to the checkpoint's step;
* a checkpoint's manifest: the checkpoint is loaded unverified (a damaged checkpoint file is never accepted:
  resume from the previous one, ``--branch``).

Two endings are not damage: a last line of ``metrics.jsonl`` cut short without its newline (a run killed in the
middle of writing it; its step is past every checkpoint, so the resume computes it again), and, for a run
stopped before its first checkpoint (which starts over from step 0), a missing ``data.json`` or
``metrics.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from bubblefree.config import RENAMED, config_from_dict
from bubblefree.errors import UserError
from bubblefree.train.checkpoint import config_digest, latest_checkpoint, manifest_path
from bubblefree.train.metrics import METRICS_FILE
from bubblefree.train.resume import CONFIG_FILE, DATA_FILE

__all__ = ["ACCEPT_FLAG", "Damage", "RunFiles", "accept_damage", "keep_aside", "read_config", "read_manifest",
           "read_run_files", "refusal"]

ACCEPT_FLAG = "--accept-damaged"
"""The command line's word for accepting the loss of damaged files (``bubblefree train --resume RUN``)."""
DATA_KEYS = {"source": str, "sha256": str, "train_tokens": int, "val_tokens": int}
"""What a data record holds (``resume.check_data`` compares each with the data read now)."""
_ORDER = (CONFIG_FILE, DATA_FILE, METRICS_FILE)
"""The order damage is listed in (a manifest last)."""


@dataclass(frozen=True)
class Damage:
    """``path`` ``problem``, e.g. ``runs/a/metrics.jsonl`` ``line 7 is not JSON (Expecting value at column 1)``."""

    path: Path
    problem: str

    def __str__(self) -> str:
        return f"{self.path} {self.problem}"


@dataclass
class RunFiles:
    """What a resume read of its run folder: the checkpoint it continues from, the data record, the readable
    metrics records, and the damage found (empty, or accepted)."""

    checkpoint: Path | None
    data_record: dict[str, Any] | None
    metrics: list[tuple[int, str]] = field(default_factory=list)
    """``(step, line)`` of every readable record of ``metrics.jsonl``, the line as written (newline included)."""
    damages: list[Damage] = field(default_factory=list)
    manifest_ok: bool = True
    """False: the checkpoint's manifest is missing or damaged, and the checkpoint is loaded unverified."""


def refusal(damages: list[Damage]) -> UserError:
    """The one-line refusal of a resume that found ``damages``."""
    listed = "; ".join(map(str, damages))
    them = "it" if len(damages) == 1 else "them"
    return UserError(f"Invalid --resume: {listed}; nothing was changed: repair or restore {them}, or resume with "
                     f"{ACCEPT_FLAG} to go on without what {them} lost (each damaged file is kept beside its "
                     f"replacement as NAME.damaged-<time>)")


def read_run_files(out_dir: Path, resume: bool | str | Path, *, accept_damaged: bool) -> RunFiles:
    """Read ``out_dir``'s files for a resume from its newest checkpoint (``resume`` True) or the one ``resume``
    names; raise :func:`refusal` for damage unless ``accept_damaged``. Writes nothing."""
    checkpoint = latest_checkpoint(out_dir) if resume is True else Path(resume)
    found = RunFiles(checkpoint, None)
    manifest = None
    if checkpoint is not None and checkpoint.is_file():  # a missing checkpoint file is load_checkpoint's refusal
        manifest, damage = read_manifest(checkpoint)
        found.manifest_ok = damage is None
        found.damages += [damage] if damage else []
    config, damage = read_config(out_dir / CONFIG_FILE, reference=(manifest or {}).get("config"))
    found.damages += [damage] if damage else []
    record, damage = _read_data_record(out_dir / DATA_FILE, required=checkpoint is not None)
    found.data_record = record
    found.damages += [damage] if damage else []
    found.metrics, damage = _read_metrics(out_dir / METRICS_FILE, required=checkpoint is not None,
                                          recorded=(manifest or {}).get("metrics"), checkpoint=checkpoint)
    found.damages += [damage] if damage else []
    found.damages.sort(key=lambda d: _ORDER.index(d.path.name) if d.path.name in _ORDER else len(_ORDER))
    if found.damages and not accept_damaged:
        raise refusal(found.damages)
    return found


def keep_aside(damage: Damage) -> Path | None:
    """Rename the damaged file to ``NAME.damaged-<time>`` beside it (never over another file); return the new
    path, or None when there is no file (a missing one)."""
    if not damage.path.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = damage.path.with_name(f"{damage.path.name}.damaged-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = damage.path.with_name(f"{damage.path.name}.damaged-{stamp}-{n}")
    damage.path.rename(aside)
    return aside


def accept_damage(files: RunFiles, *, kept: int, step: int) -> list[str]:
    """Keep each damaged file of an accepted resume aside (:func:`keep_aside`), before anything replaces it; one
    line for each, saying where it is and what replaces it (``kept`` readable metrics records up to ``step``)."""
    lines = []
    for damage in files.damages:
        aside = keep_aside(damage)
        instead = {CONFIG_FILE: "the new one holds the checkpoint's config",
                   DATA_FILE: "the run is pinned anew to the data it reads now",
                   METRICS_FILE: f"the new one holds its {kept} readable records up to step {step}"}.get(
            damage.path.name, f"{files.checkpoint.name if files.checkpoint else 'the checkpoint'} was loaded "
                              f"unverified")
        lines.append(f"{damage}: {f'kept as {aside.name}' if aside else 'nothing to keep'}; {instead}")
    return lines


# ----------------------------------------------------------------------------------------------- each file

def read_config(path: Path, *, reference: dict[str, Any] | None = None) -> tuple[dict[str, Any] | None,
                                                                              Damage | None]:
    """``config.toml`` as ``{section: {key: value}}`` if it reads as a config holding every key of
    ``reference`` (the config a checkpoint's manifest records: one written by the same run), else its damage.
    Keys beyond the reference are no damage: a later bubblefree may have added keys since the checkpoint."""
    raw, damage = _read_text(path, required=True)
    if damage is not None or raw is None:
        return None, damage
    try:
        data = tomllib.loads(raw)
    except tomllib.TOMLDecodeError as e:  # its message ends "(at line N, column M)"
        where = re.search(r"(.*) \(at line (\d+), column (\d+)\)$", str(e))
        return None, Damage(path, f"line {where.group(2)} is not TOML ({where.group(1)} at column {where.group(3)})"
                            if where else f"is not TOML ({e})")
    try:
        config_from_dict(data, origin=str(path))
    except UserError as e:
        key = re.search(r"Invalid [^:]*?([a-z_]+\.[a-z_]+)", str(e))
        line = _line_of_key(raw, key.group(1)) if key else None
        return None, Damage(path, f"{f'line {line} ' if line else ''}is not a valid config ({e})")
    if isinstance(reference, dict):
        def keys(config: dict[str, Any]) -> set[str]:  # by their current names (a key renamed since is no loss)
            return {RENAMED.get(f"{s}.{k}", f"{s}.{k}") for s, table in config.items() if isinstance(table, dict)
                    for k in table}

        missing = sorted(keys(reference) - keys(data))
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            return None, Damage(path, f"lacks {', '.join(missing[:3])}{more}, which the checkpoint's config holds "
                                      f"(cut short, or edited)")
    return data, None


def _read_data_record(path: Path, *, required: bool) -> tuple[dict[str, Any] | None, Damage | None]:
    raw, damage = _read_text(path, required=required)
    if raw is None:
        return None, damage
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, Damage(path, f"line {e.lineno} is not JSON ({e.msg} at column {e.colno})")
    if not isinstance(record, dict):
        return None, Damage(path, f"is not a data record: it holds {_kind(record)}")
    for key, kind in DATA_KEYS.items():
        if isinstance(record.get(key), bool) or not isinstance(record.get(key), kind):
            return None, Damage(path, f"is not a data record: {key} is {_kind(record.get(key))}, not {kind.__name__}")
    return record, None


def read_manifest(checkpoint: Path) -> tuple[dict[str, Any] | None, Damage | None]:
    """The manifest of ``checkpoint`` (``step_N.json``) if it reads as one, else its damage (missing included)."""
    path = manifest_path(checkpoint)
    raw, damage = _read_text(path, required=True)
    if raw is None:
        why = f", so {checkpoint.name} cannot be verified" if damage and damage.problem == "is missing" else ""
        return None, Damage(path, damage.problem + why) if damage else None
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, Damage(path, f"line {e.lineno} is not JSON ({e.msg} at column {e.colno})")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("bytes"), int) \
            or not isinstance(manifest.get("sha256"), str):
        return None, Damage(path, f"is not the manifest of {checkpoint.name} (it needs bytes and sha256)")
    if "config" in manifest and config_digest(manifest["config"]) != manifest.get("config_sha256"):
        return None, Damage(path, "was changed: its config does not match its config_sha256")
    return manifest, None


def _read_metrics(path: Path, *, required: bool, recorded: dict[str, Any] | None,
                  checkpoint: Path | None) -> tuple[list[tuple[int, str]], Damage | None]:
    """Every readable record, and the damage: the first line that is not a record (with how many more are
    not), or bytes that differ from those the checkpoint's manifest recorded (``{"bytes", "sha256"}`` of the
    file when the checkpoint was written: lines cut off, or changed)."""
    if not path.is_file():
        return [], Damage(path, "is missing") if required else None
    raw = path.read_bytes()
    pieces = raw.split(b"\n")
    records: list[tuple[int, str]] = []
    bad: list[str] = []
    for number, piece in enumerate(pieces, start=1):
        if number == len(pieces):
            break  # after the last newline: empty, or a line a killed run cut short (its step comes again)
        step, problem = _record(piece, records[-1][0] if records else 0)
        if problem:
            bad.append(f"line {number} {problem}")
        else:
            records.append((step, piece.decode() + "\n"))
    if bad:
        more = f" (and {len(bad) - 1} more line{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
        return records, Damage(path, bad[0] + more)
    if isinstance(recorded, dict) and isinstance(recorded.get("bytes"), int) and checkpoint is not None:
        size = recorded["bytes"]
        if len(raw) < size:
            return records, Damage(path, f"is {len(raw)} bytes, shorter than the {size} it had when "
                                         f"{checkpoint.name} was written: lines are missing")
        if hashlib.sha256(raw[:size]).hexdigest() != recorded.get("sha256"):
            return records, Damage(path, f"was changed: its first {size} bytes differ from those it had when "
                                         f"{checkpoint.name} was written")
    return records, None


def _record(piece: bytes, previous: int) -> tuple[int, str | None]:
    """``(step, None)`` for a line of metrics.jsonl, or ``(0, what is wrong with it)``."""
    try:
        text = piece.decode()
    except UnicodeDecodeError as e:
        return 0, f"is not UTF-8 (byte 0x{piece[e.start]:02x} at column {e.start + 1})"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return 0, f"is not JSON ({e.msg} at column {e.colno})"
    if not isinstance(record, dict):
        return 0, f"is not a record: it holds {_kind(record)}"
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        return 0, f"has no step (a positive integer): {_kind(step)}"
    if step <= previous:
        return 0, f"has step {step} after step {previous} (steps only grow)"
    return step, None


def _read_text(path: Path, *, required: bool) -> tuple[str | None, Damage | None]:
    if not path.is_file():
        return None, Damage(path, "is missing") if required else None
    raw = path.read_bytes()
    try:
        return raw.decode(), None
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        return None, Damage(path, f"line {line} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {column})")


def _line_of_key(text: str, dotted: str) -> int | None:
    """The line of ``key = ...`` inside ``[section]`` of a TOML text, or None."""
    section, key = dotted.split(".", 1)
    current = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("["):
            current = stripped.strip("[] ")
        elif current == section and re.match(rf"{re.escape(key)}\s*=", stripped):
            return number
    return None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), f"the number {value!r}" if isinstance(value, (int, float)) else type(value).__name__)
