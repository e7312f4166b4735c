"""The optimizer contract: compute the whole update ``u_t`` first, apply it separately.

Delayed-gradient training and Error Feedback (DESIGN.md section 1) need each optimizer's update

    (u_t, s_{t+1}) = O(g, s_t, x_t),      x_{t+1} = x_t - u_t

as a tensor *before* it is applied, with ``u_t`` holding everything the step subtracts (learning rate,
shape scaling, decoupled weight decay). No library exposes that, so every optimizer of the project is an
:class:`UpdateOptimizer`: a standard ``torch.optim.Optimizer`` (param_groups, LR schedulers,
``state_dict`` with the standard key names) whose subclasses implement one method,
:meth:`UpdateOptimizer._group_updates`, that returns the updates of one param group and advances its state
without touching the parameters or their ``.grad``. ``step()`` is then just
``apply_updates(params, compute_updates())``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["UpdateOptimizer", "apply_updates", "check_betas", "check_nonneg"]


def check_nonneg(name: str, value: float) -> None:
    """Raise the ValueError the project uses for a hyperparameter that must be >= 0."""
    if isinstance(value, Tensor):
        value = float(value)
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def check_betas(name: str, betas: Sequence[float]) -> None:
    """Raise a ValueError unless every coefficient lies in [0, 1)."""
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid {name}[{i}]: {beta} (must be in [0, 1))")


@torch.no_grad()
def apply_updates(params: Sequence[Tensor], updates: Sequence[Tensor | None], *, alpha: float = 1.0) -> None:
    """``x <- x - alpha * u`` for every parameter whose update is not None.

    Updates may be in a wider dtype than the parameters (Muon's are fp32 for bf16 weights); they are cast
    on the way in, so the rounding happens once, at the write.
    """
    pairs = [(p, u) for p, u in zip(params, updates, strict=True) if u is not None]
    if not pairs:
        return
    ps = [p for p, _ in pairs]
    us = [u if u.dtype == p.dtype else u.to(p.dtype) for p, u in pairs]
    torch._foreach_add_(ps, us, alpha=-alpha)


class UpdateOptimizer(torch.optim.Optimizer):
    """Base class: an optimizer whose step is ``x <- x - u`` with ``u`` computable on its own.

    Subclasses validate hyperparameters in ``__init__`` (``ValueError`` naming the parameter and value),
    keep state under the standard torch names (``step`` as a 0-d float tensor, ``exp_avg``,
    ``exp_avg_sq``, ``momentum_buffer``, ...), and implement :meth:`_group_updates`.
    """

    def params(self) -> list[Tensor]:
        """All parameters, flattened over param_groups in order: the order of :meth:`compute_updates`."""
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def compute_updates(self) -> list[Tensor | None]:
        """Advance the state by one step and return ``u_t`` for every parameter (None where ``.grad`` is None).

        Reads ``p.grad`` and ``p``; writes neither. The list is aligned with :meth:`params`.
        """
        updates: list[Tensor | None] = []
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in live):
                raise ValueError("sparse gradients are not supported")
            group_updates = iter(self._group_updates(group, live, [p.grad for p in live]) if live else [])
            updates.extend(next(group_updates) if p.grad is not None else None for p in group["params"])
        return updates

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        apply_updates(self.params(), self.compute_updates())
        return loss

    def _group_updates(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        """Return the updates of one param group (same order as ``params``) and advance its state.

        ``params`` and ``grads`` are read-only here. The returned tensors must be fresh (not aliases of
        state that a later step mutates), because delay and Error Feedback wrappers keep them.
        """
        raise NotImplementedError
