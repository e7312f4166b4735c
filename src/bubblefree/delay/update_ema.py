"""An outer exponential moving average of the inner optimizer's finished updates (``"update-ema"``, and
``"nesterov"``, its first form without bias correction).

The live parameters hold ``y_t``; with ``gamma = nesterov_gamma``::

    b_{t+1} = gamma b_t + (1 - gamma) u_t,      b_0 = 0
    y_{t+1} = y_t - (1 - gamma) u_t - gamma b_{t+1} / c_{t+1}

``"nesterov"`` has ``c = 1``; ``"update-ema"`` divides by the bias correction ``c_{t+1} = 1 - gamma^n`` (``n``
the updates the EMA has taken for that parameter), so its first step is the full ``u_1``, where the
uncorrected form takes ``(1 - gamma^2) u_1`` (2 % of it at ``gamma = 0.99``) and reaches 64 % of a steady
update only after 100 steps.

With SGD inside (``u = lr g``) and the gradient taken at the stashed ``y_{t-d}``, ``"nesterov"`` is the
delayed Nesterov rule ``w_{t+1} = w_t + m_t - (1-gamma) u_t`` with ``m_t = gamma (w_t - w_{t-1})`` and
``y_t = w_t + m_t`` written at the level of updates. Around an adaptive optimizer (AdamW, Muon) it is *not*
Ajanthan et al.'s (2025) method: theirs has no wrapper, it is NAdamW (``optim.name = "nadamw"``, beta1 0.99)
on the stale gradients with ``correction = "none"``, its look-ahead being NAdam's bias-corrected first moment.
Here the EMA is stacked on top of the inner optimizer's own momentum, and the two compound.

``b`` is not in-flight state: it carries over the switches. It covers every parameter, delayed or not (one
buffer each).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from bubblefree.delay.correction import Correction, Stash, nbytes, own

__all__ = ["UncorrectedUpdateEMA", "UpdateEMA"]


class UpdateEMA(Correction):
    """``"update-ema"`` (module docstring): the bias-corrected EMA of the updates, ``nesterov_gamma`` in ``[0, 1)``."""

    hparams: ClassVar[dict[str, Any]] = {"nesterov_gamma": 0.99}
    needs_updates = True
    state_keys = ("momentum", "momentum_count")
    memory_key = "nesterov"  # the key memory reports have used since the first form
    bias_correction: ClassVar[bool] = True

    def __init__(self, params: list[Tensor], delays: list[int], *, nesterov_gamma: float) -> None:
        super().__init__(params, delays)
        self.gamma = float(nesterov_gamma)
        self.momentum: list[Tensor | None] = [None] * len(params)
        self.count = [0] * len(params)  # n: the updates b has taken

    @classmethod
    def buffers(cls, delay: int, **hparams: Any) -> int:
        return 1  # b, for every parameter (delayed or not)

    @classmethod
    def check(cls, hparams: dict[str, Any]) -> None:
        if not 0.0 <= hparams["nesterov_gamma"] < 1.0:
            raise ValueError(f"Invalid nesterov_gamma: {hparams['nesterov_gamma']} (must be in [0, 1))")

    def apply(self, core: Stash, updates: list[Tensor | None], delays: list[int],
              slot: list[int]) -> list[Tensor]:
        gamma = self.gamma
        for i, (p, u, d) in enumerate(zip(core.params, updates, delays)):
            b = self.momentum[i]
            if u is not None:  # b_{t+1} = gamma b_t + (1 - gamma) u_t   (b_0 = 0)
                b = u.mul(1.0 - gamma) if b is None else b.mul_(gamma).add_(u, alpha=1.0 - gamma)
                self.momentum[i] = b
                self.count[i] += 1
            new = p if d == 0 else core.stash[i][slot[i]]
            if d > 0:
                new.copy_(p)
            if u is not None:  # y_{t+1} = y_t - (1 - gamma) u_t - gamma b_{t+1} / c_{t+1}
                new.add_(u.to(p.dtype), alpha=-(1.0 - gamma))
            if b is not None:
                new.add_(b.to(p.dtype), alpha=-gamma / (1.0 - gamma ** self.count[i] if self.bias_correction else 1.0))
            if d > 0:
                core.rotate(i, slot[i], new)
        return [u for u in updates if u is not None]  # b holds its own copy

    def memory_bytes(self) -> int:
        return nbytes(self.momentum)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"momentum": {i: b for i, b in enumerate(self.momentum) if b is not None}}
        if self.bias_correction:
            state["momentum_count"] = dict(enumerate(self.count))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum = [None] * len(self.params)
        for i, b in state.get("momentum", {}).items():
            self.momentum[int(i)] = own(b, self.params[int(i)])
        self.count = [0] * len(self.params)
        for i, n in state.get("momentum_count", {}).items():
            self.count[int(i)] = int(n)


class UncorrectedUpdateEMA(UpdateEMA):
    """``"nesterov"``: :class:`UpdateEMA` without the bias correction (``c = 1``), as the project first ran it;
    the name is kept so that those runs keep their ids and meaning."""

    bias_correction = False
