"""Adan (Xie et al., "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep Models",
arXiv 2208.06677) as an update rule, in the official code's convention (sail-sg/Adan).

Betas follow the code, not the paper: code ``beta_i = 1 - paper beta_i``, default (0.98, 0.92, 0.99). With
gradient ``g``, the previous gradient ``g_prev`` (the first difference is 0) and step ``t``::

    d_t = g - g_prev
    m_t = beta1 m + (1 - beta1) g                     (exp_avg)
    n_t = beta2 n + (1 - beta2) d_t                   (exp_avg_diff)
    v_t = beta3 v + (1 - beta3) (g + beta2 d_t)^2     (exp_avg_sq)
    D   = sqrt(v_t) / sqrt(1 - beta3^t) + eps
    s_t = lr / (1 - beta1^t) m_t / D + lr beta2 / (1 - beta2^t) n_t / D

Weight decay is proximal by default (official ``no_prox=False``, pytorch-optimizer ``weight_decouple=False``):
``x_{t+1} = (x_t - s_t) / (1 + lr wd)``, so ``u_t = (s_t + lr wd x_t) / (1 + lr wd)``. With ``prox=False`` it is
decoupled: ``u_t = lr wd x_t + s_t``.

Differences from pytorch-optimizer 4.1.0's ``Adan`` (the test oracle): ``previous_grad`` holds ``g`` (po keeps
``-g``); ``.grad`` is never modified (po's per-tensor path negates it in place); no ``max_grad_norm`` (clipping is
the trainer's job, per stage).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bubblefree.optim.base import (
    UpdateOptimizer,
    check_betas,
    check_nonneg,
    decayed_weights,
    group_by_step,
    use_foreach,
)

__all__ = ["Adan", "adan_updates"]


def adan_updates(params: list[Tensor], grads: list[Tensor], state: dict[str, list[Tensor]], *, step: float, lr: float,
                 betas: tuple[float, float, float], eps: float, weight_decay: float, prox: bool = True,
                 foreach: bool = True, out: list[Tensor] | None = None) -> list[Tensor]:
    """Advance ``state`` (lists ``exp_avg``, ``exp_avg_diff``, ``exp_avg_sq``, ``previous_grad``) in place and
    return Adan updates for step ``step`` (1-based), written into ``out`` (buffers shaped like ``params``)
    when given, else into new tensors. ``foreach=False`` runs one tensor at a time (the reference path, and
    the faster one on CPU: :func:`~bubblefree.optim.base.use_foreach`).

    No other tensor is allocated: ``previous_grad`` is the scratch space, holding ``d_t``, then
    ``g + beta2 d_t``, then ``D``, before it takes ``g`` at the end (as pytorch-optimizer reuses it).
    """
    if not params:
        return []
    lr = float(lr)
    beta1, beta2, beta3 = betas
    c1 = lr / (1 - beta1**step)
    c2 = lr * beta2 / (1 - beta2**step)
    bc3 = math.sqrt(1 - beta3**step)
    m, n, v, prev = state["exp_avg"], state["exp_avg_diff"], state["exp_avg_sq"], state["previous_grad"]
    if out is None:
        out = [torch.empty_like(p, memory_format=torch.preserve_format) for p in params]
    if foreach:  # foreach ops have no out=: the few out-of-place steps loop over tensors, one kernel each
        for g, d in zip(grads, prev, strict=True):
            torch.sub(g, d, out=d)  # prev holds d_t
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_lerp_(n, prev, 1 - beta2)
        torch._foreach_mul_(prev, beta2)
        torch._foreach_add_(prev, grads)  # prev holds z = g + beta2 d_t
        torch._foreach_mul_(v, beta3)
        torch._foreach_addcmul_(v, prev, prev, 1 - beta3)
        for v_, d in zip(v, prev, strict=True):
            torch.sqrt(v_, out=d)  # prev holds D
        torch._foreach_div_(prev, bc3)
        torch._foreach_add_(prev, eps)
        decayed_weights(params, out, lr=lr, weight_decay=weight_decay)
        torch._foreach_addcdiv_(out, m, prev, c1)
        torch._foreach_addcdiv_(out, n, prev, c2)
        if weight_decay != 0 and prox:
            torch._foreach_div_(out, 1 + lr * weight_decay)
        torch._foreach_copy_(prev, grads)
        return out
    for p, g, m_, n_, v_, d, u in zip(params, grads, m, n, v, prev, out, strict=True):
        torch.sub(g, d, out=d)
        m_.lerp_(g, 1 - beta1)
        n_.lerp_(d, 1 - beta2)
        z = d.mul_(beta2).add_(g)
        v_.mul_(beta3).addcmul_(z, z, value=1 - beta3)
        denom = torch.sqrt(v_, out=d).div_(bc3).add_(eps)
        decayed_weights([p], [u], lr=lr, weight_decay=weight_decay)
        u.addcdiv_(m_, denom, value=c1).addcdiv_(n_, denom, value=c2)
        if weight_decay != 0 and prox:
            u.div_(1 + lr * weight_decay)
        d.copy_(g)
    return out


class Adan(UpdateOptimizer):
    """Adan whose update ``u_t`` can be computed before it is applied (module docstring for the math).

    Defaults for LLM pretraining (the official GPT-2 345M recipe; docs/optimizers.md): lr 2.5e-3 (5-10x
    AdamW's), betas (0.98, 0.92, 0.99), eps 1e-8, weight decay 0.05, proximal decay. The momentum knob is
    ``betas[0]`` in the code convention (= 1 - paper beta1). ``foreach`` as in :class:`~bubblefree.optim.Lion`.
    """

    def __init__(self, params, lr: float = 2.5e-3, betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
                 eps: float = 1e-8, weight_decay: float = 0.05, *, prox: bool = True,
                 foreach: bool | None = None) -> None:
        check_nonneg("lr", lr)
        if len(betas) != 3:
            raise ValueError(f"Invalid betas: {betas} (expected three coefficients)")
        check_betas("betas", betas)
        check_nonneg("eps", eps)
        check_nonneg("weight_decay", weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, prox=prox,
                                      foreach=foreach))

    def _group_updates(self, group, params, grads):
        for p, g in zip(params, grads):
            st = self.state[p]
            if "step" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                for key in ("exp_avg", "exp_avg_diff", "exp_avg_sq"):
                    st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["previous_grad"] = g.clone(memory_format=torch.preserve_format)  # first difference is 0
            st["step"] += 1
        updates: list[Tensor | None] = [None] * len(params)
        for step, idx in group_by_step(self.state, params).items():
            sub = [params[i] for i in idx]
            lists = {k: [self.state[p][k] for p in sub] for k in ("exp_avg", "exp_avg_diff", "exp_avg_sq",
                                                                   "previous_grad")}
            out = adan_updates(sub, [grads[i] for i in idx], lists, step=step, lr=group["lr"], betas=group["betas"],
                               eps=group["eps"], weight_decay=group["weight_decay"], prox=group["prox"],
                               foreach=use_foreach(group["foreach"], sub), out=self._out_like(sub))
            for i, u in zip(idx, out):
                updates[i] = u
        return updates
