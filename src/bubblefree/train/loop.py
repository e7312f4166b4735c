"""The training loop: seed, build, pick the executor once, step, log, evaluate, checkpoint, plot, summarise.

The loop is the same for the single-process simulation and the distributed runtime; everything
runtime-specific lives behind :class:`bubblefree.train.executor.Executor`. The loop builds the simulation's
executor itself; the distributed runtime's launcher passes the factory of its own (``train(executor=...)``),
so this module never imports the runtime that imports it. The learning rate follows the
paper's recipe (``optim.lr_scale``: 10 % linear warmup, cosine to 10 % of peak).

A step whose loss or gradient norm is not finite ends the run with :class:`TrainingDiverged` (exit code 3),
naming the step and the newest checkpoint, unless ``train.nonfinite = "skip"``: the simulation then leaves the
weights and the optimizer as they were and the loop counts the batch in ``skipped`` (docs/reliability.md).
What a resume may change, and what it refuses, is :mod:`bubblefree.train.resume`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from bubblefree import interrupts
from bubblefree.config import (
    Config,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    dump_toml,
    unused_keys,
    validate,
)
from bubblefree.data import load_tokens
from bubblefree.data.tokenizer import OpaqueTokenizer
from bubblefree.errors import FILESYSTEM_ERRNOS, FileSystemFault, TrainingDiverged, UserError, describe_os_error
from bubblefree.models import build_model
from bubblefree.models.hf import HFFolder, check_fingerprint, load_hf_model, read_hf_folder
from bubblefree.models.presets import PRESETS as MODEL_PRESETS, model_args
from bubblefree.optim.schedule import lr_scale
from bubblefree.schedules import n_partitions
from bubblefree.train.build import resolve_device
from bubblefree.train.checkpoint import (
    newer_checkpoints,
    restore_rng,
    save_checkpoint,
    set_aside,
)
from bubblefree.train.executor import Executor
from bubblefree.train.folders import hold
from bubblefree.train.memory import check_memory
from bubblefree.train.metrics import (
    METRICS_FILE,
    BusyWindow,
    MetricsWriter,
    metrics_record,
    plot_losses,
    progress_bar,
    tensorboard_writer,
)
from bubblefree.train.resume import (
    CONFIG_FILE,
    DATA_FILE,
    check_data,
    check_fresh_out_dir,
    resolved,
    resume_hint,
    resume_state,
)
from bubblefree.train.runfiles import RunFiles, accept_damage, read_run_files
from bubblefree.train.sim import SimExecutor

__all__ = ["ExecutorFactory", "Interrupted", "SetupBarrier", "StopRule", "TrainingDiverged", "check_lengths",
           "train"]

PLOT_FILE = "loss.png"

SetupBarrier = Callable[[Config, "BaseException | None"], None]
"""Called by every process of a run once its local setup (config, checkpoint, data, model) is done or has
failed, before the executor is built; the distributed runtime passes a collective that makes every rank fail
with the first failure, or when the ranks' configs differ (``distributed.mesh.agree``)."""

ExecutorFactory = Callable[[Config, torch.nn.Module, Any, Path], Executor]
"""Builds a process's executor from ``(config, model, data, out_dir)``. The loop builds the single-process
:class:`~bubblefree.train.sim.SimExecutor` itself; the distributed runtime's launcher, which sits above the
loop, passes one that builds a :class:`~bubblefree.distributed.DistributedExecutor` on every rank."""


def _sim_executor(config: Config, model: torch.nn.Module, data: Any, out_dir: Path) -> Executor:
    if config.pipeline.runtime != "sim":
        raise UserError("Invalid pipeline.runtime: 'distributed' needs one process per stage: run it with "
                        "bubblefree train, under torchrun (python -m bubblefree.distributed) or with "
                        "bubblefree.distributed.launch_local")
    return SimExecutor(config, model, data)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Interrupted(KeyboardInterrupt):
    """The run stopped at a step boundary on SIGINT or SIGTERM, after a checkpoint; the message (the writer's
    only) says where the checkpoint is and how to continue. The CLI exits 130."""


