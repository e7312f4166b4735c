"""Stopping every rank of a pipeline run at the same step boundary when any of them is signalled.

Ranks finish a step at different times and see a signal at different steps, so the stop is agreed through
the process group's key-value store (no collective in the steady state): a signalled rank posts a request;
global rank 0, the last rank to finish every step, answers it with the step to stop after, ``its step +
stages + 1``, far enough ahead that no rank has passed it (a rank runs at most ``stages`` steps ahead of
rank 0 in a 1F1B pipeline). Every rank checks the store once per step (a key lookup, microseconds on one
machine) and stops after that step, where the loop takes its checkpoint.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["StopAgreement"]

_REQUEST, _STOP_AT = "bubblefree/stop-request", "bubblefree/stop-at"


class StopAgreement:
    """The :class:`~bubblefree.train.loop.StopRule` of a distributed run: ``should_stop(done, signalled)`` is
    True on every rank after the same step; ``finished()``, after the checkpoint, waits for every rank."""

    def __init__(self, stages: int) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.margin = dist.get_rank(), stages + 1
        self.stop_at: int | None = None
        self.posted = False

    def should_stop(self, done: int, signalled: bool) -> bool:
        if signalled and not self.posted:
            self.store.set(_REQUEST, "1")
            self.posted = True
        if self.stop_at is None:
            if self.rank == 0:
                if self.posted or self.store.check([_REQUEST]):
                    self.stop_at = done + self.margin
                    self.store.set(_STOP_AT, str(self.stop_at))
            elif self.store.check([_STOP_AT]):
                self.stop_at = int(self.store.get(_STOP_AT))
                if done > self.stop_at:  # cannot happen in a pipeline (module docstring); never stop apart
                    raise RuntimeError(f"rank {self.rank} is at step {done}, past the agreed stop {self.stop_at}")
        return self.stop_at is not None and done == self.stop_at

    def finished(self) -> None:
        """Wait for every rank after the stop's checkpoint, so that no rank's exit ends the writer's save."""
        dist.barrier()
