"""The one table of delay corrections: ``delay.correction`` name -> :class:`~bubblefree.delay.correction.Correction`.

Config validation (``config.CORRECTIONS``, checked against this table by a test), the wrapper
(:class:`~bubblefree.delay.delayed.DelayedOptimizer`), the generic tests and docs/delay.md read it. Adding a
correction is one module with a subclass and one line here.
"""

from __future__ import annotations

from bubblefree.delay.correction import Correction
from bubblefree.delay.ef import ErrorFeedback
from bubblefree.delay.predict import WeightPrediction
from bubblefree.delay.taylor import Taylor
from bubblefree.delay.update_ema import UncorrectedUpdateEMA, UpdateEMA

__all__ = ["CORRECTIONS", "HPARAMS", "correction_buffers"]

CORRECTIONS: dict[str, type[Correction]] = {
    "none": Correction,
    "ef": ErrorFeedback,
    "taylor": Taylor,
    "nesterov": UncorrectedUpdateEMA,
    "predict": WeightPrediction,
    "update-ema": UpdateEMA,
}
"""Values of ``delay.correction``."""

HPARAMS: dict[str, object] = {k: v for cls in CORRECTIONS.values() for k, v in cls.hparams.items()}
"""Every correction's hyperparameters with their defaults: the keyword arguments of ``DelayedOptimizer``."""


def correction_buffers(correction: str, delay: int, **hparams: object) -> int:
    """Parameter-sized buffers ``correction`` keeps for one parameter of delay ``delay`` in an asynchronous phase
    (:meth:`~bubblefree.delay.correction.Correction.copies` of its declared buffers), beside the ``delay`` stashed
    versions."""
    return CORRECTIONS[correction].copies(delay, **hparams)