class StopRule(Protocol):
    """When a signalled run stops: ``should_stop(done, signalled)`` after every step (True: checkpoint this step
    and stop), then ``finished()`` once the checkpoint is written. The processes of a distributed run must stop
    after the same step; its launcher passes a rule that makes them agree
    (:class:`bubblefree.distributed.stop.StopAgreement`)."""

    def should_stop(self, done: int, signalled: bool) -> bool: ...

    def finished(self) -> None: ...


class _OneProcessStop:
    def should_stop(self, done: int, signalled: bool) -> bool:
        return signalled

    def finished(self) -> None:
        pass


def _deferred_signals():
    """SIGINT and SIGTERM as the run's flag ``{"hit", "setup"}``, checked at points of the setup and between
    steps, so the run stops where it can: before it has written anything, or at a step boundary with a
    checkpoint (:func:`bubblefree.interrupts.deferred` says why nothing raises inside a step)."""
    return interrupts.deferred()


def _stop_if_signalled(signalled: dict[str, bool]) -> None:
    """A check point of the setup: a signal that has arrived stops the run here, before its first file."""
    if signalled["hit"]:
        raise KeyboardInterrupt


def check_lengths(config: Config, data: Any = None) -> None:
    """Invalid input the config alone does not show, found here before the run folder exists, not at step 1 (the
    ``limit`` of a key's range, docs/reliability.md): a sequence longer than the model takes, more pipeline
    stages than the model has layers, more threads than cores, a run whose memory floor exceeds its device
    (``train.memory.check_memory``: without ``data`` a cheap floor, at the smallest vocabulary the config allows
    and with a lower count of the activations, so that an absurd size is refused before the data is read; with
    ``data`` the whole floor at the data's vocabulary), and (with ``data``) a split shorter than one sequence."""
    seq_len, model_name = config.train.seq_len, config.model.init_from or config.model.preset
    longest = model_args(config.model).max_seq_len
    if seq_len > longest:
        raise UserError(f"Invalid train.seq_len: {seq_len} (model {model_name} takes at most {longest} tokens per "
                        f"sequence)")
    P, schedule = config.pipeline.stages, config.pipeline.schedule
    layers = model_args(config.model).n_layers
    per_stage = n_partitions(schedule, 1)  # model partitions per stage: 2 for wpipe
    if per_stage * P > layers:
        cut = "" if per_stage == 1 else f" and {schedule} cuts it into {per_stage} partitions per stage"
        raise UserError(f"Invalid pipeline.stages: {P} (must be in [1, {layers // per_stage}]: model {model_name} "
                        f"has {layers} layers{cut}, each partition at least one layer)")
    _check_threads(config)
    vocab = config.model.vocab_size or (data.vocab_size if data is not None else 1)
    vocab_key = ("model.vocab_size" if config.model.vocab_size else "model.init_from" if config.model.init_from
                 else "data.source" if isinstance(getattr(data, "tokenizer", None), OpaqueTokenizer)
                 else "data.vocab_size" if config.data.tokenizer == "bpe" else "data.tokenizer")
    check_memory(config, model_args(config.model, vocab_size=vocab), resolve_device(config.train.device),
                 vocab_key=vocab_key, activations=data is not None)
    for split in ("train", "val") if data is not None else ():
        n = len(getattr(data, split))
        if n < seq_len + 1:
            raise UserError(f"Invalid data: the {split} split of {data.source} has {n} tokens, a sequence of "
                            f"train.seq_len = {seq_len} needs {seq_len + 1} (use more text or a smaller "
                            f"train.seq_len)")


def _start_from(config: Config, folder: HFFolder, data: Any) -> tuple[torch.nn.Module, Config]:
    """The model of a ``model.init_from`` run, holding the folder's weights, and ``config`` recording the
    folder (absolute), its fingerprint and its vocabulary: what config.toml and checkpoints keep, so that a
    resume (or an export) finds the same folder or is refused. A fingerprint already recorded (a resume, or one
    given to pin the folder) must match."""
    vocab = folder.args.vocab_size
    if config.model.vocab_size not in (0, vocab):
        raise UserError(f"Invalid model.vocab_size: {config.model.vocab_size} (model.init_from {folder.path} has "
                        f"vocab_size = {vocab}; leave model.vocab_size at 0)")
    if data.vocab_size > vocab:  # pre-tokenized shards: their own vocabulary, which the embedding must hold
        raise UserError(f"Invalid data.source: {data.source} holds token ids up to {data.vocab_size - 1}, beyond "
                        f"the vocab_size = {vocab} of model.init_from {folder.path}")
    sha = check_fingerprint(folder, config.model.init_sha256)
    pinned = apply_overrides(config, {"model.init_from": str(folder.path), "model.init_sha256": sha,
                                      "model.vocab_size": vocab})
    return load_hf_model(folder), pinned


