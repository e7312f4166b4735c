"""Optimizers whose update can be computed before it is applied (see :mod:`bubblefree.optim.base`)."""

from bubblefree.optim.adamw import AdamW
from bubblefree.optim.adan import Adan
from bubblefree.optim.base import UpdateOptimizer, apply_updates
from bubblefree.optim.lion import Lion
from bubblefree.optim.mars import MARS
from bubblefree.optim.muon import Muon
from bubblefree.optim.nadamw import NAdamW
from bubblefree.optim.registry import OPTIMIZERS, OptimizerSpec, build_optimizer, resolve_defaults
from bubblefree.optim.schedule import clip_stage_grads, lr_scale, set_lr_scale
from bubblefree.optim.soap import SOAP

__all__ = [
    "MARS",
    "OPTIMIZERS",
    "AdamW",
    "Adan",
    "Lion",
    "Muon",
    "NAdamW",
    "OptimizerSpec",
    "SOAP",
    "UpdateOptimizer",
    "apply_updates",
    "build_optimizer",
    "clip_stage_grads",
    "lr_scale",
    "resolve_defaults",
    "set_lr_scale",
]
