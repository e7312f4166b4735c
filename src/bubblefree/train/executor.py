"""The one seam between the training loop and how a step is executed.

The loop (``bubblefree.train.loop``) is the same for every runtime; it runs one :class:`Executor`: the
single-process simulation (``bubblefree.train.sim``) or, given by the launcher, the torch.distributed
pipeline (``bubblefree.distributed``). Both run the same schedule delays, optimizer and corrections.

In a distributed run every process runs the same loop and makes the same calls in the same order (they are
collective: a step, an evaluation, a checkpoint's ``state_dict``); ``is_writer`` says which single process
writes the run's outputs (files, prints, progress bar).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

__all__ = ["Executor", "StepStats"]


class StepStats(NamedTuple):
    loss: float
    """Mean training cross-entropy of the step's microbatches."""
    grad_norm: float
    """Gradient norm before clipping (over all stages)."""
    aux_loss: float = 0.0
    """MoE load-balancing loss of the step (0 for dense models)."""
    lr: float = math.nan
    """Learning rate of the step (first param group: the matrix rule's for Muon and MARS)."""
    busy_s: tuple[float, ...] = ()
    """Distributed runs, per stage: seconds of forward, backward and update work since the stage's last step."""
    window_s: tuple[float, ...] = ()
    """Distributed runs, per stage: seconds inside ``train_step`` since the stage's last step (``busy_s`` over it
    is the stage's busy share)."""
    peak_bytes: tuple[int | None, ...] = ()
    """Distributed runs, per stage: peak memory so far (``distributed.memory``; None where not measurable)."""


class Executor(Protocol):
    is_writer: bool
    """True on the one process that writes the run's outputs (the simulation; global rank 0)."""

    def train_step(self, step: int, lr_scale: float) -> StepStats | None:
        """Run optimizer step ``step`` (0-based) at ``lr_scale`` times the peak learning rate.

        Returns the step's statistics on the process that logs (None on the others)."""
        ...

    def evaluate(self, split: str = "val") -> float | None:
        """Loss at the current weights on the validation windows (``split`` "test": the test windows of
        ``train.test_split``); None on processes that do not log."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: weights, optimizer, delay and correction state (on the
        writer; every process must call it)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned on the writer (every process passes the whole state)."""
        ...

    def close(self) -> None: ...
