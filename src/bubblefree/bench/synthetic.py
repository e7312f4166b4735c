"""Fixed-cost synthetic pipeline stages: every forward and every backward takes a set time.

They run through the same runtime as the real model (:class:`~bubblefree.distributed.DistributedExecutor`:
stock ``Schedule1F1B`` / ``ScheduleGPipe``, our persistent 2BW loop), so a benchmark of them measures the
runtime's scheduling, transfers and bookkeeping, with the compute replaced by ``time.sleep``. Sleeping
releases the CPU, so a pipeline of 8 stages fits on 2 cores and its timeline is the schedule's, which the
schedule simulator (:func:`bubblefree.schedules.timeline.simulate`) predicts from the same forward and
backward costs.

A stage is ``h -> h * w`` on a ``[b, T, V]`` tensor (``w`` of shape ``[V]``, one tiny trainable weight, so
the optimizer, the weight versions and the gradient transfers are all exercised). The first stage turns
the int64 token ids into ``[b, T, V]`` floats; the last stage's output is read as logits over ``V``
classes, so the executor's cross-entropy loss applies unchanged. Every operation also runs on ``meta``
tensors, which the stock schedules' shape inference uses.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["SyntheticModel", "SyntheticStage", "synthetic_data"]


class _Sleep(torch.autograd.Function):
    """``y = h * w``, whose forward sleeps ``t_forward`` seconds and whose backward sleeps ``t_backward``."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, t_forward: float, t_backward: float) -> Tensor:
        if h.device.type != "meta":  # shape inference is not compute
            time.sleep(t_forward)
        ctx.save_for_backward(h, w)
        ctx.t_backward = t_backward
        return h * w

    @staticmethod
    def backward(ctx, grad: Tensor):
        time.sleep(ctx.t_backward)
        h, w = ctx.saved_tensors
        grad_h = grad * w if ctx.needs_input_grad[0] else None
        grad_w = (grad * h).reshape(-1, w.numel()).sum(0) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None


class SyntheticStage(nn.Module):
    """One stage of fixed cost: forward ``t_forward`` s, backward ``t_backward`` s (module docstring)."""

    def __init__(self, *, first: bool, vocab: int, t_forward: float, t_backward: float):
        super().__init__()
        for name, value in (("t_forward", t_forward), ("t_backward", t_backward)):
            if not value >= 0:
                raise ValueError(f"Invalid {name}: {value} (must be >= 0 seconds)")
        if vocab < 2:
            raise ValueError(f"Invalid vocab: {vocab} (must be >= 2)")
        self.first, self.vocab = first, vocab
        self.t_forward, self.t_backward = t_forward, t_backward
        self.weight = nn.Parameter(torch.ones(vocab))

    def forward(self, h: Tensor) -> Tensor:
        if self.first:  # token ids -> [b, T, V]; arithmetic only, so it also runs on meta tensors
            h = h.to(torch.float32).unsqueeze(-1).expand(*h.shape, self.vocab) / self.vocab
        return _Sleep.apply(h, self.weight, self.t_forward, self.t_backward)


class SyntheticModel(nn.Module):
    """``P`` synthetic stages; :meth:`stage` is what the executor runs instead of a split Transformer."""

    def __init__(self, n_stages: int, *, vocab: int = 8, t_forward: float, t_backward: float):
        super().__init__()
        if n_stages < 1:
            raise ValueError(f"Invalid n_stages: {n_stages} (must be >= 1)")
        self.vocab = vocab
        self.stages = nn.ModuleList(SyntheticStage(first=s == 0, vocab=vocab, t_forward=t_forward,
                                                   t_backward=t_backward) for s in range(n_stages))

    def stage(self, index: int) -> SyntheticStage:
        return self.stages[index]

    def set_aux_loss_scale(self, scale: float) -> None:
        """No balancing loss here (the executor sets the MoE one on every model)."""


def synthetic_data(vocab: int = 8, *, seed: int = 0, tokens: int = 4096) -> SimpleNamespace:
    """Random token streams below ``vocab``, shaped like :class:`bubblefree.data.TokenData` for the executor."""
    rng = np.random.default_rng(seed)
    return SimpleNamespace(train=rng.integers(0, vocab, tokens).astype(np.uint16),
                           val=rng.integers(0, vocab, tokens // 4).astype(np.uint16), vocab_size=vocab)
