"""Delayed-gradient training: the weight stash, the table of corrections (none, Error Feedback, Taylor, weight
prediction, update EMA), synchronous start / cooldown."""

from bubblefree.delay.correction import Correction
from bubblefree.delay.corrections import CORRECTIONS, correction_buffers
from bubblefree.delay.delayed import DelayedOptimizer, build_delayed, merge_named_states, name_state, relayout_refusal
from bubblefree.schedules.delays import parameter_delays

__all__ = ["CORRECTIONS", "Correction", "DelayedOptimizer", "build_delayed", "correction_buffers",
           "merge_named_states", "name_state", "parameter_delays", "relayout_refusal"]
