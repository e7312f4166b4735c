"""Delayed-gradient training: weight stash, Error Feedback, Taylor, Nesterov, synchronous start / cooldown."""

from bubblefree.delay.delayed import CORRECTIONS, DelayedOptimizer
from bubblefree.schedules.delays import parameter_delays

__all__ = ["CORRECTIONS", "DelayedOptimizer", "parameter_delays"]
