r"""SOAP: Adam run in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024, arXiv 2409.11321).

For a parameter with gradient ``G`` of order ``k`` (a matrix has ``k = 2``), SOAP keeps one Shampoo
statistic per preconditioned dimension ``i``, the exponential average of the mode-``i`` Gram matrix
(for a matrix: ``L = EMA[G G^T]`` and ``R = EMA[G^T G]``), and an orthogonal basis ``Q_i`` of its
eigenvectors. It runs Adam with the second moment measured in that basis. With ``rot(X)`` the product of
``X`` with ``Q_i^T`` along every preconditioned mode (for a matrix ``Q_L^T X Q_R``) and ``rot^{-1}`` its
inverse (``Q_L X Q_R^T``), the step ``t`` with ``k = t - 1`` is

.. code-block:: text

    t = 1:   GG_i = (1 - b_s) * Gram_i(G_1);  Q_i = eigh(GG_i), columns by descending eigenvalue;  u_1 = 0
    t >= 2:  G'  = rot(G_t)                                  (in the basis of the previous step)
             m   = b1 * m + (1 - b1) * G_t                   (first moment, original basis)
             v   = b2 * v + (1 - b2) * G' ** 2               (second moment, eigenbasis)
             N   = rot^{-1}( rot(m) / (sqrt(v) + eps) )
             s   = lr * sqrt(1 - b2 ** k) / (1 - b1 ** k)
             u_t = s * N + lr * wd * (x_t - s * N)           so that x_t - u_t = (x_t - s * N) * (1 - lr * wd)
             GG_i = b_s * GG_i + (1 - b_s) * Gram_i(G_t)
             every precondition_frequency steps (k % f == 0), one power-iteration step refreshes Q_i:
                 P = GG_i Q_i;  order the columns by the estimated eigenvalues diag(Q_i^T P), descending;
                 permute v along mode i the same way;  Q_i = QR(P[:, order]).Q

A dimension longer than ``max_precond_dim`` keeps the identity basis, and so do 1-D parameters unless
``precondition_1d``: those get plain Adam. ``b_s`` is ``shampoo_beta`` (``beta2`` when None). The update
is the one of the official code (nikhilvyas/SOAP, ``main`` branch) as ported by pytorch-optimizer 4.1.0,
which the tests take as the reference; weight decay there is applied
*after* the step, with the current learning rate, which is why ``u_t`` carries the cross term above.

Why the trajectory is well defined although eigenvectors are not: flipping the sign of a column of ``Q_i``
flips the matching slice of ``rot(G)`` and of ``rot(m)`` together, so ``v`` (a square) and the ratio
``rot(m) / sqrt(v)`` after ``rot^{-1}`` are unchanged. The order of the columns is tied to ``v`` by the
sort-and-permute of the refresh. Only a repeated (or nearly repeated) eigenvalue (for instance the null space of
``G G^T`` while fewer gradients than rows have been seen) leaves the basis, and so the update, to the
linear-algebra library's rounding; the state depends on the gradients alone, so identical gradients and
identical floating-point operations give an identical trajectory.

The momentum knob (docs/spec.md section 7) is ``beta1``. Defaults are the official ones for LLM
pretraining: lr 3e-3, betas (0.95, 0.95), shampoo_beta = beta2, precondition_frequency 10,
weight_decay 0.01 (the paper's runs use 0.1 through the config).

Differences from the reference (pytorch-optimizer 4.1.0 ``SOAP``):

- The update is returned as ``u_t`` (:class:`~bubblefree.optim.base.UpdateOptimizer`) instead of being
  applied; ``x - u`` equals the reference's two in-place writes up to one rounding of ``x``.
- Step 1 returns zero tensors rather than no update, so delay queues and Error Feedback buffers stay
  well defined (``u_1 = 0`` is exactly what the reference does to the weights, weight decay included).
- ``step`` is counted per parameter (a 0-d tensor, as in torch.optim) rather than per param group;
  the two agree whenever every parameter of a group gets a gradient at every step.
- eigh runs in float32 for bf16 / fp16 parameters (the reference tries their own dtype, which has no
  eigh kernel, and falls back to float64); as in the reference, float32 and float64 use their own dtype,
  QR always runs in float32, and the state keeps the parameter's dtype.
- Not supported: ``merge_dims``, ``normalize_gradient``, ``correct_bias=False``, ``maximize``, complex
  parameters.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from bubblefree.optim.base import UpdateOptimizer, check_betas, check_nonneg

__all__ = ["SOAP"]

# The official code adds 1e-30 * I before eigh; in float32 that only changes diagonal entries below
# ~1e-23 (a gradient row that has always been zero), so we keep it for bit-identical bases.
_EIGH_JITTER = 1e-30


def _gram(g: Tensor, dim: int) -> Tensor:
    """Mode-``dim`` Gram matrix: ``g`` contracted with itself over every dimension but ``dim``."""
    others = [d for d in range(g.ndim) if d != dim]
    return torch.tensordot(g, g, dims=(others, others))


def _rotate(x: Tensor, bases: list[Tensor | None], *, back: bool = False) -> Tensor:
    """``x`` times ``Q_i^T`` (``back``: times ``Q_i``) along every mode ``i`` with a basis.

    Each tensordot contracts the leading mode and appends the result as the last one, so after ``x.ndim``
    of them the modes are back in their original order; a mode without a basis is just rotated to the back.
    For a matrix this is ``Q_L^T x Q_R`` (``back``: ``Q_L x Q_R^T``) as two plain matmuls.
    """
    for q in bases:
        if q is None:
            x = x.movedim(0, -1)
        else:
            x = torch.tensordot(x, q, dims=([0], [1 if back else 0]))
    return x


def _eigenbases(grams: list[Tensor | None]) -> list[Tensor | None]:
    """Eigenvectors of each statistic by descending eigenvalue, computed in at least float32."""
    bases: list[Tensor | None] = []
    for gg in grams:
        if gg is None:
            bases.append(None)
            continue
        work = gg.to(torch.promote_types(gg.dtype, torch.float32))
        jittered = work + _EIGH_JITTER * torch.eye(work.shape[0], dtype=work.dtype, device=work.device)
        _, vecs = torch.linalg.eigh(jittered)
        bases.append(vecs.flip(1).to(gg.dtype))
    return bases


def _refresh_bases(
    grams: list[Tensor | None], bases: list[Tensor | None], exp_avg_sq: Tensor
) -> tuple[list[Tensor | None], Tensor]:
    """One power-iteration step with QR for every basis; ``exp_avg_sq`` is re-ordered to follow the columns.

    Sorting by the Rayleigh quotients ``diag(Q^T GG Q)`` keeps column ``j`` of the new basis near the
    eigenvector whose second moment sits at index ``j`` of ``exp_avg_sq``.
    """
    new_bases: list[Tensor | None] = []
    for dim, (gg, q) in enumerate(zip(grams, bases, strict=True)):
        if gg is None:
            new_bases.append(None)
            continue
        assert q is not None
        product = gg @ q
        order = torch.argsort((q * product).sum(dim=0), descending=True)
        exp_avg_sq = exp_avg_sq.index_select(dim, order)
        # float32 whatever the dtype, as the reference: QR has no bf16 kernel, and float64 would gain
        # nothing for a basis that one power-iteration step only approximates anyway.
        work = product.index_select(1, order).to(torch.float32)
        new_bases.append(torch.linalg.qr(work)[0].to(q.dtype))
    return new_bases, exp_avg_sq


def _accumulate_grams(grams: list[Tensor | None], g: Tensor, shampoo_beta: float) -> None:
    """``GG_i <- shampoo_beta * GG_i + (1 - shampoo_beta) * Gram_i(g)`` in place."""
    for dim, gg in enumerate(grams):
        if gg is not None:
            gg.lerp_(_gram(g, dim).to(gg.dtype), 1.0 - shampoo_beta)


def _first_step(x: Tensor, g: Tensor, state: dict[str, Any], *, shampoo_beta: float) -> Tensor:
    """Step 1: the first gradient only builds the bases (updating with it would precondition it by a basis
    built from itself, as the official code notes), and the update is zero."""
    _accumulate_grams(state["GG"], g, shampoo_beta)
    state["Q"] = _eigenbases(state["GG"])
    return torch.zeros_like(x)


def _step_size(lr: float, beta1: float, beta2: float, k: int) -> float:
    """Adam's bias corrections for the ``k``-th moment update (``k = t - 1``: step 1 made none)."""
    return lr * (math.sqrt(1.0 - beta2**k) / (1.0 - beta1**k))