def _check_threads(config: Config) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if config.train.threads > cores:
        raise UserError(f"Invalid train.threads: {config.train.threads} (must be in [0, {cores}]: this process may "
                        f"use {cores} cores, and more threads only take turns on them; 0 takes torch's default)")


def _build(config: Config, out_dir: Path, resume: bool | str | Path, barrier: SetupBarrier | None,
           make_executor: ExecutorFactory, signalled: dict[str, bool], *, branch: bool, data_moved: bool,
           accept_damaged: bool) -> tuple[Config, Executor, dict[str, Any] | None, dict[str, int], Any,
                                          dict[str, Any], RunFiles | None]:
    """Validate, read a resumed run's files, load data, build the model and executor and restore the
    checkpoint; write nothing. Between the stages a signal that has arrived (``signalled``,
    :func:`_deferred_signals`) stops the setup.

    Every process of a distributed run reads the run's files and the checkpoint itself (so a multi-node resume
    needs the run folder on a shared filesystem). Returns ``(config, executor, checkpoint or None, parameter
    counts, token data, data record, run files or None)``: the config with a ``model.init_from`` folder pinned
    (:func:`_start_from`), the counts as ``{"params": all trainable, "params_non_embedding": without the
    vocabulary matrices}``, the run files as a resume read them (``train.runfiles``: damage accepted or none).
    """
    failure, ckpt, files = None, None, None
    try:
        validate(config)
        if resume:  # before the data: a damaged run folder is refused at once
            files = read_run_files(out_dir, resume, accept_damaged=accept_damaged)
        if config.log.tensorboard:
            tensorboard_writer()
        folder = read_hf_folder(config.model.init_from) if config.model.init_from else None
        check_lengths(config)
        _seed_everything(config.train.seed)
        _stop_if_signalled(signalled)
        data = load_tokens(config.data, tokenizer=folder.tokenizer if folder else None)
        check_lengths(config, data)
        _stop_if_signalled(signalled)
        if folder is None:
            model = build_model(config.model.preset, vocab_size=config.model.vocab_size or data.vocab_size)
        else:
            model, config = _start_from(config, folder, data)
        if config.train.compile:
            model.compile_blocks()
        _stop_if_signalled(signalled)
        pinned = check_data(config, data, files.data_record if files else None, data_moved=data_moved)
        ckpt = resume_state(config, out_dir, resume, model, data.vocab_size, branch=branch, data_moved=data_moved,
                            unverified=not files.manifest_ok) if files else None
    except Exception as e:  # reported through the barrier first, so that no other process waits for this one
        failure = e
    if barrier is not None:
        barrier(config, failure)
    if failure is not None:
        raise failure
    _stop_if_signalled(signalled)
    executor = make_executor(config, model, data, out_dir)
    if executor.is_writer and not resume:  # after the build: the writer may create files as soon as it returns
        check_fresh_out_dir(out_dir)
    if ckpt is not None:
        executor.load_state_dict(ckpt["executor"])
        restore_rng(ckpt["rng"])
    _stop_if_signalled(signalled)
    counts = {"params": model.num_params(), "params_non_embedding": model.num_params(embedding=False)}
    return config, executor, ckpt, counts, data, pinned, files


def _model_name(config: Config, counts: dict[str, int], data: Any) -> str:
    """The banner's model: the preset's name counts its parameters at its own vocabulary, so a run at another
    vocabulary (the smoke preset's 256 bytes) says so beside the count it trains."""
    if config.model.init_from:
        return f"{config.model.init_from} ({counts['params'] / 1e6:.2f}M parameters)"
    vocab = config.model.vocab_size or data.vocab_size
    own = MODEL_PRESETS[config.model.preset]().vocab_size
    at = "" if vocab == own else f" at vocabulary {vocab}"
    return f"{config.model.preset}{at} ({counts['params'] / 1e6:.2f}M parameters)"


