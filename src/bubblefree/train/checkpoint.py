"""Checkpoints: everything needed to continue a run bit for bit, written atomically.

A checkpoint is one file ``RUN/checkpoints/step_NNNNNNNN.pt`` holding the step count, the resolved config,
the executor's state (weights, optimizer state, delay stash and Error Feedback buffers), the loop's own
counters and the RNG states (torch, CUDA, numpy, python). Batches are a pure function of ``(seed, step,
microbatch)``, so the step count is the data position. Beside it, ``step_NNNNNNNN.json`` is its manifest: the
step, the config and its sha256 (:func:`config_digest`), the bubblefree and torch versions, the size and sha256
of the checkpoint file, and those of the run's ``metrics.jsonl`` as it was then (its lines up to the step).
A resume checks the run's ``config.toml`` and ``metrics.jsonl`` against them (``train.runfiles``) without
loading the checkpoint.

Both files are written to temporary names in the same folder, flushed and fsynced, then renamed (manifest
first, so a checkpoint file never appears without its manifest), and the folder is fsynced: a crash leaves
either the old set of checkpoints or the new one, never a torn file under a checkpoint's name. Only the newest
``keep`` are kept. :func:`load_checkpoint` checks the file against its manifest and refuses a truncated or
altered one, naming it and the previous checkpoint to resume from instead. A checkpoint without a manifest
(written before manifests existed, or copied without one) is loaded unverified, with a warning.
Files are loaded with ``torch.load(weights_only=True)``: tensors and plain containers only, no pickled code.

**Layout-free state.** The executor's state (format 2) does not depend on how the run was laid out: ``{"layout":
{"runtime", "stages", "replicas"} (what wrote it, for messages), "model": the whole model's weights by name,
"optimizer": the DelayedOptimizer state by parameter name}`` (``delay.name_state``: the inner optimizer's
per-parameter state and param-group hyperparameters, the stashed weight versions, Error Feedback's ring, the
other corrections' buffers, the step and phase). The simulation writes it directly; the distributed runtime
gathers and merges its stages' (``distributed.gather``). So a checkpoint resumes at another number of stages,
of data-parallel replicas, or in the other runtime: each stage picks its parameters by name. What cannot move
is refused before any step runs: a parameter whose delay the new layout changes while weight versions are in
flight (``delay.relayout_refusal``; PipeDream and WPipe at another ``P``). Checkpoints of format 1 (written
before, keyed by position in one layout's optimizers) are converted on load by :func:`layout_free`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bubblefree import __version__
from bubblefree.errors import UserError
from bubblefree.train.metrics import METRICS_FILE

__all__ = ["CHECKPOINT_DIR", "FORMAT", "config_digest", "last_good_checkpoint", "latest_checkpoint", "layout_free",
           "list_checkpoints", "load_checkpoint", "manifest_path", "newer_checkpoints", "restore_rng", "resume_from",
           "rng_state", "save_checkpoint", "set_aside", "verify_checkpoint"]

CHECKPOINT_DIR = "checkpoints"
FORMAT = 2
"""Format of the checkpoint file: 2 holds the layout-free executor state (module docstring), 1 the state of the
layout that wrote it (still loaded: :func:`layout_free` converts it)."""
_NAME = re.compile(r"^step_(\d{8})\.pt$")


def rng_state() -> dict[str, Any]:
    """The global RNG states as tensors and plain containers (so ``weights_only`` loading accepts them)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "python": random.getstate(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of a config in its ``{section: {key: value}}`` form (key order does not matter)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def manifest_path(path: str | Path) -> Path:
    """The manifest beside checkpoint ``path``: ``step_NNNNNNNN.json``."""
    return Path(path).with_suffix(".json")


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``[(step, path)]`` of the run's checkpoints, oldest first (temporary files are ignored)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, write) -> None:
    try:
        with path.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full disk shows at a write, a flush or the close, without the file's name
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(run_dir: str | Path, *, step: int, executor_state: dict[str, Any],
                    config: dict[str, Any], keep: int = 2, loop_state: dict[str, Any] | None = None) -> Path:
    """Atomically write the checkpoint of ``step`` and its manifest, delete all but the newest ``keep``
    (and temporary files a killed process left behind); return the checkpoint's path."""
    if keep < 1:
        raise ValueError(f"Invalid keep: {keep} (must be >= 1)")
    folder = Path(run_dir) / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:08d}.pt"
    tmp, tmp_manifest = (folder / f".{p.name}.tmp-{os.getpid()}" for p in (path, manifest_path(path)))
    payload = {"format": FORMAT, "step": step, "config": config, "executor": executor_state, "rng": rng_state(),
               "loop": loop_state or {}}
    try:
        _write_synced(tmp, lambda f: _save_torch(payload, f, tmp))
        manifest = {"step": step, "file": path.name, "bytes": tmp.stat().st_size, "sha256": _sha256(tmp),
                    "config_sha256": config_digest(config), "config": config, "bubblefree": __version__,
                    "torch": torch.__version__}
        metrics = Path(run_dir) / METRICS_FILE
        if metrics.is_file():  # its lines up to this step, which a resume from here keeps (train.runfiles)
            manifest["metrics"] = {"bytes": metrics.stat().st_size, "sha256": _sha256(metrics)}
        _write_synced(tmp_manifest, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        os.replace(tmp_manifest, manifest_path(path))
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, tmp_manifest):
            with contextlib.suppress(OSError):  # a read-only folder refuses this too: the first error is the news
                leftover.unlink(missing_ok=True)
    _fsync_dir(folder)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        old.unlink()
        manifest_path(old).unlink(missing_ok=True)
    kept = {manifest_path(p).name for _, p in list_checkpoints(run_dir)}
    for stale in folder.iterdir():  # a killed writer's temporary files; a manifest whose checkpoint is gone
        if ".tmp-" in stale.name or (stale.suffix == ".json" and stale.name not in kept):
            stale.unlink(missing_ok=True)
    return path


