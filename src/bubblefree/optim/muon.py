"""Muon (Keller Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024,
https://kellerjordan.github.io/posts/muon/) with an AdamW part for everything that is not a hidden matrix.

For a hidden matrix ``x`` (shape ``[..., A, B]`` = fan_out, fan_in; leading dims are a batch of matrices,
e.g. stacked MoE experts) with gradient ``g`` and momentum ``mu``::

    B_t = mu B_{t-1} + (1 - mu) g                 (momentum_buffer; EMA form via lerp, as torch and Keller)
    M_t = (1 - mu) g + mu B_t  if nesterov else B_t
    O_t = NS5(M_t)                                 (quintic Newton-Schulz, 5 steps, (a, b, c) below)
    u_t = lr wd x_t + adjust(lr, A, B) O_t

with ``adjust`` = ``lr sqrt(max(1, A / B))`` ("original", Keller) or ``0.2 lr sqrt(max(A, B))``
("match_rms_adamw", Moonlight, arXiv 2502.16982). The decoupled decay uses the *unadjusted* lr, exactly as
``torch.optim.Muon``. NS5 normalises ``M / max(||M||_F, eps)`` and iterates ``X <- a X + (b A + c A^2) X``
with ``A = X X^T`` on the wide orientation; it runs in ``ns_dtype`` (default: float32 on CPU, which has no fast
bf16 matmul here, bfloat16 on CUDA as in the reference), and on GPU same-shaped matrices of a group are
stacked into one batched call (on CPU one call per matrix is faster). Param groups with ``use_muon=False`` get AdamW
(Keller's MuonWithAuxAdam layout).

Differences from ``torch.optim.Muon``: it exposes ``u_t``; batches same-shaped matrices; accepts 3-D and
higher parameters as batches of matrices; ``ns_dtype`` is configurable (torch always uses bf16); the update
is returned in float32 (for EF buffers) rather than bf16.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from bubblefree.optim.adamw import WithAdamWGroups
from bubblefree.optim.base import check_betas, check_nonneg, use_foreach

__all__ = ["NS_COEFFICIENTS", "Muon", "adjust_lr", "muon_updates", "zeropower_via_newtonschulz5"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic coefficients (also torch.optim.Muon's ``DEFAULT_A/B/C``)."""

ADJUST_LR = ("original", "match_rms_adamw")


def zeropower_via_newtonschulz5(G: Tensor, *, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                                dtype: torch.dtype = torch.float32) -> Tensor:
    """Approximate ``U V^T`` of ``G = U S V^T`` for a batch of matrices ``G`` of shape ``[..., A, B]``.

    Each matrix is normalised by its own Frobenius norm (clamped at ``eps``, as torch does), the iteration
    runs on the wide orientation (``A <= B``) in ``dtype``, and the result is returned in ``dtype``.
    """
    a, b, c = coefficients
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X.reshape(-1, X.size(-2), X.size(-1))
    X = X / torch.linalg.matrix_norm(X, keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    X = X.reshape((*G.shape[:-2], G.size(-1), G.size(-2)) if tall else G.shape)
    return X.mT if tall else X


def adjust_lr(lr: float, adjust: str, shape: torch.Size) -> float:
    """The learning rate Muon applies to a matrix of ``shape[-2:] = (A, B)`` (module docstring)."""
    A, B = shape[-2], shape[-1]
    if adjust == "original":
        return lr * math.sqrt(max(1.0, A / B))
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    raise ValueError(f"Invalid adjust_lr: {adjust!r} (expected one of {', '.join(ADJUST_LR)})")


def muon_updates(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], *, lr: float, momentum: float,
                 nesterov: bool, weight_decay: float, adjust: str = "original", ns_steps: int = 5,
                 ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7, ns_dtype: torch.dtype = torch.float32,
                 batched: bool = True) -> list[Tensor]:
    """Advance the momentum buffers in place and return fresh Muon updates (module docstring).

    ``batched`` stacks same-shaped matrices into one Newton-Schulz call; ``False`` is the per-tensor
    reference path. ``params`` and ``grads`` are only read.
    """
    lr = float(lr)
    mom = []
    for g, buf in zip(grads, bufs, strict=True):
        buf.lerp_(g, 1 - momentum)
        mom.append(g.lerp(buf, momentum) if nesterov else buf)
    ns = dict(steps=ns_steps, coefficients=ns_coefficients, eps=eps, dtype=ns_dtype)
    ortho: list[Tensor | None] = [None] * len(params)
    if batched:
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for i, m in enumerate(mom):
            by_shape[(tuple(m.shape), m.device, m.dtype)].append(i)
        for idx in by_shape.values():
            stacked = torch.stack([mom[i] for i in idx]) if len(idx) > 1 else mom[idx[0]].unsqueeze(0)
            out = zeropower_via_newtonschulz5(stacked, **ns)
            for k, i in enumerate(idx):
                ortho[i] = out[k]
    else:
        ortho = [zeropower_via_newtonschulz5(m, **ns) for m in mom]
    updates = []
    for p, o in zip(params, ortho, strict=True):
        # o is a temporary (possibly a view of the stacked NS output), so scaling it in place is safe.
        u = o.to(torch.promote_types(p.dtype, torch.float32)).mul_(adjust_lr(lr, adjust, p.shape))
        if weight_decay != 0:
            u.add_(p, alpha=lr * weight_decay)
        updates.append(u)
    return updates