def _diverged(step: int, stats: Any, out_dir: Path, config: Config) -> TrainingDiverged:
    # skip exists in the simulation only (the stages of an asynchronous pipeline update before the loss exists)
    skip = " (add --set train.nonfinite=skip to skip such batches)" if config.pipeline.runtime == "sim" else ""
    return TrainingDiverged(f"training stopped at step {step}: the loss is {stats.loss} and the gradient norm "
                            f"{stats.grad_norm}; {resume_hint(out_dir)}{skip}")


def train(config: Config, *, out_dir: str | Path, resume: bool | str | Path = False, branch: bool = False,
          data_moved: bool = False, accept_damaged: bool = False, lock: bool = True,
          barrier: SetupBarrier | None = None, stop: StopRule | None = None,
          executor: ExecutorFactory | None = None) -> dict[str, Any]:
    """Train as ``config`` says, writing config.toml, metrics.jsonl, checkpoints and loss.png to ``out_dir``.

    With ``resume`` the newest checkpoint in ``out_dir`` (or the checkpoint file ``resume`` names) is loaded
    and the run continues from it; the steps after it are identical to those of an uninterrupted run. Returns
    the run's summary. Invalid input is reported as a UserError before anything is written (a ValueError from
    the library while setting up is invalid input too: that is how the library reports bad arguments).
    ``barrier`` (:data:`SetupBarrier`) lets the processes of a distributed run meet once after their setup;
    ``stop`` (:class:`StopRule`) makes them stop after the same step on SIGINT or SIGTERM (default: this
    process stops after the step it is in); ``executor`` (:data:`ExecutorFactory`) builds their executor
    (default: the single-process simulation).

    The run folder has one writer: this process holds its lock (``train.folders.hold``) from before the setup
    to the end, and a second writer is refused; ``lock=False`` where a launcher holds it for the processes of
    a distributed run. A resume from an older checkpoint of a run that went on past it is refused unless
    ``branch`` (the newer checkpoints are moved aside, never deleted); a resume on data other than the run's
    is refused, and on the same tokens at another path only with ``data_moved``. The run's own files are read
    strictly before anything is written (``train.runfiles``): a missing or damaged one is refused unless
    ``accept_damaged``, which keeps it beside its replacement. A filesystem that refuses a write (read-only,
    full) ends the run with a :class:`~bubblefree.errors.FileSystemFault` naming the last good checkpoint.

    Every process of a distributed run calls this; they make the same executor calls in the same order, and
    only the executor's writer writes files and prints (the others return an empty summary).
    """
    out_dir = Path(out_dir)
    threads = torch.get_num_threads()
    if config.train.threads:
        _check_threads(config)  # before torch takes it: a count past the cores is a refusal, not an overflow
        torch.set_num_threads(config.train.threads)
    try:
        with contextlib.ExitStack() as held:
            signalled = held.enter_context(_deferred_signals())
            if lock:
                if not resume:
                    check_fresh_out_dir(out_dir)
                held.enter_context(hold(out_dir, what="--resume" if resume else "--out", create=not resume))
            return _run(config, out_dir, resume, barrier, stop, executor or _sim_executor, signalled,
                        branch=branch, data_moved=data_moved, accept_damaged=accept_damaged)
    except OSError as e:
        if e.errno not in FILESYSTEM_ERRNOS or not (out_dir / CONFIG_FILE).is_file():
            raise  # before the run's first file: the one-line OSError says all (errors.exit_code)
        raise FileSystemFault(f"{describe_os_error(e)}; the run stopped: {resume_hint(out_dir)} once the "
                              f"filesystem lets it write") from None
    except KeyboardInterrupt as e:
        if type(e) is not KeyboardInterrupt or stop is not None:
            raise  # a stop at a step boundary says where its checkpoint is; ranks stop silently
        if not (out_dir / CONFIG_FILE).is_file():  # setup had not written anything yet
            raise Interrupted("interrupted before the run started; nothing was written") from None
        raise Interrupted(f"interrupted; {resume_hint(out_dir)}") from None
    finally:
        torch.set_num_threads(threads)


