"""Delayed-gradient training: weight stash, Error Feedback, Taylor, Nesterov, weight prediction, synchronous start / cooldown."""

from bubblefree.delay.delayed import CORRECTIONS, DelayedOptimizer, build_delayed, correction_buffers
from bubblefree.schedules.delays import parameter_delays

__all__ = ["CORRECTIONS", "DelayedOptimizer", "build_delayed", "correction_buffers", "parameter_delays"]