class Muon(WithAdamWGroups):
    """Muon on param groups with ``use_muon=True`` (the default), AdamW on groups with ``use_muon=False``.

    Defaults for LLM pretraining (Keller Jordan's; docs/optimizers.md): lr 0.02, momentum 0.95, Nesterov,
    "original" lr scaling; weight decay 0.1 (the paper's). AdamW groups default to ``adamw_lr`` 3e-3,
    ``adamw_betas`` (0.9, 0.95), ``adamw_eps`` 1e-8, ``adamw_weight_decay`` 0.1; a group may override any of
    ``lr``, ``betas``, ``eps``, ``weight_decay``. The momentum knob is ``momentum`` (mu).

    Args:
        ns_dtype: dtype of the Newton-Schulz iteration; None picks bfloat16 on CUDA and float32 elsewhere.
        foreach: False runs the per-tensor reference path (one NS call per matrix, AdamW single-tensor);
            True the batched path; None (default) batched off the CPU only: on the CPU, per-matrix ``addmm``
            runs faster than the stacked ``baddbmm`` for transformer-sized matrices.

    A ``use_muon`` group given a parameter with fewer than two dimensions raises ValueError.
    """

    route_key = "use_muon"

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.1, *,
                 nesterov: bool = True, adjust_lr: str = "original", ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7,
                 ns_dtype: torch.dtype | None = None, adamw_lr: float = 3e-3,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.1, foreach: bool | None = None) -> None:
        check_nonneg("lr", lr)
        check_betas("momentum", [momentum])
        check_nonneg("weight_decay", weight_decay)
        check_nonneg("eps", eps)
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"Invalid adjust_lr: {adjust_lr!r} (expected one of {', '.join(ADJUST_LR)})")
        if not (isinstance(ns_steps, int) and 0 < ns_steps < 100):
            raise ValueError(f"Invalid ns_steps: {ns_steps} (must be an integer in [1, 100))")
        if len(ns_coefficients) != 3:
            raise ValueError(f"Invalid ns_coefficients: {ns_coefficients} (expected three numbers)")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, adjust_lr=adjust_lr,
                        ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), eps=eps, ns_dtype=ns_dtype,
                        foreach=foreach)
        super().__init__(params, defaults, adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                         adamw_weight_decay=adamw_weight_decay)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Invalid parameter for Muon: shape {tuple(p.shape)} has ndim {p.ndim} < 2; "
                                     "put it in a use_muon=False (AdamW) group")

    def _matrix_updates(self, group, params, grads):
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        ns_dtype = group["ns_dtype"]
        if ns_dtype is None:
            ns_dtype = torch.bfloat16 if params[0].device.type == "cuda" else torch.float32
        return muon_updates(params, grads, [self.state[p]["momentum_buffer"] for p in params], lr=group["lr"],
                            momentum=group["momentum"], nesterov=group["nesterov"],
                            weight_decay=group["weight_decay"], adjust=group["adjust_lr"],
                            ns_steps=group["ns_steps"], ns_coefficients=group["ns_coefficients"], eps=group["eps"],
                            ns_dtype=ns_dtype, batched=use_foreach(group["foreach"], params))
