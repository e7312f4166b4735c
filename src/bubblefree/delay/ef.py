"""Error Feedback (arXiv 2606.30634, docs/spec.md section 5): add back the update of ``d`` steps ago.

``x_{t+1} = x_t - u_t - beta (u_t - u_{t-d})`` with ``u_j = 0`` for ``j < a`` (``a`` the step the current
asynchronous phase began at). Invariant: ``z_t = x_t + beta * sum_{j=t-d}^{t-1} u_j`` obeys ``z_{t+1} = z_t - u_t``.
At the cooldown the pending corrections are **flushed**, ``x <- x + beta * sum_{j=t-d}^{t-1} u_j`` (``x <- z``):
every update then counts exactly once (``x_T = x_0 - sum_t u_t`` for ``beta = 1``) instead of leaving ``beta``
times the last ``d`` updates applied twice; it is local to each stage, so a real pipeline does the same.

Memory: per parameter with ``d > 0``, a ring of ``d`` updates (``u_j`` in slot ``j % d``, the optimizer's fresh
update tensors kept by reference); ``u_{t-d}`` sits in slot ``t % d``, where ``u_t`` goes. ``x_{t+1}`` is written
in place over ``u_{t-d}``, which dies at this step (one extra read of it over the plain delay).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from bubblefree.delay.correction import Buffer, Correction, can_hold

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Correction):
    """``"ef"`` (module docstring). ``ef_beta`` in ``[0, 1]``: 1 is the paper's rule, 0 the plain delay; above 1
    the weights would run ahead of the virtual iterate by more than the updates in flight."""

    hparams: ClassVar[dict[str, Any]] = {"ef_beta": 1.0}
    needs_updates = True
    buffers = (Buffer("rings", "ef", kind="ring"),)  # the d updates in flight of a delayed parameter
    memory_key = "ef"
    rings: list[list[Tensor | None] | None]

    def __init__(self, params: list[Tensor], delays: list[int], *, ef_beta: float) -> None:
        super().__init__(params, delays)
        self.beta = float(ef_beta)

    @classmethod
    def check(cls, hparams: dict[str, Any]) -> None:
        if not 0.0 <= hparams["ef_beta"] <= 1.0:
            raise ValueError(f"Invalid ef_beta: {hparams['ef_beta']} (must be in [0, 1])")

    def fill(self, i: int, p: Tensor, d: int) -> None:
        self.rings[i] = [None] * d  # u_j = 0 for j < a

    def drain(self, i: int, p: Tensor) -> None:
        for u in self.rings[i] or []:  # x <- z
            if u is not None:
                p.add_(u.to(p.dtype), alpha=self.beta)
        self.rings[i] = None

    def write(self, i: int, p: Tensor, u: Tensor | None, stale: Tensor, slot: int) -> tuple[Tensor, list]:
        # x_{t+1} = x_t - (1 + beta) u_t + beta u_{t-d}, over u_{t-d} where it can (the same operations wherever
        # they write: bit-exact resume, tests).
        beta, ring = self.beta, self.rings[i]
        old = ring[slot]
        if u is None:
            new = stale.copy_(p)
            if old is not None:
                new.add_(old.to(p.dtype), alpha=beta)  # u_t = 0: x_{t+1} = x_t + beta u_{t-d}
        elif old is not None:
            new = torch.add(p, old.to(p.dtype), alpha=beta, out=old if can_hold(old, p) else stale)
            new.add_(u.to(p.dtype), alpha=-(1.0 + beta))
        else:
            new = torch.add(p, u.to(p.dtype), alpha=-(1.0 + beta), out=stale)
        ring[slot] = u
        return new, [stale, old]
