"""AdamW (Loshchilov and Hutter, "Decoupled Weight Decay Regularization", arXiv 1711.05101) as an update rule.

With gradient ``g``, step count ``t`` (1 after the first step), learning rate ``lr``, decay ``wd``::

    m_t = beta1 m_{t-1} + (1 - beta1) g                    (exp_avg, via lerp as torch does)
    v_t = beta2 v_{t-1} + (1 - beta2) g^2                  (exp_avg_sq)
    u_t = lr wd x_t + lr / (1 - beta1^t) * m_t / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)

and ``x_{t+1} = x_t - u_t``. ``torch.optim.AdamW`` first decays ``x <- (1 - lr wd) x`` and then subtracts the
Adam step; the Adam step does not read ``x``, so its result equals ``x - u_t`` up to one rounding of the
decay term (tests: relative 1e-6 after 30 steps).

Three paths compute the same ``u_t`` behind :func:`adamw_updates`: ``single`` (the per-tensor reference,
easiest to read), ``foreach`` (one kernel per operation over the whole list) and ``fused``, which runs
torch's fused Adam kernel (the one ``torch.optim.AdamW(fused=True)`` uses) with learning rate ``-lr`` on a
buffer that starts at ``lr wd x``: the kernel subtracts ``-lr`` times the Adam step from it, so the buffer
ends at exactly ``u_t``. No parameter difference is taken, so nothing is lost to cancellation. The fused
path writes into recycled buffers (``out``, :meth:`~bubblefree.optim.base.UpdateOptimizer.recycle`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from bubblefree.optim.base import UpdateOptimizer, check_betas, check_nonneg, decayed_weights

__all__ = ["AdamW", "WithAdamWGroups", "adamw_updates", "init_adamw_state"]

_IMPLS = ("single", "foreach", "fused")


def _fused_supported(params: list[Tensor]) -> bool:
    """torch has a fused Adam kernel for floating CPU and CUDA tensors."""
    return all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float64,
               torch.float16, torch.bfloat16) for p in params)


def init_adamw_state(state: dict[str, Any], p: Tensor) -> None:
    """Zero moments and a 0-d float32 ``step`` on the parameter's device (the fused kernel reads it there).

    A loaded state keeps its ``step`` where it was saved (torch's ``load_state_dict`` moves every other tensor
    to its parameter's device, and ``step`` only for groups that say ``fused=True``; ours say None, "wherever
    the kernel exists"), so a CPU checkpoint resumed on a GPU brings a CPU ``step``: moved here, once."""
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif state["step"].device != p.device:
        state["step"] = state["step"].to(p.device)


def _single_tensor_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay):
    updates = []
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        step += 1
        t = step.item()
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        (u,) = decayed_weights([p], [torch.empty_like(p)], lr=lr, weight_decay=weight_decay)
        updates.append(u.addcdiv_(m, denom, value=lr / (1 - beta1**t)))
    return updates


def _foreach_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay):
    torch._foreach_add_(steps, 1)
    ts = [s.item() for s in steps]
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, [math.sqrt(1 - beta2**t) for t in ts])
    torch._foreach_add_(denoms, eps)
    updates = torch._foreach_div(exp_avgs, denoms)
    torch._foreach_mul_(updates, [lr / (1 - beta1**t) for t in ts])
    if weight_decay != 0:
        torch._foreach_add_(updates, params, alpha=lr * weight_decay)
    return updates


def _fused_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay, out=None):
    # buf = lr wd x; the kernel run with -lr computes buf <- buf + adam_step = u, rounded exactly as the negation
    # of buf = -lr wd x minus the step (round-to-nearest is symmetric), so no separate negation pass.
    bufs = out if out is not None else [torch.empty_like(p, memory_format=torch.preserve_format) for p in params]
    decayed_weights(params, bufs, lr=lr, weight_decay=weight_decay)
    torch._foreach_add_(steps, 1)
    torch._fused_adam_(bufs, list(grads), list(exp_avgs), list(exp_avg_sqs), [], list(steps), amsgrad=False,
                       lr=-lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, maximize=False)
    return bufs


_PATHS = {"single": _single_tensor_adamw, "foreach": _foreach_adamw, "fused": _fused_adamw}


def adamw_updates(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                  steps: list[Tensor], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  impl: str = "foreach", out: list[Tensor] | None = None) -> list[Tensor]:
    """Advance the moments and ``steps`` in place and return fresh AdamW updates ``u_t`` (module docstring).

    ``impl`` picks the path: ``single`` (reference), ``foreach`` or ``fused``. ``params``/``grads`` are only read.
    ``out`` (buffers shaped like ``params``) is where the fused path writes ``u_t``; the others allocate.
    """
    if impl not in _PATHS:
        raise ValueError(f"Invalid impl: {impl!r} (expected one of {', '.join(_IMPLS)})")
    if not params:
        return []
    extra = {"out": out} if impl == "fused" else {}
    return _PATHS[impl](params, grads, exp_avgs, exp_avg_sqs, steps, lr=float(lr), beta1=beta1, beta2=beta2,
                        eps=eps, weight_decay=weight_decay, **extra)


