"""Checkpoints: everything needed to continue a run bit for bit, written atomically.

A checkpoint is one file ``RUN/checkpoints/step_NNNNNNNN.pt`` holding the step count, the resolved config,
the executor's state (weights, optimizer state, delay stash and Error Feedback buffers) and the RNG states
(torch, CUDA, numpy, python). Batches are a pure function of ``(seed, step, microbatch)``, so the step count
is the data position. The file is written to a temporary name in the same folder, flushed and fsynced, then
renamed over the final name, and the folder is fsynced: a crash leaves either the old set of checkpoints or
the new one, never a torn file under a checkpoint's name. Only the newest ``keep`` are kept.
Files are loaded with ``torch.load(weights_only=True)``: tensors and plain containers only, no pickled code.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bubblefree.errors import UserError

__all__ = ["CHECKPOINT_DIR", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "restore_rng",
           "rng_state", "save_checkpoint"]

CHECKPOINT_DIR = "checkpoints"
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


def save_checkpoint(run_dir: str | Path, *, step: int, executor_state: dict[str, Any],
                    config: dict[str, Any], keep: int = 2) -> Path:
    """Atomically write the checkpoint of ``step`` and delete all but the newest ``keep``; return its path."""
    if keep < 1:
        raise ValueError(f"Invalid keep: {keep} (must be >= 1)")
    folder = Path(run_dir) / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:08d}.pt"
    tmp = folder / f".{path.name}.tmp-{os.getpid()}"
    payload = {"format": 1, "step": step, "config": config, "executor": executor_state, "rng": rng_state()}
    try:
        with tmp.open("wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(folder)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        old.unlink()
    return path


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`; a missing or damaged file is a UserError."""
    path = Path(path)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"Invalid checkpoint: {path} does not exist") from None
    except Exception as e:  # torch reports a torn or foreign file with several exception types
        raise UserError(f"Invalid checkpoint: {path} cannot be read ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'damaged'})") from None
    if not isinstance(payload, dict) or payload.get("format") != 1:
        raise UserError(f"Invalid checkpoint: {path} is not a bubblefree checkpoint")
    return payload
