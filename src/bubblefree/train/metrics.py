"""Run metrics: ``metrics.jsonl`` (one JSON object per logged step), optional TensorBoard, a progress bar and
the loss plot.

Every line of ``metrics.jsonl`` holds ``step`` (optimizer steps done), ``tokens`` (training tokens seen),
``loss`` (that step's training cross-entropy), ``lr``, ``tokens_per_s`` (over the logging window, evaluation
time excluded), ``grad_norm`` (before clipping), and ``val_loss`` on evaluation steps (docs/training.md).
Distributed runs add ``stage_busy`` (per stage, the busy share over the logging window), ``bubble`` (the mean
idle share) and ``stage_peak_bytes`` (per stage, peak memory so far) (docs/runtime.md).
The file is line-buffered and flushed per line, so a killed run keeps everything logged so far.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bubblefree.errors import UserError

__all__ = ["METRICS_FILE", "BusyWindow", "MetricsWriter", "metrics_record", "plot_losses", "progress_bar",
           "read_metrics", "tensorboard_writer"]

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file, for reading results: a line that is not a record (a torn last line
    from a killed run, say) is skipped. A resume reads the file strictly instead (``train.runfiles``)."""
    records = []
    for line in Path(path).read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def tensorboard_writer() -> type:
    """``torch.utils.tensorboard.SummaryWriter``, or a UserError when the optional extra is not installed."""
    try:  # imported here: tensorboard is an optional extra
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("Invalid log.tensorboard: true needs the tensorboard package "
                        "(pip install 'bubblefree[tensorboard]')") from None
    return SummaryWriter


class MetricsWriter:
    """Append records to ``out_dir/metrics.jsonl`` (and TensorBoard when asked).

    ``resume_step``: when continuing from a checkpoint taken after ``resume_step`` steps, the file is first
    rewritten to hold ``keep``: its lines up to that step, as the resume read them (strictly, before anything
    was written: ``train.runfiles``), byte for byte. The records past that step belong to the part of the run
    that is about to be recomputed identically, so the file never holds a step twice.
    """

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = False, resume_step: int | None = None,
                 keep: Sequence[str] = ()):
        self.path = Path(out_dir) / METRICS_FILE
        if resume_step is not None:
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(keep), encoding="utf-8")
            os.replace(tmp, self.path)
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            self._tb = tensorboard_writer()(str(Path(out_dir) / "tensorboard"), purge_step=resume_step)

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (JSON line, flushed; numeric fields also to TensorBoard under ``train/``)."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])
                elif isinstance(value, list):  # one number per stage: train/stage_busy/0, train/stage_busy/1, ...
                    for i, v in enumerate(value):
                        self._tb.add_scalar(f"train/{key}/{i}", v, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def progress_bar(*, total: int, initial: int, enabled: bool):
    """A tqdm bar over optimizer steps; disabled when ``enabled`` is false or stderr is not a terminal."""
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                disable=not enabled or not sys.stderr.isatty())


def plot_losses(metrics_path: str | Path, png_path: str | Path, *, title: str = "") -> None:
    """Plot training and validation loss against training tokens into a PNG (matplotlib, no display needed)."""
    # Imported here: matplotlib costs half a second, which only the run's writer spends, once, at the end.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["tokens"], r["loss"]) for r in records if math.isfinite(r.get("loss", math.nan))]
    val = [(r["tokens"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", lw=1, alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.5)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = Path(png_path).with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png_path)


class BusyWindow:
    """Per-stage busy share and the measured bubble over a logging window (distributed runs; docs/runtime.md).

    A stage's busy share is its forward, backward and update seconds over its seconds inside ``train_step``,
    summed over the window's steps; the bubble is the mean idle share ``1 - busy`` over the stages, the
    timeline simulator's idle fraction (``schedules.timeline``) measured on the run."""

    def __init__(self) -> None:
        self.busy: list[float] = []
        self.window: list[float] = []

    def add(self, stats: Any) -> None:
        if stats.busy_s:
            self.busy = [a + b for a, b in zip(self.busy or [0.0] * len(stats.busy_s), stats.busy_s)]
            self.window = [a + b for a, b in zip(self.window or [0.0] * len(stats.window_s), stats.window_s)]

    def pop(self, stats: Any) -> dict[str, Any]:
        """The record's fields (none for the simulation), and a new window."""
        out: dict[str, Any] = {}
        if self.window and all(w > 0 for w in self.window):
            shares = [b / w for b, w in zip(self.busy, self.window)]
            out = {"stage_busy": shares, "bubble": 1.0 - sum(shares) / len(shares)}
        if stats.peak_bytes and all(b is not None for b in stats.peak_bytes):
            out["stage_peak_bytes"] = list(stats.peak_bytes)
        self.busy, self.window = [], []
        return out


def metrics_record(cfg: Any, done: int, stats: Any, *, tokens: int, tokens_per_s: float, skipped: int,
            busy: dict[str, Any], losses: dict[str, float]) -> dict[str, Any]:
    """One line of metrics.jsonl: the step's statistics, the window's busy shares, and ``losses`` where the
    step evaluated (the test loss only where the run holds a test split)."""
    record = {"step": done, "tokens": tokens, "loss": stats.loss, "lr": stats.lr, "tokens_per_s": tokens_per_s,
              "grad_norm": stats.grad_norm}
    if stats.aux_loss:
        record["aux_loss"] = stats.aux_loss
    if cfg.nonfinite == "skip":
        record["skipped"] = skipped
    record.update(busy)
    if losses:
        record["val_loss"] = losses["val_loss"]
        if cfg.test_split:
            record["test_loss"] = losses["test_loss"]
    return record