def _run(config: Config, out_dir: Path, resume: bool | str | Path, barrier: SetupBarrier | None,
         stop: StopRule | None, make_executor: ExecutorFactory, signalled: dict[str, bool], *, branch: bool,
         data_moved: bool, accept_damaged: bool) -> dict[str, Any]:
    cfg = config.train
    try:
        config, executor, ckpt, counts, data, pinned, files = _build(
            config, out_dir, resume, barrier, make_executor, signalled, branch=branch, data_moved=data_moved,
            accept_damaged=accept_damaged)
    except UserError:
        raise
    except ValueError as e:
        raise UserError(str(e)) from e
    signalled["setup"] = False  # from the first file on, a signal stops the run at a step boundary
    start = ckpt["step"] if ckpt else 0
    skipped = ckpt.get("loop", {}).get("skipped", 0) if ckpt else 0
    saved = config_to_dict(resolved(config, data.vocab_size))  # what config.toml and checkpoints record

    writer = executor.is_writer  # every call on executor below is made by every process; only this one writes
    if writer:
        metrics = _open_run(config, out_dir, resume, start, saved=saved, pinned=pinned, files=files,
                            branched=ckpt is not None and bool(newer_checkpoints(out_dir, start)),
                            what=f"{_model_name(config, counts, data)} on {data.source}")
    bar = progress_bar(total=cfg.steps, initial=start, enabled=writer and config.log.progress)
    plain = writer and config.log.progress and bar.disable  # no terminal (a log file, nohup): plain lines
    tokens_per_step = cfg.batch_size * cfg.seq_len
    val_loss, train_time, window_time, window_tokens, tokens_per_s = float("nan"), 0.0, 0.0, 0, 0.0
    test_loss = float("nan")
    stop_rule = stop or _OneProcessStop()
    busy = BusyWindow()

    for step in range(start, cfg.steps):
        tic = time.perf_counter()
        stats = executor.train_step(step, lr_scale(step, cfg.steps, warmup_frac=cfg.warmup_frac,
                                                   min_lr_frac=cfg.min_lr_frac))
        elapsed = time.perf_counter() - tic
        train_time += elapsed
        window_time += elapsed
        window_tokens += tokens_per_step
        done, last = step + 1, step + 1 == cfg.steps
        if writer and not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)):
            skipped = _nonfinite(config, done, stats, skipped, out_dir, bar, metrics)
        evaluate = last or (cfg.eval_every > 0 and done % cfg.eval_every == 0)
        if evaluate:
            val_loss = executor.evaluate()
            if cfg.test_split:
                test_loss = executor.evaluate("test")
        if writer:
            busy.add(stats)
        if writer and (evaluate or done % cfg.log_every == 0):
            tokens_per_s, window_time, window_tokens = window_tokens / window_time, 0.0, 0
            record = metrics_record(cfg, done, stats, tokens=done * tokens_per_step, tokens_per_s=tokens_per_s,
                             skipped=skipped, busy=busy.pop(stats),
                             losses={"val_loss": val_loss, "test_loss": test_loss} if evaluate else {})
            if evaluate:
                bar.write(f"step {done}/{cfg.steps}: train loss {stats.loss:.4f}, validation loss "
                          f"{val_loss:.4f}, {tokens_per_s:.0f} tokens/s")
            elif plain:
                print(f"step {done}/{cfg.steps}: train loss {stats.loss:.4f}, {tokens_per_s:.0f} tokens/s",
                      flush=True)
            metrics.log(record)
            bar.set_postfix(loss=f"{stats.loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
        bar.update(1)
        stopping = stop_rule.should_stop(done, signalled["hit"])
        if last or (cfg.ckpt_every > 0 and done % cfg.ckpt_every == 0) or stopping:
            state = executor.state_dict()
            if writer:
                save_checkpoint(out_dir, step=done, executor_state=state, config=saved,
                                keep=cfg.ckpt_keep, loop_state={"skipped": skipped})
        if stopping and not last:
            _stop(done, out_dir, bar, executor, stop_rule, metrics if writer else None)
    bar.close()
    executor.close()
    if not writer:
        return {}
    metrics.close()
    trained_tokens = (cfg.steps - start) * tokens_per_step
    return _finish(config, out_dir, counts, val_loss=val_loss, test_loss=test_loss,
                   tokens_per_s=trained_tokens / train_time if train_time else 0.0)


def _nonfinite(config: Config, done: int, stats: Any, skipped: int, out_dir: Path, bar: Any,
               metrics: MetricsWriter) -> int:
    """A step whose loss or gradient norm is not finite: the run stops (``train.nonfinite = stop``: the executor
    applied no update, nothing after the checkpoint is kept), or the batch counts as skipped; the new count."""
    if config.train.nonfinite == "stop":
        bar.close()
        metrics.close()
        raise _diverged(done, stats, out_dir, config)
    bar.write(f"step {done}/{config.train.steps}: the loss is {stats.loss} and the gradient norm "
              f"{stats.grad_norm}; batch skipped ({skipped + 1} so far)")
    return skipped + 1


def _stop(done: int, out_dir: Path, bar: Any, executor: Executor, stop_rule: StopRule,
          metrics: MetricsWriter | None) -> None:
    """Stop after step ``done``, its checkpoint written: every process alike; the writer says where."""
    bar.close()
    executor.close()
    stop_rule.finished()
    if metrics is None:
        raise Interrupted()
    metrics.close()
    raise Interrupted(f"interrupted; checkpoint at step {done} in {out_dir}; continue with "
                      f"--resume {shlex.quote(str(out_dir))}")


def _open_run(config: Config, out_dir: Path, resume: bool | str | Path, start: int, *, saved: dict[str, Any],
              pinned: dict[str, Any], files: RunFiles | None, branched: bool, what: str) -> MetricsWriter:
    """The writer's first files, once the setup has passed every check: a later lineage kept aside
    (``--branch``), damaged files kept aside (``--accept-damaged``), config.toml and data.json, the opening
    lines, and metrics.jsonl (on resume its lines up to the checkpoint's step, as the resume read them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if branched:
        aside = set_aside(out_dir, start, (METRICS_FILE, PLOT_FILE, CONFIG_FILE, DATA_FILE))
        print(f"bubblefree: note: the checkpoints past step {start} and a copy of {METRICS_FILE} are in "
              f"{aside}", flush=True)
    kept = [line for step, line in files.metrics if step <= start] if files else []
    for line in accept_damage(files, kept=len(kept), step=start) if files else ():
        print(f"bubblefree: note: {line}", flush=True)
    _write_atomic(out_dir / CONFIG_FILE, dump_toml(config_from_dict(saved)))
    _write_atomic(out_dir / DATA_FILE, json.dumps(pinned, indent=1) + "\n")
    print(f"bubblefree: {'resuming' if resume else 'training'} {what}, step {start}/{config.train.steps}; "
          f"outputs in {out_dir}", flush=True)
    for line in unused_keys(config):
        print(f"bubblefree: note: {line}", flush=True)
    return MetricsWriter(out_dir, tensorboard=config.log.tensorboard, resume_step=start if resume else None,
                         keep=kept)


def _finish(config: Config, out_dir: Path, counts: dict[str, int], *, val_loss: float, test_loss: float,
            tokens_per_s: float) -> dict[str, Any]:
    """The writer's last words: loss.png, the run's summary, and "done" unless the final loss is not finite."""
    cfg = config.train
    model_name = Path(config.model.init_from).name or config.model.preset
    plot_losses(out_dir / METRICS_FILE, out_dir / PLOT_FILE, title=f"{model_name}, "
                f"{config.optim.name}, {config.pipeline.schedule}, {config.delay.correction}")
    summary = {"steps": cfg.steps, "tokens": cfg.steps * cfg.batch_size * cfg.seq_len, "final_val_loss": val_loss,
               "tokens_per_s": tokens_per_s, "out_dir": str(out_dir), **counts}
    if cfg.test_split:
        summary["final_test_loss"] = test_loss
    if not math.isfinite(val_loss):  # not "done": the caller (the CLI: exit 3) says what happened
        return summary
    print(f"bubblefree: done. final validation loss {val_loss:.4f}, {summary['tokens_per_s']:.0f} tokens/s; "
          f"outputs in {out_dir} (config.toml, metrics.jsonl, loss.png, checkpoints/)", flush=True)
    return summary
