"""Fault drills: ``BUBBLEFREE_FAULT=RANK:STEP:raise|kill`` makes that rank fail when it starts that step
(``STEP`` may be ``start``: before the process group is joined). docs/reliability.md runs them."""

from __future__ import annotations

import os
import signal

__all__ = ["maybe_fault"]


def maybe_fault(rank: int, *, when: str | int) -> None:
    """Raise (or SIGKILL this process) if ``BUBBLEFREE_FAULT`` names this rank and ``when``."""
    spec = os.environ.get("BUBBLEFREE_FAULT", "")
    if not spec:
        return
    f_rank, f_step, kind = spec.split(":")
    if int(f_rank) == rank and f_step == str(when):
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault at step {when}")
