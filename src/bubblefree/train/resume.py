"""Continuing a run: which keys a resume may change, what it refuses (a changed config or data, a finished run,
later checkpoints it would overwrite, a layout the asynchronous state cannot move to), and where a stopped run
can continue from (docs/reliability.md).

A refusal is a :class:`~bubblefree.errors.UserError` raised before anything is written, so every process of a
distributed run refuses alike and no run folder is touched.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

import torch

from bubblefree.config import Config, apply_overrides, config_diff, config_from_dict
from bubblefree.data.tokens import fingerprint, resolved_source
from bubblefree.delay import relayout_refusal
from bubblefree.errors import UserError
from bubblefree.optim import resolve_defaults
from bubblefree.train.build import delays_by_name, resolve_device
from bubblefree.train.checkpoint import (
    CHECKPOINT_DIR,
    last_good_checkpoint,
    latest_checkpoint,
    layout_free,
    load_checkpoint,
    newer_checkpoints,
)
from bubblefree.train.folders import check_ours
from bubblefree.train.metrics import METRICS_FILE

__all__ = ["CONFIG_FILE", "DATA_FILE", "LAYOUT_KEYS", "RESUMABLE_KEYS", "check_data", "check_fresh_out_dir",
           "resolved", "resume_hint", "resume_state"]

# Keys a resumed run may change: they decide what is logged, kept or how long the run is, not the trajectory
# of the steps already taken (a longer ``train.steps`` stretches the cosine over the new length from here on).
RESUMABLE_KEYS = ("train.steps", "train.eval_every", "train.eval_batches", "train.log_every", "train.ckpt_every",
                  "train.ckpt_keep", "train.device", "train.nonfinite", "log.tensorboard", "log.progress")
# Keys of the layout a resumed run may change too: the checkpoint's state is keyed by parameter name and moves
# to the new stages (train.checkpoint), unless a parameter's delay changes while versions are in flight.
LAYOUT_KEYS = ("pipeline.stages", "pipeline.runtime")
CONFIG_FILE = "config.toml"
DATA_FILE = "data.json"
"""The data the run trains on: ``data.source`` resolved to an absolute path and the tokens' fingerprint
(``data.tokens.fingerprint``); a resume on other data is refused (docs/reliability.md, "The data is pinned")."""


def check_fresh_out_dir(out_dir: Path) -> None:
    """Refuse an output folder that already holds a run, or anything else (the user's own files), so nothing
    is overwritten. Fresh: missing, empty, or holding only the error records of a distributed start that
    failed (``errors/``, written by the ranks before the run's first file)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"Invalid output folder: {out_dir} exists and is not a folder")
    held = [name for name in (CONFIG_FILE, METRICS_FILE, CHECKPOINT_DIR) if (out_dir / name).exists()]
    if held:
        raise UserError(f"Invalid output folder: {out_dir} already holds a run ({', '.join(held)}); "
                        f"continue it with --resume {shlex.quote(str(out_dir))} or choose another --out")
    check_ours(out_dir, what="output folder", ours=("errors",))


def resolved(config: Config, vocab_size: int) -> Config:
    """``config`` with every "take the default" value replaced by the value the run uses: the optimizer's
    (``optim.registry.resolve_defaults``, the one place they are applied), ``model.vocab_size = 0`` by the
    tokenizer's ``vocab_size``, ``train.device`` and ``train.dtype = "auto"`` by what auto picks here. It is
    what config.toml and checkpoints record, and it trains to the same losses bit for bit. The Config a
    caller passes is not changed (run ids hash the caller's form)."""
    device = resolve_device(config.train.device).type
    return apply_overrides(dataclasses.replace(config, optim=resolve_defaults(config.optim)), {
        "model.vocab_size": config.model.vocab_size or vocab_size,
        "train.device": device,
        "train.dtype": config.train.dtype if config.train.dtype != "auto" else
        ("bfloat16" if device == "cuda" else "float32"),
    })


def resume_state(config: Config, out_dir: Path, resume: bool | str | Path, model: torch.nn.Module,
                  vocab_size: int, *, branch: bool, data_moved: bool, unverified: bool = False
                  ) -> dict[str, Any] | None:
    """The checkpoint to continue from, its executor state layout-free, after checking that continuing from it
    loses nothing: a changed config (but for RESUMABLE_KEYS and LAYOUT_KEYS), a complete run, a later
    checkpoint it would overwrite, a layout the asynchronous state cannot move to. None for a run stopped
    before its first checkpoint, which starts over at step 0 with its own config. ``unverified``: its manifest
    was accepted as missing or damaged (``train.runfiles``)."""
    path = latest_checkpoint(out_dir) if resume is True else Path(resume)
    if path is None:
        return None
    ckpt = load_checkpoint(path, unverified=unverified)
    saved = config_from_dict(ckpt["config"], origin=f"checkpoint {path}")
    # Compared resolved: a run folder written before config.toml held resolved values resumes too. Moved data
    # may be named anew (its tokens are checked against the run's by check_data).
    may_change = RESUMABLE_KEYS + LAYOUT_KEYS + (("data.source",) if data_moved else ())
    differ = {k: v for k, v in config_diff(resolved(saved, vocab_size), resolved(config, vocab_size)).items()
              if k not in may_change}
    if differ:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in differ.items())
        raise UserError(f"Invalid --resume: the config differs from the checkpoint's in {listed}")
    if ckpt["step"] >= config.train.steps:
        raise UserError(f"Invalid --resume: the run is complete at step {ckpt['step']} of train.steps = "
                        f"{config.train.steps}; extend it with --set train.steps=N")
    newer = newer_checkpoints(out_dir, ckpt["step"])
    if newer and not branch:  # continuing here would overwrite the run's later checkpoints and metrics
        raise UserError(f"Invalid --resume: {out_dir} went on past step {ckpt['step']} (checkpoint "
                        f"{newer[-1].name}); continuing from step {ckpt['step']} would overwrite that; add "
                        f"--branch to continue anyway: the newer checkpoints and a copy of {METRICS_FILE} are "
                        f"moved to {out_dir / 'superseded'} first (nothing is deleted)")
    ckpt["executor"] = layout_free(ckpt, model)
    # Checked here, before the processes of a distributed run meet, so that every one refuses alike.
    why = relayout_refusal(ckpt["executor"]["optimizer"], delays_by_name(model, config))
    if why:  # only the number of stages changes delays here (a changed schedule was refused above)
        before = saved.pipeline.stages
        raise UserError(f"Invalid --resume: the asynchronous state of {config.pipeline.schedule} cannot move from "
                        f"pipeline.stages = {before} to {config.pipeline.stages}: {why}; resume with --set "
                        f"pipeline.stages={before}, or from a checkpoint of a synchronous phase")
    return ckpt


def check_data(config: Config, data: Any, pinned: dict[str, Any] | None, *, data_moved: bool) -> dict[str, Any]:
    """The run's data record (:data:`DATA_FILE`); on resume, refuse data other than the ``pinned`` record's
    (as ``train.runfiles`` read it), saying what differs. Without one (a new run; a run stopped before its first
    checkpoint, or one whose record was accepted as damaged) the run is pinned to the data it reads now."""

    now = {"source": resolved_source(config.data.source), **fingerprint(data)}
    if pinned is None:
        return now
    was = pinned["source"]
    differ = [f"{k.replace('_', ' ')} {pinned.get(k)} -> {now[k]}" for k in ("train_tokens", "val_tokens")
              if pinned.get(k) != now[k]]
    if pinned.get("sha256") != now["sha256"]:
        differ.append(f"sha256 {str(pinned.get('sha256'))[:12]}... -> {now['sha256'][:12]}...")
    where = (f"data.source {config.data.source} is {now['source']}, the run trained on {was}" if was != now["source"]
             else f"{was} changed since the run trained on it")
    if differ:
        raise UserError(f"Invalid --resume: the data differs from the run's: {where} ({', '.join(differ)}); "
                        f"resume where data.source names the run's data")
    if was != now["source"] and not data_moved:
        raise UserError(f"Invalid --resume: {where}; the tokens are the same: continue on them with --data-moved")
    return now


def resume_hint(out_dir: Path) -> str:
    """Where a stopped run can continue from, for its last line: the last good checkpoint (never one without a
    manifest) and the command, or how to start over when it has none yet."""
    good = last_good_checkpoint(out_dir)
    again = f"--resume {shlex.quote(str(out_dir))}"
    if not (out_dir / CONFIG_FILE).is_file():  # stopped before the run's first file: a fresh start is the same
        return "nothing of the run was written yet (run the same command again)"
    if good is None:
        return f"no checkpoint was written yet (start over with {again})"
    newest = latest_checkpoint(out_dir)
    if newest != good:  # the newest has no manifest: resume from the good one, keeping the other aside
        again = f"--resume {shlex.quote(str(good))} --branch"
    return f"the last good checkpoint is {good}; continue with {again}"
