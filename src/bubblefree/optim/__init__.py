"""Optimizers whose update can be computed before it is applied (see :mod:`bubblefree.optim.base`)."""

from bubblefree.optim.base import UpdateOptimizer, apply_updates
from bubblefree.optim.schedule import clip_stage_grads, lr_scale, set_lr_scale

__all__ = ["UpdateOptimizer", "apply_updates", "clip_stage_grads", "lr_scale", "set_lr_scale"]
