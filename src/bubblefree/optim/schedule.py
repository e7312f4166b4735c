"""Learning-rate schedule and gradient clipping shared by the simulation and the distributed runtime."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["clip_stage_grads", "lr_scale", "set_lr_scale"]


def lr_scale(step: int, total_steps: int, *, warmup_frac: float = 0.1, min_lr_frac: float = 0.1) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based): the paper's recipe.

    Linear warmup over ``ceil(warmup_frac * total_steps)`` steps (reaching 1 at the end of warmup), then a
    cosine from 1 down to ``min_lr_frac`` at the last step.
    """
    warmup = math.ceil(warmup_frac * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_lr_frac + (1.0 - min_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr_scale(optimizer: torch.optim.Optimizer, scale: float) -> None:
    """Set every param group's ``lr`` to ``scale`` times its peak (remembered as ``peak_lr`` on first use)."""
    for group in optimizer.param_groups:
        peak = group.setdefault("peak_lr", group["lr"])
        group["lr"] = peak * scale


@torch.no_grad()
def clip_stage_grads(params: Sequence[Tensor], max_norm: float, *, n_stages: int = 1) -> float:
    """Clip the gradients of one pipeline stage to ``max_norm / sqrt(n_stages)``; return their norm before clipping.

    Global-norm clipping across a pipeline needs every stage's norm before any stage may update, a barrier
    an asynchronous pipeline cannot afford. Each stage clips its own gradients instead, to a share of the
    threshold chosen so that if every stage sits at its limit the global norm is exactly ``max_norm``. With
    one stage this is ``torch.nn.utils.clip_grad_norm_``. The simulation applies the same rule per stage.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if max_norm > 0:
        coef = torch.clamp(max_norm / math.sqrt(n_stages) / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
    return float(norm)