def pick_impl(params: list[Tensor], foreach: bool | None, fused: bool | None) -> str:
    """torch's dispatch rule: fused where the kernel exists unless switched off, else foreach, else single."""
    if fused or (fused is None and foreach is not False and _fused_supported(params)):
        return "fused"
    return "single" if foreach is False else "foreach"


class AdamW(UpdateOptimizer):
    """AdamW whose update ``u_t`` can be computed before it is applied (see the module docstring for the math).

    Defaults are published LLM-pretraining values (nanoGPT / MARS GPT-2 125M configs; docs/optimizers.md):
    lr 6e-4, betas (0.9, 0.95), wd 0.1, eps 1e-8. The momentum knob is ``beta1``.

    Args:
        foreach: False runs the per-tensor reference path; True or None the foreach path (or fused, below).
        fused: use torch's fused Adam kernel; None (default) uses it wherever it exists unless ``foreach`` is
            False. The three paths agree to float rounding (tested).

    Differences from ``torch.optim.AdamW``: no amsgrad, maximize, capturable or differentiable options; the
    decay is part of ``u_t`` instead of a separate multiplication of ``x``.
    """

    def __init__(self, params, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, *, foreach: bool | None = None, fused: bool | None = None) -> None:
        check_adamw_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=foreach, fused=fused)
        super().__init__(params, defaults)

    def _group_updates(self, group, params, grads):
        return adamw_group_updates(self.state, group, params, grads, out_like=self._out_like)


def check_adamw_hparams(*, lr: float, betas, eps: float, weight_decay: float, prefix: str = "") -> None:
    """ValueError naming the bad hyperparameter (``prefix`` tells Muon's and MARS's AdamW part apart)."""
    check_nonneg(f"{prefix}lr", lr)
    if len(betas) != 2:
        raise ValueError(f"Invalid {prefix}betas: {betas} (expected two coefficients)")
    check_betas(f"{prefix}betas", betas)
    check_nonneg(f"{prefix}eps", eps)
    check_nonneg(f"{prefix}weight_decay", weight_decay)


def adamw_group_updates(state: dict, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                        out_like: Callable[[list[Tensor]], list[Tensor]] | None = None) -> list[Tensor]:
    """AdamW on one param group: the book-keeping shared by :class:`AdamW`, Muon's and MARS's AdamW groups.

    ``out_like``: the optimizer's :meth:`~bubblefree.optim.base.UpdateOptimizer._out_like`, which supplies
    the buffers the fused path writes into (None: new tensors)."""
    for p in params:
        init_adamw_state(state[p], p)
    st = [state[p] for p in params]
    beta1, beta2 = group["betas"]
    impl = pick_impl(params, group.get("foreach"), group.get("fused"))
    return adamw_updates(params, grads, [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st],
                         [s["step"] for s in st], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], impl=impl,
                         out=out_like(params) if out_like is not None and impl == "fused" else None)


class WithAdamWGroups(UpdateOptimizer):
    """Base of an optimizer whose own rule is for hidden matrices (Muon, MARS) and which runs AdamW on the
    other parameters (embeddings, head, norms, biases): the param groups whose :attr:`route_key` flag is false.

    Such a group takes the AdamW defaults given to the constructor (``adamw_lr``, ``adamw_betas``,
    ``adamw_eps``, ``adamw_weight_decay``) for any of ``lr``, ``betas``, ``eps``, ``weight_decay`` it does not
    set, and is checked as an AdamW group. A subclass sets :attr:`route_key` and writes its own rule in
    :meth:`_matrix_updates`.
    """

    route_key = ""
    """The group flag that selects the matrix rule (``use_muon``, ``use_mars``); true by default."""

    def __init__(self, params, defaults: dict[str, Any], *, adamw_lr: float, adamw_betas: tuple[float, float],
                 adamw_eps: float, adamw_weight_decay: float) -> None:
        check_adamw_hparams(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay,
                            prefix="adamw_")
        self._adamw_defaults = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                                    weight_decay=adamw_weight_decay)
        super().__init__(params, {**defaults, self.route_key: True})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not param_group.get(self.route_key, True):
            for key, value in self._adamw_defaults.items():
                param_group.setdefault(key, value)
            check_adamw_hparams(lr=param_group["lr"], betas=param_group["betas"], eps=param_group["eps"],
                                weight_decay=param_group["weight_decay"])
        super().add_param_group(param_group)

    def _group_updates(self, group, params, grads):
        if not group[self.route_key]:
            return adamw_group_updates(self.state, group, params, grads, out_like=self._out_like)
        return self._matrix_updates(group, params, grads)

    def _matrix_updates(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        raise NotImplementedError