def _after_update(
    g: Tensor, state: dict[str, Any], k: int, *, shampoo_beta: float, precondition_frequency: int
) -> None:
    """Fold ``g`` into the statistics, then refresh the bases every ``precondition_frequency`` steps."""
    _accumulate_grams(state["GG"], g, shampoo_beta)
    if k % precondition_frequency == 0:
        state["Q"], state["exp_avg_sq"] = _refresh_bases(state["GG"], state["Q"], state["exp_avg_sq"])


def _single_tensor_soap(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Any]],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    shampoo_beta: float,
    eps: float,
    weight_decay: float,
    precondition_frequency: int,
) -> list[Tensor]:
    """The reference path: the module docstring's equations, one tensor at a time."""
    updates = []
    for x, g, state in zip(params, grads, states, strict=True):
        state["step"] += 1
        k = int(state["step"].item()) - 1
        if k == 0:
            updates.append(_first_step(x, g, state, shampoo_beta=shampoo_beta))
            continue
        bases, exp_avg, exp_avg_sq = state["Q"], state["exp_avg"], state["exp_avg_sq"]
        g_rot = _rotate(g, bases)
        exp_avg.lerp_(g, 1.0 - beta1)
        exp_avg_sq.lerp_(g_rot.square(), 1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(eps)
        update = _rotate(_rotate(exp_avg, bases) / denom, bases, back=True)
        update.mul_(_step_size(lr, beta1, beta2, k))
        if weight_decay != 0.0:
            # Decay after the step, as the reference: x - u = (x - s N)(1 - lr wd), i.e. u = lerp(s N, x, lr wd).
            update.lerp_(x, lr * weight_decay)
        _after_update(g, state, k, shampoo_beta=shampoo_beta, precondition_frequency=precondition_frequency)
        updates.append(update)
    return updates


def _foreach_soap(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Any]],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    shampoo_beta: float,
    eps: float,
    weight_decay: float,
    precondition_frequency: int,
) -> list[Tensor]:
    """The same operations with every elementwise one batched over the list (one kernel each on a GPU).

    The rotations, Gram matrices, eigh and QR stay per tensor: on 2 CPU threads a ``bmm`` over same-shape
    matrices measured no faster than the loop of ``mm`` calls it would replace. Every operation is the
    reference path's, so the two agree bit for bit.
    """
    updates: list[Tensor | None] = [None] * len(params)
    live: list[int] = []
    for i, (x, g, state) in enumerate(zip(params, grads, states, strict=True)):
        state["step"] += 1
        if int(state["step"].item()) == 1:
            updates[i] = _first_step(x, g, state, shampoo_beta=shampoo_beta)
        else:
            live.append(i)
    if live:
        xs, gs, sts = [params[i] for i in live], [grads[i] for i in live], [states[i] for i in live]
        ks = [int(s["step"].item()) - 1 for s in sts]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts]
        g_rots = [_rotate(g, s["Q"]) for g, s in zip(gs, sts)]
        torch._foreach_lerp_(exp_avgs, gs, 1.0 - beta1)
        squares = torch._foreach_mul(g_rots, g_rots)
        del g_rots  # the lists hold every tensor's temporaries at once: drop each as soon as it is used
        torch._foreach_lerp_(exp_avg_sqs, squares, 1.0 - beta2)
        del squares
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denoms, eps)
        ratios = torch._foreach_div([_rotate(m, s["Q"]) for m, s in zip(exp_avgs, sts)], denoms)
        steps = [_rotate(r, s["Q"], back=True) for r, s in zip(ratios, sts)]
        torch._foreach_mul_(steps, [_step_size(lr, beta1, beta2, k) for k in ks])
        if weight_decay != 0.0:
            torch._foreach_lerp_(steps, xs, lr * weight_decay)
        for i, g, s, k, u in zip(live, gs, sts, ks, steps):
            _after_update(g, s, k, shampoo_beta=shampoo_beta, precondition_frequency=precondition_frequency)
            updates[i] = u
    assert all(u is not None for u in updates)
    return updates  # type: ignore[return-value]


