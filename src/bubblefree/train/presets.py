"""Named run presets: each is a function returning a fully specified :class:`Config`.

``demo`` is the default run (bare ``bubblefree train``): the paper's recipe (arXiv 2606.30634) of Muon on
a PipeDream-2BW pipeline (delay 1 on every stage) with Error Feedback, in the single-process simulation,
on the embedded corpus: llama-5m (3.3M parameters at the 4096 BPE vocabulary), sequence 128, batch 16,
300 steps (docs/training.md gives its run time). The other presets change one thing each so runs compare
cleanly.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bubblefree.config import Config, apply_overrides, config_from_dict, parse_override, read_toml, validate
from bubblefree.errors import UserError
from bubblefree.train.checkpoint import CHECKPOINT_DIR, latest_checkpoint
from bubblefree.train.runfiles import read_config, read_manifest, refusal

__all__ = ["PRESETS", "async_baseline", "demo", "get_preset", "load_config", "pipedream", "run_dir", "smoke",
           "sync_baseline", "train_config"]


def demo() -> Config:
    """The paper's recipe at CPU scale: Muon + 2BW + Error Feedback, simulation runtime (the defaults)."""
    return Config()


def smoke() -> Config:
    """A ~1M-parameter model for 40 steps on the byte tokenizer: exercises every part in well under a minute.

    The byte tokenizer needs no training, so a first run on a fresh machine is as fast as a cached one; one
    thread is fastest for a model this small (and robust on a busy machine).
    """
    return apply_overrides(demo(), {
        "model.preset": "llama-1m", "data.tokenizer": "byte",
        "train.steps": 40, "train.batch_size": 8, "train.seq_len": 64,
        "train.eval_every": 20, "train.eval_batches": 4, "train.log_every": 5, "train.ckpt_every": 20,
        "train.threads": 1,
    })


def sync_baseline() -> Config:
    """``demo`` without delay: the synchronous reference the asynchronous runs are measured against."""
    return apply_overrides(demo(), {"pipeline.schedule": "sync", "delay.correction": "none"})


def async_baseline() -> Config:
    """``demo`` without the correction: plain PipeDream-2BW (delay 1), to measure what Error Feedback recovers."""
    return apply_overrides(demo(), {"delay.correction": "none"})


def pipedream() -> Config:
    """Original PipeDream on 4 stages (delay 3, 2, 1, 0 from first to last stage) with Error Feedback."""
    return apply_overrides(demo(), {"pipeline.schedule": "pipedream", "pipeline.stages": 4,
                                    "pipeline.microbatches": 4})


PRESETS: dict[str, Callable[[], Config]] = {
    "demo": demo,
    "smoke": smoke,
    "sync-baseline": sync_baseline,
    "async-baseline": async_baseline,
    "pipedream": pipedream,
}


def get_preset(name: str) -> Config:
    """The preset's Config (a fresh copy), or a UserError listing the presets and the closest name."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"Invalid preset: {name!r}{hint}; presets: {', '.join(PRESETS)}")
    config = PRESETS[name]()
    assert isinstance(config, Config) and dataclasses.is_dataclass(config)
    return config


def load_config(preset: str | None = None, toml_path: str | Path | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Resolve a run's configuration with precedence preset < TOML file < ``--set`` overrides, then validate.

    ``preset=None`` is the default run (``demo``, the paper's recipe). ``overrides`` are ``section.key=value``.
    """
    config = get_preset(preset or "demo")
    if toml_path is not None:
        config = config_from_dict(read_toml(toml_path), base=config, origin=f"config file {toml_path}")
    parsed: dict[str, Any] = {}
    for text in overrides:
        key, value = parse_override(config, text)
        parsed[key] = value
    return validate(apply_overrides(config, parsed))


def train_config(preset: str | None, config_file: str | None, overrides: list[str], resume: str | None, *,
                 accept_damaged: bool = False) -> Config:
    """The Config of a ``train`` command line: preset < ``--config`` < ``--set``, or with ``resume`` the run's
    own config.toml < ``--set`` (a preset or config file is refused then). Shared by ``bubblefree train`` and
    every rank under torchrun (``python -m bubblefree.distributed``).

    The run's config.toml is read strictly (``train.runfiles``): missing or damaged, it is refused unless
    ``accept_damaged``, and then the config is the one the checkpoint to resume from holds. A folder with
    neither config.toml nor checkpoints holds no run."""
    if resume is None:
        return load_config(preset, config_file, overrides)
    if preset is not None or config_file is not None:
        raise UserError("Invalid --resume: the run's own config.toml is used; only --set may change "
                        "(for example) train.steps")
    folder = run_dir(resume)
    saved = folder / "config.toml"
    checkpoint = Path(resume) if Path(resume).suffix == ".pt" else latest_checkpoint(folder)
    if not saved.is_file() and checkpoint is None:
        raise UserError(f"Invalid --resume: {resume} holds no run (no config.toml, no checkpoint)")
    manifest = read_manifest(checkpoint)[0] if checkpoint is not None and checkpoint.is_file() else None
    data, damage = read_config(saved, reference=(manifest or {}).get("config"))
    if damage is not None and not accept_damaged:
        raise refusal([damage])
    if damage is not None:
        if checkpoint is None:
            raise UserError(f"Invalid --resume: {damage}, and no checkpoint holds the run's config: start the run "
                            f"anew")
        data = (manifest or {}).get("config")
        try:  # only its config: the setup verifies the checkpoint (its manifest, its state) before it is used
            data = data if isinstance(data, dict) else torch.load(checkpoint, map_location="cpu",
                                                                 weights_only=True)["config"]
        except Exception:  # torch reports a torn or foreign file with several exception types
            raise UserError(f"Invalid --resume: {damage}, and {checkpoint} cannot be read for the run's config: "
                            f"start the run anew") from None
    config = config_from_dict(data, origin=str(saved))
    return validate(apply_overrides(config, dict(parse_override(config, text) for text in overrides)))


def run_dir(resume: str) -> Path:
    """The run folder of ``--resume``: the folder itself, or the run holding the checkpoint file it names."""
    path = Path(resume)
    if path.suffix == ".pt":
        if path.parent.name != CHECKPOINT_DIR:
            raise UserError(f"Invalid --resume: {resume} (a checkpoint file must be RUN/{CHECKPOINT_DIR}/step_N.pt)")
        return path.parent.parent
    return path
