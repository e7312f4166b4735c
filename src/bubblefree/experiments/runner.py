"""Run a list of experiment runs, one JSON per finished run, skipping runs whose JSON already exists.

A :class:`Run` is a :class:`~bubblefree.config.Config` with the tags the tables group by. Its id is
``<name>-<hash of the config>`` (both functions of the config alone), so two suites (or a sweep and a
baseline) that need the very same run share one result, and a changed config never reuses a stale one. A key
added to the config later enters the hash only away from its neutral value (:data:`NEUTRAL`), so results of
long suites survive new keys. ``<out>/runs/<id>.json`` holds the config, the
final validation loss, the validation and training curves, the wall time, the commit and the machine; it is
written atomically after the run, so an interrupted suite re-run skips exactly the finished runs. The
training folder of a run (``<out>/work/<id>``: config.toml, metrics.jsonl, loss.png, train.log) is kept
without its checkpoints; a partial one left by an interruption is discarded and the run starts over.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from bubblefree.config import RENAMED, Config, config_to_dict
from bubblefree.train import train
from bubblefree.train.metrics import METRICS_FILE, read_metrics

__all__ = ["NEUTRAL", "Run", "commit", "identity", "machine", "pending", "run_all", "run_id"]


@dataclass(frozen=True, kw_only=True)
class Run:
    """One training run of an experiment and the tags its suite's table groups it by."""

    config: Config
    variant: str
    """What the run is within its suite: ``sync``, ``async``, ``ef``, ``pipedream``, ``sweep`` ..."""

    x: float | None = None
    """The value of the swept quantity (learning rate, momentum, depth, ...), if any."""

    tags: dict[str, Any] = field(default_factory=dict)

    @property
    def optimizer(self) -> str:
        return self.config.optim.name

    @property
    def seed(self) -> int:
        return self.config.train.seed

    @property
    def name(self) -> str:
        """Readable part of the id, a function of the config only (so equal configs get equal ids)."""
        c = self.config
        correction = "" if c.delay.correction == "none" else f"-{c.delay.correction}"
        return f"{c.optim.name}-{c.pipeline.schedule}{c.pipeline.stages}{correction}-s{c.train.seed}"


# The config keys that existed when run ids were introduced: each is always part of the id.
_ORIGINAL_KEYS = frozenset(
    [f"model.{k}" for k in ("preset", "vocab_size")]
    + [f"data.{k}" for k in ("source", "tokenizer", "vocab_size", "cache_dir")]
    + [f"optim.{k}" for k in ("name", "lr", "momentum", "weight_decay", "adamw_lr", "max_precond_dim")]
    + [f"train.{k}" for k in ("steps", "batch_size", "seq_len", "seed", "warmup_frac", "min_lr_frac", "grad_clip",
                              "eval_every", "eval_batches", "log_every", "ckpt_every", "ckpt_keep", "device",
                              "dtype", "nonfinite", "threads")]
    + [f"pipeline.{k}" for k in ("schedule", "stages", "microbatches", "runtime")]
    + [f"delay.{k}" for k in ("correction", "ef_beta", "taylor_lambda", "sync_start_steps", "sync_cooldown_steps")]
)

NEUTRAL: dict[str, Any] = {
    "train.compile": False,
    "delay.taylor_adaptive": False,  # DC-ASGD-a: off is the plain Taylor rule
    "delay.ema_beta": 0.99,  # the value hard-coded before the key existed (as delay.nesterov_gamma)
    "delay.predict_scale": 1.0,  # acts only with delay.correction = predict, added with it
    "train.test_split": False,  # off: every evaluation window is validation, as before the key existed
    "optim.momentum_decay": 0.004,  # acts only with optim.name = nadamw, added with it
    "model.init_from": "",  # empty: the preset from a random init, as before the key existed
    "model.init_sha256": "",  # acts only with model.init_from, added with it
}
"""Every config key added after :data:`_ORIGINAL_KEYS`, with its *neutral* value: the value under which a run
computes exactly what it computed before the key existed. A key at its neutral value is left out of the id, so
adding a key never orphans finished results, while any other value (a change that affects training) gives a
new id. A new key must be entered here (a test checks that every key is one or the other)."""

_FIRST_NAMES = {new: old for old, new in RENAMED.items()}
"""A renamed key's name when runs were first hashed: it keeps that name in the id (``config.RENAMED``)."""


def identity(config: Config) -> dict[str, dict[str, Any]]:
    """The part of ``config`` a run's id hashes: every section but ``log`` (it changes nothing the run
    computes), without the keys that sit at their :data:`NEUTRAL` value, a renamed key under its first name."""
    out: dict[str, dict[str, Any]] = {}
    for section, table in config_to_dict(config).items():
        if section == "log":
            continue
        out[section] = {}
        for key, value in table.items():
            dotted = f"{section}.{key}"
            if dotted not in _ORIGINAL_KEYS and dotted not in NEUTRAL:
                raise KeyError(f"config key {dotted} has no neutral value in experiments.runner.NEUTRAL")
            if dotted in _ORIGINAL_KEYS or value != NEUTRAL[dotted]:
                out[section][_FIRST_NAMES.get(dotted, dotted).partition(".")[2]] = value
    return out