class SOAP(UpdateOptimizer):
    """SOAP (Vyas et al. 2024, arXiv 2409.11321) as an :class:`UpdateOptimizer`; equations in the module docstring.

    Args:
        params: parameters or param groups.
        lr: learning rate (the peak; LR schedules scale ``group["lr"]``).
        betas: ``(beta1, beta2)`` of Adam; ``beta1`` is the project's momentum knob.
        shampoo_beta: EMA coefficient of the Shampoo statistics; None uses ``beta2`` (the official default).
        eps: added to ``sqrt(v)``.
        weight_decay: decoupled weight decay, applied after the step as in the reference.
        precondition_frequency: steps between eigenbasis refreshes (power iteration + QR).
        max_precond_dim: dimensions longer than this keep the identity basis.
        precondition_1d: also precondition 1-D parameters (off: they get Adam in the original basis).
        foreach: False runs the per-tensor reference path; True or None (default) batches the elementwise
            operations over the group. Both give the same bits.

    State per parameter: ``step`` (0-d tensor), ``exp_avg`` (original basis), ``exp_avg_sq`` (eigenbasis),
    ``GG`` and ``Q`` (lists with one ``n x n`` matrix per dimension of length ``n``, None where that
    dimension is not preconditioned).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        precondition_1d: bool = False,
        *,
        foreach: bool | None = None,
    ) -> None:
        check_nonneg("lr", lr)
        if len(betas) != 2:
            raise ValueError(f"Invalid betas: {betas} (expected two coefficients)")
        check_betas("betas", betas)
        if shampoo_beta is not None:
            check_betas("shampoo_beta", [shampoo_beta])
        check_nonneg("eps", eps)
        check_nonneg("weight_decay", weight_decay)
        for name, value in (("precondition_frequency", precondition_frequency), ("max_precond_dim", max_precond_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Invalid {name}: {value} (must be an integer >= 1)")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            shampoo_beta=shampoo_beta,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            precondition_1d=bool(precondition_1d),
            foreach=foreach,
        )
        super().__init__(params, defaults)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        if p.is_complex():
            raise ValueError(f"Invalid parameter dtype: {p.dtype} (SOAP does not support complex parameters)")
        preconditioned = [
            n <= group["max_precond_dim"] and (p.ndim > 1 or group["precondition_1d"]) for n in p.shape
        ]
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["GG"] = [p.new_zeros(n, n) if pre else None for n, pre in zip(p.shape, preconditioned, strict=True)]
        state["Q"] = [None] * p.ndim

    def _group_updates(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        beta1, beta2 = group["betas"]
        shampoo_beta = beta2 if group["shampoo_beta"] is None else group["shampoo_beta"]
        for p in params:
            if not self.state[p]:
                self._init_state(p, group)
        path = _single_tensor_soap if group.get("foreach") is False else _foreach_soap
        return path(
            params,
            grads,
            [self.state[p] for p in params],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            shampoo_beta=shampoo_beta,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            precondition_frequency=group["precondition_frequency"],
        )
