"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675) as an update rule.

With gradient ``g``, interpolation ``beta1`` and memory ``beta2``::

    c_t = beta1 m_{t-1} + (1 - beta1) g            (computed as a lerp, as google/automl and pytorch-optimizer)
    u_t = lr wd x_t + lr sign(c_t)
    m_t = beta2 m_{t-1} + (1 - beta2) g            (exp_avg)

The reference (google/automl ``lion_pytorch.py``, and pytorch-optimizer's ``Lion``, bit-identical to it) first
decays ``x <- (1 - lr wd) x`` and then subtracts ``lr sign(c_t)``; the sign does not read ``x``, so ``x - u_t``
is the same step up to one rounding of the decay term.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bubblefree.optim.base import UpdateOptimizer, check_betas, check_nonneg, use_foreach

__all__ = ["Lion", "lion_updates"]


def lion_updates(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], *, lr: float, beta1: float,
                 beta2: float, weight_decay: float, foreach: bool = True,
                 out: list[Tensor] | None = None) -> list[Tensor]:
    """Advance ``exp_avgs`` in place and return Lion updates; ``foreach=False`` runs one tensor at a time (the
    reference path, and the faster one on CPU: :func:`~bubblefree.optim.base.use_foreach`).

    The updates are written into ``out`` (buffers shaped like ``params``, e.g. recycled updates) when given,
    else into new tensors. Building ``u_t`` takes five operations (lerp into ``out``, sign, scale, decay,
    momentum lerp) and applying it a sixth; the reference's in-place step takes five (decay, lerp into a
    fresh tensor, sign, momentum lerp, apply): 16 against 13 tensor-sized memory streams.
    """
    lr = float(lr)
    if not params:
        return []
    if out is None:
        out = [torch.empty_like(p, memory_format=torch.preserve_format) for p in params]
    if foreach:
        for u, m, g in zip(out, exp_avgs, grads, strict=True):  # foreach ops have no out=; one kernel each
            torch.lerp(m, g, 1 - beta1, out=u)
        torch._foreach_sign_(out)
        torch._foreach_mul_(out, lr)
        if weight_decay != 0:
            torch._foreach_add_(out, params, alpha=lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)
        return out
    for p, g, m, u in zip(params, grads, exp_avgs, out, strict=True):
        torch.lerp(m, g, 1 - beta1, out=u).sign_().mul_(lr)
        if weight_decay != 0:
            u.add_(p, alpha=lr * weight_decay)
        m.lerp_(g, 1 - beta2)
    return out


class Lion(UpdateOptimizer):
    """Lion whose update ``u_t`` can be computed before it is applied (module docstring for the math).

    Defaults for LLM pretraining (the authors' advice for language models; docs/optimizers.md): betas
    (0.95, 0.98), lr 1e-4 (3-10x below AdamW's 6e-4), weight decay 0.5 (3-10x AdamW's 0.1, keeping
    ``lr * wd`` in AdamW's range). The momentum knob sets ``beta2`` (memory) and ``beta1 = 1 - 2.5 (1 - beta2)``
    (the default pair's ratio of time constants); see :mod:`bubblefree.optim.registry`.

    ``foreach``: True batches each operation over the group, False runs one tensor at a time, None (default)
    picks the faster of the two for the device (:func:`~bubblefree.optim.base.use_foreach`). Same results.

    Differences from the reference: none in the math; no cautious/AdaNorm/gradient-centralisation options.
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.95, 0.98), weight_decay: float = 0.5,
                 *, foreach: bool | None = None) -> None:
        check_nonneg("lr", lr)
        if len(betas) != 2:
            raise ValueError(f"Invalid betas: {betas} (expected two coefficients)")
        check_betas("betas", betas)
        check_nonneg("weight_decay", weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=foreach))

    def _group_updates(self, group, params, grads):
        for p in params:
            if "exp_avg" not in self.state[p]:
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # not used by the math; kept so every optimizer reports its step count
        torch._foreach_add_([self.state[p]["step"] for p in params], 1)
        beta1, beta2 = group["betas"]
        return lion_updates(params, grads, [self.state[p]["exp_avg"] for p in params], lr=group["lr"], beta1=beta1,
                            beta2=beta2, weight_decay=group["weight_decay"],
                            foreach=use_foreach(group["foreach"], params), out=self._out_like(params))
