"""An outer exponential moving average of the inner optimizer's finished updates (``"update-ema"``, and
``"nesterov"``, its first form without bias correction).

The live parameters hold ``y_t``; with ``gamma = ema_beta`` (``delay.ema_beta``, formerly ``nesterov_gamma``)::

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

``"update-ema"`` is the method's momentum, moved outside the delay, so it runs around a momentum-free
optimizer: the config refuses it unless ``optim.momentum = 0`` (AdamW beta1 = 0, Muon mu = 0, Lion's
beta2 = 0, which makes it signSGD), and refuses Adan, whose average of gradient differences stays at any
knob; ``DelayedOptimizer`` built directly refuses the same (``optim.registry.own_momentum``). With the inner
momentum ``beta`` left on, ``u_t`` would already be an average of past gradients and ``b`` an average of that
average: the two momenta compound, a gradient reaching the weights through two EMAs in series whose mean lags
add (``beta / (1 - beta) + gamma / (1 - gamma)`` steps, 9 + 99 at 0.9 and 0.99).
``"nesterov"`` keeps its first form, around the optimizer at any momentum (the runs made with it keep their
ids and numbers). Muon's and MARS's AdamW groups (embeddings, head, norms) keep beta1 0.9 whatever the knob:
there the two momenta still compound.

Around AdamW with ``beta1 = 0`` the inner update is ``u_t = lr_t (g_t / (sqrt(v^_t) + eps) + wd y_t)``,
``v^_t`` Adam's bias-corrected second moment, and with ``m^_{t+1} = b_{t+1} / c_{t+1}`` (the bias-corrected
mean of the ``u_j``) the rule reads::

    y_{t+1} = y_t - (1 - gamma) u_t - gamma m^_{t+1}

a Nesterov-form Adam: NAdam's step ``lr [(1 - beta1) g_t / (1 - beta1^t) + beta1 m^_t] / (sqrt(v^_t) + eps)``
has the same shape with ``gamma = beta1``. NAdam averages the raw gradients and divides the average by
today's ``sqrt(v^_t)``; here each gradient is divided by its own step's ``sqrt(v^_j)`` (and scaled by its own
step's rate, its weight decay included) before the averaging: the normalisation comes before the averaging.
Around Muon with ``mu = 0`` the averaged updates are the orthogonalised gradients, likewise. It is still not
Ajanthan et al.'s method: that is NAdamW itself with ``correction = "none"`` (above), which averages before
it normalises and whose ``mu_t`` follows NAdam's schedule.

``b`` is not in-flight state: it carries over the switches. It covers every parameter, delayed or not (one
buffer each).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from bubblefree.delay.correction import Buffer, Correction, Stash

__all__ = ["UncorrectedUpdateEMA", "UpdateEMA"]


class UpdateEMA(Correction):
    """``"update-ema"`` (module docstring): the bias-corrected EMA of the updates, ``ema_beta`` in ``[0, 1)``,
    around an optimizer without momentum of its own (``DelayedOptimizer`` refuses one that has)."""

    hparams: ClassVar[dict[str, Any]] = {"ema_beta": 0.99}
    needs_updates = True
    # b, for every parameter (delayed or not), and n, the updates it has taken (the bias correction's exponent)
    buffers = (Buffer("momentum", "momentum", held="every"), Buffer("count", "momentum_count", kind="count"))
    memory_key = "nesterov"  # the key memory reports have used since the first form
    owns_momentum = True
    bias_correction: ClassVar[bool] = True
    momentum: list[Tensor | None]
    count: list[int]

    def __init__(self, params: list[Tensor], delays: list[int], *, ema_beta: float) -> None:
        super().__init__(params, delays)
        self.gamma = float(ema_beta)

    @classmethod
    def check(cls, hparams: dict[str, Any]) -> None:
        if not 0.0 <= hparams["ema_beta"] < 1.0:
            raise ValueError(f"Invalid ema_beta: {hparams['ema_beta']} (must be in [0, 1))")

    def apply(self, core: Stash, updates: list[Tensor | None], delays: list[int],
              slot: list[int]) -> list[Tensor]:
        gamma = self.gamma
        for i, (p, u, d) in enumerate(zip(core.params, updates, delays)):
            b = self.momentum[i]
            if u is not None:  # b_{t+1} = gamma b_t + (1 - gamma) u_t   (b_0 = 0)
                b = u.mul(1.0 - gamma) if b is None else b.mul_(gamma).add_(u, alpha=1.0 - gamma)
                self.momentum[i] = b
                if self.bias_correction:
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


class UncorrectedUpdateEMA(UpdateEMA):
    """``"nesterov"``: :class:`UpdateEMA` without the bias correction (``c = 1``) and around the optimizer at any
    momentum, as the project first ran it; the name is kept so that those runs keep their ids and meaning."""

    buffers = UpdateEMA.buffers[:1]  # no count: nothing divides by a bias correction
    owns_momentum = False
    bias_correction = False