def run_id(run: Run) -> str:
    """``<name>-<first 10 hex digits of the sha256 of the config's identity>`` (:func:`identity`)."""
    digest = hashlib.sha256(json.dumps(identity(run.config), sort_keys=True).encode()).hexdigest()[:10]
    return f"{run.name}-{digest}"


@functools.cache
def commit() -> str:
    """The git commit of the source tree (``+dirty`` with uncommitted changes), or ``unknown``.

    Read once per process, at the first call (before the first run): the code a process runs is the code it
    imported, even if the tree moves on while a long suite runs."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line naming the machine: GPU or CPU model, cores, torch version."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else _cpu_name()
    return f"{platform.node()}: {device}, {os.cpu_count()} cores, torch {torch.__version__}"


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _execute(run: Run, work: Path, *, provenance: dict[str, str]) -> dict[str, Any]:
    """Train ``run`` in ``work`` (its printout to ``work/train.log``) and return its record."""
    if work.exists():  # left by an interrupted earlier attempt: a run either finishes or starts over
        shutil.rmtree(work)
    work.mkdir(parents=True)
    tic = time.perf_counter()
    with (work / "train.log").open("w") as log, contextlib.redirect_stdout(log):
        try:
            summary = train(run.config, out_dir=work / "run")
        except KeyboardInterrupt:  # not the run's "--resume" hint: a suite starts an unfinished run over
            raise KeyboardInterrupt() from None
    wall = time.perf_counter() - tic
    shutil.rmtree(work / "run" / "checkpoints", ignore_errors=True)  # megabytes each, never resumed
    records = read_metrics(work / "run" / METRICS_FILE)
    loss, test = summary["final_val_loss"], summary.get("final_test_loss")
    tested = {} if test is None else {
        "final_test_loss": test if math.isfinite(test) else None,
        "test_curve": [[r["step"], r["tokens"], r["test_loss"]] for r in records if "test_loss" in r]}
    return {
        "id": run_id(run), "config": config_to_dict(run.config),
        "final_val_loss": loss if math.isfinite(loss) else None,
        "val_curve": [[r["step"], r["tokens"], r["val_loss"]] for r in records if "val_loss" in r], **tested,
        "train_curve": [[r["step"], r["tokens"], r["loss"]] for r in records],
        "tokens_per_s": summary["tokens_per_s"], "wall_time_s": wall,
        "params": summary["params"], "params_non_embedding": summary["params_non_embedding"],
        "tokens_per_param": summary["tokens"] / summary["params"], **provenance,
    }


def pending(runs: Sequence[Run], out: str | Path) -> set[str]:
    """Ids of the runs in ``runs`` that have no JSON in ``<out>/runs`` yet."""
    return {rid for rid in map(run_id, runs) if not (Path(out) / "runs" / f"{rid}.json").exists()}


def run_all(runs: Sequence[Run], out: str | Path, *, bar: Any = None, jobs: int = 1) -> list[dict[str, Any]]:
    """Make sure every run has its JSON in ``<out>/runs``; return one row per run: its record plus its tags
    (``optimizer``, ``variant``, ``x``, ``seed`` and ``run.tags``), which is what the tables group by.

    Finished runs (their JSON exists) are read, not re-run; ``bar`` (a tqdm bar, optional) advances once per
    run executed, so its rate and time left count only real work (``pending`` gives its total). Runs listed
    twice (same id) run once. ``jobs > 1`` runs that many at once, each in its own process: a run is a pure
    function of its config (seeded, one thread at the CPU scales), so the results are the serial ones.
    """
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    unique = {run_id(run): run for run in runs}
    results, todo = {}, {}
    for rid, run in unique.items():
        path = out / "runs" / f"{rid}.json"
        if path.exists():
            results[rid] = json.loads(path.read_text())
        else:
            todo[rid] = run
    provenance = {"commit": commit(), "machine": machine()} if todo else {}

    def finished(rid: str, record: dict[str, Any]) -> None:
        _write_json_atomic(out / "runs" / f"{rid}.json", record)
        results[rid] = record
        if bar is not None:
            bar.update(1)

    if jobs <= 1 or len(todo) <= 1:
        for rid, run in todo.items():
            if bar is not None:
                bar.set_postfix_str(rid, refresh=True)
            finished(rid, _execute(run, out / "work" / rid, provenance=provenance))
    else:
        # At most `jobs` runs are handed to the pool at a time: the pool moves submitted work into its workers'
        # queue ahead of time, where cancelling cannot reach it, so runs submitted all at once went on starting
        # after a Ctrl-C had stopped the ones in flight.
        waiting = iter(todo.items())
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=get_context("spawn")) as pool:
            def submit_next() -> None:
                for rid, run in itertools.islice(waiting, 1):
                    running[pool.submit(_execute, run, out / "work" / rid, provenance=provenance)] = rid

            running: dict[Any, str] = {}
            for _ in range(min(jobs, len(todo))):
                submit_next()
            if bar is not None:
                bar.set_postfix_str(f"{min(jobs, len(todo))} at a time", refresh=True)
            try:
                while running:
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in done:
                        finished(running.pop(future), future.result())
                        submit_next()
            except BaseException:  # a failed run or Ctrl-C: finished runs are saved, the rest start over later
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    return [{**results[run_id(run)], "optimizer": run.optimizer, "variant": run.variant, "x": run.x,
             "seed": run.seed, **run.tags} for run in runs]
