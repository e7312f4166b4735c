"""Delayed-gradient training: weight stash, Error Feedback, Taylor, Nesterov, weight prediction, synchronous start / cooldown."""

from bubblefree.delay.delayed import (CORRECTIONS, DelayedOptimizer, build_delayed, merge_named_states, name_state,
                                      relayout_refusal)
from bubblefree.schedules.delays import parameter_delays

__all__ = ["CORRECTIONS", "DelayedOptimizer", "build_delayed", "merge_named_states", "name_state", "parameter_delays",
           "relayout_refusal"]