def _save_torch(payload: dict[str, Any], f, name: Path) -> None:
    """``torch.save``, with a failed write reported as the OSError it is: torch raises a RuntimeError of its
    own ("unexpected pos ...") with the ENOSPC only in its context, and without the file's name."""
    try:
        torch.save(payload, f)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(name)) from None
    except RuntimeError as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror, str(name)) from None
        raise


def last_good_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint a manifest vouches for (its size matches; the sha256 is checked on load), or
    None: a checkpoint without a manifest may be anything, so it is never called good."""
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            manifest = json.loads(manifest_path(path).read_text())
            if path.stat().st_size == manifest["bytes"]:
                return path
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def newer_checkpoints(run_dir: str | Path, step: int) -> list[Path]:
    """The run's checkpoints past ``step``: the lineage a resume from ``step`` would overwrite."""
    return [p for s, p in list_checkpoints(run_dir) if s > step]


def set_aside(run_dir: str | Path, step: int, files: tuple[str, ...]) -> Path:
    """Move the run's checkpoints past ``step`` (with their manifests) to ``RUN/superseded/<time>-after-step-N``
    and copy ``files`` of the run folder there (metrics.jsonl, loss.png: the continued run keeps their lines up
    to ``step``). Nothing is deleted; returns the folder."""
    run_dir = Path(run_dir)
    aside = run_dir / "superseded" / f"{time.strftime('%Y%m%d-%H%M%S')}-after-step-{step}"
    (aside / CHECKPOINT_DIR).mkdir(parents=True)
    for name in files:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, aside / name)
    for path in newer_checkpoints(run_dir, step):
        for part in (manifest_path(path), path):
            if part.exists():
                os.replace(part, aside / CHECKPOINT_DIR / part.name)
    _fsync_dir(run_dir / CHECKPOINT_DIR)
    return aside


def resume_from(path: Path) -> str:
    """How ``bubblefree train`` continues from the earlier checkpoint ``path`` (the newer ones moved aside)."""
    return f"resume from the previous one with --resume {shlex.quote(str(path))} --branch"


def _damaged(path: Path, why: str, advice_for=resume_from) -> UserError:
    """The refusal of a damaged checkpoint: names it, why, and what to do with the previous checkpoint
    (``advice_for``: the command at hand's own option; ``bubblefree train`` resumes from it)."""
    older = [p for _, p in list_checkpoints(path.parent.parent) if p.name < path.name]
    advice = advice_for(older[-1]) if older else "no earlier checkpoint of this run is left"
    return UserError(f"Invalid checkpoint: {path} {why}; it is refused ({advice}, or delete {path.name} and "
                     f"its manifest to make the previous one the newest)")


