"""Training: typed run configuration, presets, the loop, the single-process executor, checkpoints, metrics."""

from bubblefree.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from bubblefree.config import (Config, DataConfig, DelayConfig, LogConfig, ModelConfig, OptimConfig,
                               PipelineConfig, TrainConfig, dump_toml, validate)
from bubblefree.train.executor import Executor, StepStats
from bubblefree.train.loop import train
from bubblefree.train.presets import PRESETS, get_preset, load_config

__all__ = [
    "PRESETS",
    "Config",
    "DataConfig",
    "DelayConfig",
    "Executor",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "StepStats",
    "TrainConfig",
    "dump_toml",
    "get_preset",
    "latest_checkpoint",
    "load_checkpoint",
    "load_config",
    "save_checkpoint",
    "train",
    "validate",
]
