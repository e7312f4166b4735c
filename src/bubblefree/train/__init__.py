"""Training: presets, the loop, the single-process executor, checkpoints, metrics (the typed run configuration
is :mod:`bubblefree.config`)."""

from bubblefree.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from bubblefree.train.executor import Executor, StepStats
from bubblefree.train.loop import train
from bubblefree.train.presets import PRESETS, get_preset, load_config

__all__ = [
    "PRESETS",
    "Executor",
    "StepStats",
    "get_preset",
    "latest_checkpoint",
    "load_checkpoint",
    "load_config",
    "save_checkpoint",
    "train",
]
