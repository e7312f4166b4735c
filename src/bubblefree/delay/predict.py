"""Weight prediction (PipeMare-style linear extrapolation): take the stale gradient at the weights moved along
their last change.

The gradient of step ``t`` is taken at ``x^_t = x_j + alpha * d * (x_j - x_{j-1})`` with ``j = max(t-d, a)`` and
``x_{a-1} := x_a`` (no history at the fill), instead of at ``x_j``: the newest weights the stage holds, moved
``d`` steps further along their last change, the point they will have reached when the gradient is applied.
``alpha`` scales the step (0 would be the plain delay). ``x_{t+1} = x_t - u_t``.

Memory: each stash slot holds the predicted point ``x^`` instead of ``x_j`` (written when ``x_j`` enters the
slot), plus one buffer per parameter for the last change ``x_j - x_{j-1}``, dropped when the pipeline drains.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from bubblefree.delay.correction import Buffer, Correction, Stash

__all__ = ["WeightPrediction"]


class WeightPrediction(Correction):
    """``"predict"`` (module docstring): ``predict_scale`` is ``alpha > 0`` (1 extrapolates linearly)."""

    hparams: ClassVar[dict[str, Any]] = {"predict_scale": 1.0}
    buffers = (Buffer("change", "change"),)  # x_j - x_{j-1} of the newest j, for a delayed parameter
    memory_key = "predict"
    change: list[Tensor | None]

    def __init__(self, params: list[Tensor], delays: list[int], *, predict_scale: float) -> None:
        super().__init__(params, delays)
        self.alpha = float(predict_scale)

    @classmethod
    def check(cls, hparams: dict[str, Any]) -> None:
        if not 0.0 < hparams["predict_scale"] < float("inf"):
            raise ValueError(f"Invalid predict_scale: {hparams['predict_scale']} (must be > 0; 0 is the plain delay)")

    def fill(self, i: int, p: Tensor, d: int) -> None:
        self.change[i] = torch.zeros_like(p)

    def drain(self, i: int, p: Tensor) -> None:
        self.change[i] = None

    def after_update(self, core: Stash, delayed: list[int], delays: list[int], slot: list[int]) -> None:
        """Slot ``t % d`` holds ``x_t``: make it ``x^_{t+d} = x_t + alpha d (x_t - x_{t-1})`` and remember
        ``x_{t+1} - x_t`` for the next prediction."""
        for i in delayed:
            x_t = core.stash[i][slot[i]]
            change = torch.sub(core.params[i].detach(), x_t)
            x_t.add_(self.change[i], alpha=self.alpha * delays[i])
            self.change[i] = change

    def predict_live(self, i: int, p: Tensor, d: int) -> Tensor | None:
        if self.change[i] is None:
            return None
        return torch.add(p.detach(), self.change[i], alpha=self.alpha * d)  # x^ = x_t + alpha d (x_t - x_{t-1})
