"""Per-rank trace of every forward, backward and update: JSON lines with wall-clock start and end.

One file per rank, ``<run>/trace/rank<r>.jsonl``; each line is
``{"rank", "replica", "stage", "kind", "step", "unit", "start", "end"}`` with ``kind`` one of ``F``
(forward), ``B`` (backward), ``U`` (optimizer update), ``E`` (evaluation forward), and times in seconds
since the epoch (``time.time``), so ranks on one machine share a clock; a timeline subtracts the smallest
start. Lines are buffered and appended at every drain and at close; the file is created at the first
write (building an executor writes nothing, so a refused run folder is left untouched), and a resumed run
appends to it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["Tracer"]


class Tracer:
    """Spans of one rank's work, appended to ``path`` (nothing is recorded when ``path`` is None)."""

    def __init__(self, path: Path | None, *, rank: int, replica: int, stage: int):
        self.path = path
        self._ids = {"rank": rank, "replica": replica, "stage": stage}
        self._lines: list[str] = []
        self._busy = 0.0  # F, B, U seconds since the last window()
        self._elapsed = 0.0  # seconds inside running() since the last window(), the running part excluded
        self._since: float | None = None  # when the running part began (None: not inside running())

    @contextmanager
    def span(self, kind: str, *, step: int, unit: int = -1) -> Iterator[None]:
        start = time.time()
        yield
        if kind != "E":
            self._busy += time.time() - start
        if self.path is not None:
            self._lines.append(json.dumps({**self._ids, "kind": kind, "step": step, "unit": unit,
                                           "start": start, "end": time.time()}))

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count the time inside as the rank's working window (one ``train_step``)."""
        self._since = time.time()
        try:
            yield
        finally:
            self._elapsed += time.time() - self._since
            self._since = None

    def window(self) -> tuple[float, float]:
        """``(busy seconds, window seconds)`` since the last call, and start a new window."""
        now = time.time()
        elapsed = self._elapsed + (now - self._since if self._since is not None else 0.0)
        busy, self._busy, self._elapsed = self._busy, 0.0, 0.0
        if self._since is not None:
            self._since = now
        return busy, elapsed

    def flush(self) -> None:
        if self.path is not None and self._lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write("\n".join(self._lines) + "\n")
            self._lines.clear()
