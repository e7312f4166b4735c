"""MARS-AdamW (Yuan et al., "MARS: Unleashing the Power of Variance Reduction for Training Large Models",
arXiv 2411.10438), approximate variant, as an update rule; AdamW for groups with ``use_mars=False``.

The approximate variant uses the previous step's gradient ``g_prev`` (official ``is_approx=True``; the exact
one needs a second backward at the old weights, impossible under delay). With step ``t``::

    c_t = g + gamma beta1 / (1 - beta1) (g - g_prev)      (g_prev = 0 before the first step, as the references)
    c_t = c_t / ||c_t||_F  if ||c_t||_F > 1               (per tensor)
    m_t = beta1 m + (1 - beta1) c_t                       (exp_avg)
    v_t = beta2 v + (1 - beta2) c_t^2                     (exp_avg_sq)
    u_t = lr wd x_t + lr m_t / ((sqrt(v_t + 1e-15) + eps) / sqrt(1 - beta2^t) (1 - beta1^t))

Differences from the official code (AGI-Arena/MARS): eps sits where pytorch-optimizer 4.1.0 (the test oracle)
puts it, inside ``(sqrt(v) + eps) / sqrt(1 - beta2^t)`` instead of ``sqrt(v) / sqrt(1 - beta2^t) + eps`` (relative
difference of about eps / sqrt(v)); ``last_grad`` is a *copy* of
the gradient, whereas the official code aliases ``p.grad`` (corrupted by in-place zeroing or accumulation);
1-D parameters, embeddings and the head are routed to AdamW groups by :func:`bubblefree.optim.build_optimizer`
rather than by ``ndim`` inside the optimizer (official ``optimize_1d=False`` routes only by ``ndim``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bubblefree.optim.adamw import WithAdamWGroups, check_adamw_hparams
from bubblefree.optim.base import check_nonneg, group_by_step

__all__ = ["MARS", "mars_updates"]


def mars_updates(params: list[Tensor], grads: list[Tensor], state: dict[str, list[Tensor]], *, step: float, lr: float,
                 betas: tuple[float, float], gamma: float, eps: float, weight_decay: float,
                 foreach: bool = True) -> list[Tensor]:
    """Advance ``state`` (lists ``exp_avg``, ``exp_avg_sq``, ``last_grad``) in place and return fresh MARS-AdamW
    updates for step ``step`` (1-based). ``foreach=False`` is the per-tensor reference path."""
    if not params:
        return []
    lr = float(lr)
    beta1, beta2 = betas
    scale = gamma * beta1 / (1 - beta1)
    bc1, bc2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
    m, v, last = state["exp_avg"], state["exp_avg_sq"], state["last_grad"]
    if foreach:
        cs = torch._foreach_sub(grads, last)
        torch._foreach_mul_(cs, scale)
        torch._foreach_add_(cs, grads)
        torch._foreach_div_(cs, [n.clamp_min(1.0) for n in torch._foreach_norm(cs)])
        torch._foreach_lerp_(m, cs, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, cs, cs, 1 - beta2)
        denoms = cs  # c_t is no longer needed: reuse its buffers for the denominators
        torch._foreach_copy_(denoms, v)
        torch._foreach_add_(denoms, 1e-15)
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, eps)
        torch._foreach_mul_(denoms, bc1 / bc2_sqrt)
        updates = torch._foreach_div(m, denoms)
        torch._foreach_mul_(updates, lr)
        if weight_decay != 0:
            torch._foreach_add_(updates, params, alpha=lr * weight_decay)
        torch._foreach_copy_(last, grads)
        return updates
    updates = []
    for p, g, m_, v_, last_ in zip(params, grads, m, v, last, strict=True):
        c = (g - last_).mul_(scale).add_(g)
        norm = torch.linalg.vector_norm(c)
        if norm > 1.0:
            c.div_(norm)
        m_.lerp_(c, 1 - beta1)
        v_.mul_(beta2).addcmul_(c, c, value=1 - beta2)
        denom = v_.add(1e-15).sqrt_().add_(eps).div_(bc2_sqrt).mul_(bc1)
        u = m_.div(denom).mul_(lr)
        if weight_decay != 0:
            u.add_(p, alpha=lr * weight_decay)
        last_.copy_(g)
        updates.append(u)
    return updates


class MARS(WithAdamWGroups):
    """MARS-AdamW on param groups with ``use_mars=True`` (the default), AdamW on groups with ``use_mars=False``.

    Defaults for LLM pretraining (the official GPT-2 125M config; docs/optimizers.md): lr 6e-3, betas (0.95, 0.99),
    gamma 0.025, eps 1e-8, weight decay 0.1 (the paper's; the official config uses 0.01). AdamW groups default to
    ``adamw_lr`` 3e-3, ``adamw_betas`` (0.9, 0.95), ``adamw_weight_decay`` 0.1 (official ``lr_1d``, ``betas_1d``,
    ``weight_decay_1d``). The momentum knob is ``betas[0]``, which also scales the correction
    ``gamma beta1 / (1 - beta1)``.
    """

    route_key = "use_mars"

    def __init__(self, params, lr: float = 6e-3, betas: tuple[float, float] = (0.95, 0.99), eps: float = 1e-8,
                 weight_decay: float = 0.1, *, gamma: float = 0.025, adamw_lr: float = 3e-3,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.1, foreach: bool | None = None) -> None:
        check_adamw_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        check_nonneg("gamma", gamma)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, gamma=gamma,
                                      foreach=foreach),
                         adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                         adamw_weight_decay=adamw_weight_decay)

    def _matrix_updates(self, group, params, grads):
        for p in params:
            st = self.state[p]
            if "step" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                for key in ("exp_avg", "exp_avg_sq", "last_grad"):
                    st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] += 1
        updates: list[Tensor | None] = [None] * len(params)
        for step, idx in group_by_step(self.state, params).items():
            sub = [params[i] for i in idx]
            lists = {k: [self.state[p][k] for p in sub] for k in ("exp_avg", "exp_avg_sq", "last_grad")}
            out = mars_updates(sub, [grads[i] for i in idx], lists, step=step, lr=group["lr"], betas=group["betas"],
                               gamma=group["gamma"], eps=group["eps"], weight_decay=group["weight_decay"],
                               foreach=group["foreach"] is not False)
            for i, u in zip(idx, out):
                updates[i] = u
        return updates