def verify_checkpoint(path: str | Path, *, advice_for=resume_from) -> dict[str, Any] | None:
    """Check ``path`` against its manifest (size and sha256); return the manifest, or None when there is none.

    Raises a UserError naming the file when it is missing, truncated or altered."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"Invalid checkpoint: {path} does not exist")
    try:
        manifest = json.loads(manifest_path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise _damaged(path, f"has an unreadable manifest {manifest_path(path).name} ({e})", advice_for) from None
    if not isinstance(manifest, dict) or not {"bytes", "sha256"} <= set(manifest):
        raise _damaged(path, f"has an unreadable manifest {manifest_path(path).name}", advice_for)
    size = path.stat().st_size
    if size != manifest["bytes"]:
        raise _damaged(path, f"is truncated or altered ({size} bytes, its manifest says {manifest['bytes']})",
                       advice_for)
    if _sha256(path) != manifest["sha256"]:
        raise _damaged(path, "is altered (its sha256 differs from its manifest's)", advice_for)
    return manifest


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu", advice_for=resume_from,
                    verified: bool = False, unverified: bool = False) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` after checking it against its manifest; a missing,
    truncated, altered or foreign file is a UserError naming it and, by ``advice_for(previous checkpoint)``,
    what to do instead. ``verified``: a checkpoint without a manifest is refused too, not loaded unverified.
    ``unverified``: the manifest is not read at all (a resume that accepted it as damaged, train.runfiles)."""
    path = Path(path)
    if unverified and not path.is_file():
        raise UserError(f"Invalid checkpoint: {path} does not exist")
    manifest = None if unverified else verify_checkpoint(path, advice_for=advice_for)
    if manifest is None and verified:
        raise _damaged(path, f"has no manifest ({manifest_path(path).name}), so it cannot be verified", advice_for)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch reports a torn or foreign file with several exception types (OSError, ...)
        why = "has no manifest and " if manifest is None else ""
        raise _damaged(path, f"{why}cannot be read: it is truncated or not a checkpoint "
                             f"({type(e).__name__})", advice_for) from None
    if not isinstance(payload, dict) or payload.get("format") not in (1, FORMAT):
        raise UserError(f"Invalid checkpoint: {path} is not a bubblefree checkpoint")
    if manifest is None:
        why = (f": its manifest {manifest_path(path).name} was accepted as missing or damaged" if unverified else
               f" has no manifest ({manifest_path(path).name})")
        print(f"bubblefree: warning: {path}{why}; loaded it unverified", file=sys.stderr, flush=True)
    elif (manifest.get("bubblefree"), manifest.get("torch")) != (__version__, torch.__version__):
        print(f"bubblefree: warning: {path} was written by bubblefree {manifest.get('bubblefree')} with torch "
              f"{manifest.get('torch')}, this is {__version__} with {torch.__version__}: the resumed steps may "
              f"differ in the last bits from those the original versions would compute", file=sys.stderr, flush=True)
    return payload


def layout_free(ckpt: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """The executor state of ``ckpt`` (what :func:`load_checkpoint` returned) in the layout-free form (module
    docstring), which every executor loads at any layout.

    A format-1 checkpoint holds its optimizer states by position: in the simulation's one optimizer over
    ``model``, or, from the distributed runtime, in each stage's optimizer over ``split_model(model, P)``
    (``{"runtime": "distributed", "stages": [...]}``). The optimizers are rebuilt from the checkpoint's own
    config (without state) only to name those positions, in the order the executors build them."""
    state = ckpt["executor"]
    if ckpt["format"] == FORMAT:
        return state
    from bubblefree.config import config_from_dict
    from bubblefree.delay import merge_named_states, name_state
    from bubblefree.models.split import split_model
    from bubblefree.optim import build_optimizer
    from bubblefree.train.build import optimizer_names

    saved = config_from_dict(ckpt["config"], origin="checkpoint")

    def named(module: torch.nn.Module, delayed: dict[str, Any]) -> dict[str, Any]:
        return name_state(delayed, optimizer_names(module, build_optimizer(module, saved.optim)))

    if state.get("runtime") == "distributed":
        stages = split_model(model, len(state["stages"]))
        return {"layout": {"runtime": "distributed", "stages": len(stages), "replicas": None},
                "model": {name: t for part in state["stages"] for name, t in part["module"].items()},
                "optimizer": merge_named_states([named(m, part["delayed"])
                                                 for m, part in zip(stages, state["stages"])])}
    return {"layout": {"runtime": "sim", "stages": saved.pipeline.stages, "replicas": 1},
            "model": state["model"], "optimizer": named(model, state["optimizer"])}
