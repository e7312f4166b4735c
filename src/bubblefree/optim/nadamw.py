"""NAdamW: NAdam (Dozat, "Incorporating Nesterov Momentum into Adam", ICLR 2016 workshop) with decoupled weight
decay (Loshchilov and Hutter, arXiv 1711.05101), as an update rule; ``torch.optim.NAdam(decoupled_weight_decay=True)``.

This is the optimizer of Ajanthan et al. 2025 ("Nesterov Method for Asynchronous Pipeline Parallel
Optimization", ICML 2025, arXiv 2505.01099): their released code runs it, with ``beta1 = 0.99``, on the stale
gradients of PipeDream weight stashing and adds nothing else; its look-ahead is NAdam's own.

With gradient ``g``, step count ``t`` (1 after the first step), learning rate ``lr``, decay ``wd`` and
``psi = momentum_decay``::

    mu_t  = beta1 (1 - 0.5 * 0.96^(t psi))                 (the momentum schedule; it ramps up towards beta1)
    P_t   = prod_{i <= t} mu_i                             (mu_product)
    m_t   = beta1 m_{t-1} + (1 - beta1) g                  (exp_avg, via lerp as torch does)
    v_t   = beta2 v_{t-1} + (1 - beta2) g^2                (exp_avg_sq)
    D     = sqrt(v_t / (1 - beta2^t)) + eps
    u_t   = lr wd x_t + lr (1 - mu_t) / (1 - P_t) * g / D + lr mu_{t+1} / (1 - P_t mu_{t+1}) * m_t / D

and ``x_{t+1} = x_t - u_t``. ``mu_t`` reaches ``0.75 beta1`` after ``t = 1 / (psi log2(1/0.96))``, about 4245 steps
at the default ``psi = 0.004``, and ``beta1`` only asymptotically: a run of a few thousand steps never sees
the nominal momentum.

``P_t`` is kept, as torch keeps it, in a 0-d float32 tensor multiplied by each ``mu_t`` (so its rounding is
torch's); the other scalars are Python floats.

Differences from ``torch.optim.NAdam``: always decoupled decay (torch's default is L2); no maximize,
capturable or differentiable options; torch first decays ``x <- (1 - lr wd) x`` and then subtracts the two
Nesterov terms, which equals ``x - u_t`` up to one rounding of the decay term (as for
:class:`~bubblefree.optim.AdamW`; tests: relative 1e-6 after 300 steps).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bubblefree.optim.adamw import check_adamw_hparams
from bubblefree.optim.base import UpdateOptimizer, check_nonneg, decayed_weights, group_by_step, use_foreach

__all__ = ["NAdamW", "nadamw_updates"]


def _mu(beta1: float, step: float, momentum_decay: float) -> float:
    """``mu_t`` of the module docstring (torch's expression, so the same float64 rounding)."""
    return beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))


def nadamw_updates(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                   *, step: float, mu_product: float, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, momentum_decay: float, foreach: bool = True,
                   out: list[Tensor] | None = None) -> list[Tensor]:
    """Advance the moments in place and return the NAdamW updates of step ``step`` (1-based), whose
    ``mu_product`` ``P_t`` the caller has already advanced (module docstring). ``out``: buffers shaped like
    ``params`` to write into (else new tensors). ``foreach=False`` runs one tensor at a time (the reference)."""
    if not params:
        return []
    lr = float(lr)
    mu, mu_next = _mu(beta1, step, momentum_decay), _mu(beta1, step + 1, momentum_decay)
    c_grad = lr * (1.0 - mu) / (1.0 - mu_product)
    c_avg = lr * mu_next / (1.0 - mu_product * mu_next)
    bc2 = 1 - beta2**step
    if out is None:
        out = [torch.empty_like(p, memory_format=torch.preserve_format) for p in params]
    if foreach:
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        denoms = torch._foreach_div(exp_avg_sqs, bc2)
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, eps)
        decayed_weights(params, out, lr=lr, weight_decay=weight_decay)
        torch._foreach_addcdiv_(out, grads, denoms, c_grad)
        torch._foreach_addcdiv_(out, exp_avgs, denoms, c_avg)
        return out
    for p, g, m, v, u in zip(params, grads, exp_avgs, exp_avg_sqs, out, strict=True):
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = v.div(bc2).sqrt_().add_(eps)
        decayed_weights([p], [u], lr=lr, weight_decay=weight_decay)
        u.addcdiv_(g, denom, value=c_grad).addcdiv_(m, denom, value=c_avg)
    return out


class NAdamW(UpdateOptimizer):
    """NAdam with decoupled weight decay whose update ``u_t`` can be computed before it is applied (module
    docstring for the math).

    Defaults are torch's NAdam (betas (0.9, 0.999), eps 1e-8, ``momentum_decay`` 0.004) with the project's
    LLM-pretraining lr 6e-4 and weight decay 0.1 (as :class:`~bubblefree.optim.AdamW`; docs/optimizers.md).
    The momentum knob is ``beta1``. ``foreach`` as in :class:`~bubblefree.optim.Lion`.
    """

    def __init__(self, params, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.1, momentum_decay: float = 4e-3, *, foreach: bool | None = None) -> None:
        check_adamw_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        check_nonneg("momentum_decay", momentum_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      momentum_decay=momentum_decay, foreach=foreach))

    def _group_updates(self, group, params, grads):
        beta1, beta2 = group["betas"]
        for p in params:
            st = self.state[p]
            if "step" not in st:  # torch's state keys and dtypes
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["mu_product"] = torch.ones((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] += 1
            st["mu_product"] *= _mu(beta1, st["step"].item(), group["momentum_decay"])
        updates: list[Tensor | None] = [None] * len(params)
        for step, idx in group_by_step(self.state, params).items():  # same step, same mu_product
            sub = [params[i] for i in idx]
            st = [self.state[p] for p in sub]
            out = nadamw_updates(sub, [grads[i] for i in idx], [s["exp_avg"] for s in st],
                                 [s["exp_avg_sq"] for s in st], step=step, mu_product=st[0]["mu_product"].item(),
                                 lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                 weight_decay=group["weight_decay"], momentum_decay=group["momentum_decay"],
                                 foreach=use_foreach(group["foreach"], sub), out=self._out_like(sub))
            for i, u in zip(idx, out):
                updates[i] = u
        return updates
