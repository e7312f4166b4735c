"""Taylor compensation of the stale gradient: DC-ASGD (Zheng et al. 2017, "Asynchronous Stochastic Gradient
Descent with Delay Compensation").

The optimizer sees ``g + lambda * g * g * (x_t - x_{t-d})`` (elementwise, ``lambda > 0``) instead of the stale
gradient ``g``. Adaptive (their DC-ASGD-a): ``lambda_t = lambda / sqrt(v_t + eps)`` with the running mean square
``v_t = 0.95 v_{t-1} + 0.05 g * g`` of the stale gradient (``v = 0`` before the first asynchronous step,
``eps = 1e-7``; the paper's constants). ``v`` is not in-flight state: it carries over the switches.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from bubblefree.delay.correction import Buffer, Correction, Stash

__all__ = ["DC_ASGD_A_DECAY", "DC_ASGD_A_EPS", "Taylor"]

# DC-ASGD-a's mean-square decay and epsilon (Zheng et al. 2017, section 4: MeanSquare(t) = m MeanSquare(t-1) +
# (1-m) g^2, m = 0.95, epsilon = 1e-7).
DC_ASGD_A_DECAY = 0.95
DC_ASGD_A_EPS = 1e-7


class Taylor(Correction):
    """``"taylor"`` (module docstring): ``taylor_lambda > 0``; ``taylor_adaptive`` for DC-ASGD-a."""

    hparams: ClassVar[dict[str, Any]] = {"taylor_lambda": 0.0, "taylor_adaptive": False}
    # DC-ASGD-a's v of a delayed parameter (made at its first compensated gradient; kept over the switches)
    buffers = (Buffer("mean_square", "mean_square", only_with="taylor_adaptive"),)
    memory_key = "taylor"
    mean_square: list[Tensor | None]

    def __init__(self, params: list[Tensor], delays: list[int], *, taylor_lambda: float,
                 taylor_adaptive: bool) -> None:
        if taylor_lambda == 0:
            raise ValueError("Invalid taylor_lambda: 0.0 (correction 'taylor' needs lambda > 0; lambda 0 is the "
                             "plain delay, correction 'none')")
        super().__init__(params, delays)
        self.lam, self.adaptive = float(taylor_lambda), taylor_adaptive

    @classmethod
    def check(cls, hparams: dict[str, Any]) -> None:
        if not 0.0 <= hparams["taylor_lambda"] < float("inf"):
            raise ValueError(f"Invalid taylor_lambda: {hparams['taylor_lambda']} (must be >= 0)")
        if not isinstance(hparams["taylor_adaptive"], bool):
            raise ValueError(f"Invalid taylor_adaptive: {hparams['taylor_adaptive']!r} (must be a bool)")

    def before_update(self, core: Stash, delayed: list[int], slot: list[int]) -> None:
        """``g <- g + lambda_t * g * g * (x_t - x_{t-d})`` in place."""
        live = [i for i in delayed if core.params[i].grad is not None]
        if not live:
            return
        grads = [core.params[i].grad for i in live]
        diff = torch._foreach_sub([core.params[i] for i in live], [core.stash[i][slot[i]] for i in live])
        torch._foreach_mul_(diff, grads)
        if self.adaptive:  # lambda_t = lambda / sqrt(v_t + eps), v_t the running mean square of g
            ms = []
            for i, g in zip(live, grads):
                if self.mean_square[i] is None:
                    self.mean_square[i] = torch.zeros_like(g)
                ms.append(self.mean_square[i])
            torch._foreach_mul_(ms, DC_ASGD_A_DECAY)
            torch._foreach_addcmul_(ms, grads, grads, value=1.0 - DC_ASGD_A_DECAY)
            denom = torch._foreach_add(ms, DC_ASGD_A_EPS)
            torch._foreach_sqrt_(denom)
            torch._foreach_div_(diff, denom)
        torch._foreach_addcmul_(grads, diff, grads, value=self.lam)
