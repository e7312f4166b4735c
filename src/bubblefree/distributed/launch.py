"""Start the processes of a pipeline run and make any failure end all of them, naming the rank and cause.

* :func:`launch_local` spawns ``nprocs`` processes on 127.0.0.1 (a free port, ``gloo`` on CPU, ``nccl``
  with one GPU per process) and monitors them: when one exits non-zero the others are killed and a
  :class:`PipelineFailure` names the rank that failed first and why.
* :func:`run_worker` is the body of one process, also used under ``torchrun`` (``python -m
  bubblefree.distributed``): every rank runs the ordinary training loop (``bubblefree.train.train``) with a
  :class:`~bubblefree.distributed.executor.DistributedExecutor`; only global rank 0 writes the run's outputs.
  The config is validated (``config.validate`` with the run's number of replicas) before any process starts.
* Every rank that fails writes ``<run>/errors/rank<r>.json`` before exiting; a watchdog thread in every rank
  polls that folder and exits (code 1, printing the failed rank and its cause) as soon as another rank's
  file appears, so no rank waits for its point-to-point timeout when a peer raised.
* Every rank joins the process group before its setup and meets the others once when setup is done
  (:func:`~bubblefree.distributed.mesh.agree`): a rank whose setup failed (its node lacks the data file, say)
  or a config that differs between ranks makes every rank exit at once naming the cause, also across nodes
  that share no filesystem. A rank whose parent (the launcher or torchrun's agent) was killed exits too.
* A :class:`~bubblefree.errors.UserError` (invalid input found inside a rank, e.g. a schedule the runtime
  does not run) stays one: :func:`launch_local` re-raises it with its one-line message, so the CLI exits 2,
  and the watchdogs stop the other ranks without printing.
* The run folder has one writer (``train.folders.hold``): :func:`launch_local` holds its lock before it
  touches the folder or starts a rank, for the life of the run; under torchrun, global rank 0 holds it, taken
  before it touches the folder (a refused rank 0 exits 2 at once and torchrun's agent stops the others).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from bubblefree.config import Config, config_to_dict, validate
from bubblefree.distributed.executor import DistributedExecutor
from bubblefree.distributed.faults import maybe_fault
from bubblefree.distributed.mesh import agree, init_backend
from bubblefree.distributed.p2p import PeerFailure, timeout_s
from bubblefree.distributed.stop import StopAgreement
from bubblefree.errors import FileSystemFault, TrainingDiverged, UserError
from bubblefree.train.folders import hold
from bubblefree.train.loop import Interrupted, train
from bubblefree.train.resume import check_fresh_out_dir, resume_hint

__all__ = ["PipelineFailure", "exit_at_once", "launch_local", "run_worker"]

ERRORS_DIR = "errors"
STALE_MARGIN_S = 30.0


class PipelineFailure(RuntimeError):
    """A rank of a pipeline run failed; the message names it and the cause."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_error(out_dir: Path, rank: int, exc: BaseException) -> None:
    folder = out_dir / ERRORS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "cause": f"{type(exc).__name__}: {exc}", "time": time.time(),
              "peer": exc.peer if isinstance(exc, PeerFailure) else None,
              "user_error": str(exc) if isinstance(exc, UserError) else None,
              "diverged": str(exc) if isinstance(exc, TrainingDiverged) else None,
              "filesystem": str(exc) if isinstance(exc, FileSystemFault) else None,
              "traceback": "".join(traceback.format_exception(exc))[-4000:]}
    tmp = folder / f".rank{rank}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / f"rank{rank}.json")


def read_errors(out_dir: Path, *, since: float = 0.0) -> list[dict]:
    """Error records the ranks wrote at or after time ``since``, earliest first."""
    folder = out_dir / ERRORS_DIR
    records = [json.loads(p.read_text()) for p in folder.glob("rank*.json")] if folder.is_dir() else []
    return sorted((r for r in records if r["time"] >= since), key=lambda r: r["time"])


def root_cause(out_dir: Path, *, since: float = 0.0) -> str | None:
    """One line naming the rank that failed first: a rank's own error beats the peers that saw it vanish."""
    records = read_errors(out_dir, since=since)
    own = [r for r in records if r["peer"] is None]
    if own:
        return f"rank {own[0]['rank']} failed: {own[0]['cause']}"
    if records:
        return f"rank {records[0]['peer']} died (seen by rank {records[0]['rank']}: {records[0]['cause']})"
    return None


def _user_error(out_dir: Path, *, since: float = 0.0) -> str | None:
    """The message of the first rank's own error when that error is invalid input (a UserError)."""
    own = [r for r in read_errors(out_dir, since=since) if r["peer"] is None]
    return own[0].get("user_error") if own else None


def _watchdog(out_dir: Path, rank: int, period_s: float = 1.0) -> None:
    # Records of an earlier attempt in the same run folder (a run resumed after a failure) are not this
    # run's: launch_local clears the folder; under torchrun, records older than this process are ignored
    # (with a margin for ranks that start a little apart on one machine's clock).
    since = time.time() - STALE_MARGIN_S
    (out_dir / ERRORS_DIR / f"rank{rank}.json").unlink(missing_ok=True)
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:  # the launcher was killed (SIGKILL leaves no chance to stop its ranks)
                print(f"bubblefree: rank {rank} stops because its launcher (pid {parent}) is gone",
                      file=sys.stderr, flush=True)
                os._exit(1)
            others = [r for r in read_errors(out_dir, since=since) if r["rank"] != rank]
            if others:
                if not _user_error(out_dir, since=since):  # the launcher or the failing rank prints that line
                    print(f"bubblefree: rank {rank} stops because {root_cause(out_dir, since=since)}",
                          file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="bubblefree-watchdog", daemon=True).start()


def _agree(config: Config, failure: BaseException | None) -> None:
    agree(config_to_dict(config), failure)


def _executor(config: Config, model: torch.nn.Module, data: object, out_dir: Path) -> DistributedExecutor:
    return DistributedExecutor(config, model, data, out_dir=out_dir)


def run_worker(config: Config, *, out_dir: str | Path, resume: bool | str | Path = False, branch: bool = False,
               data_moved: bool = False, accept_damaged: bool = False, launched: bool = False) -> None:
    """Body of one process of a run (environment from torchrun, or from :func:`launch_local`: ``launched``,
    whose launcher holds the run folder's lock; under torchrun rank 0 takes it here)."""
    out_dir = Path(out_dir)
    rank = int(os.environ["RANK"])
    with contextlib.ExitStack() as held:
        if rank == 0 and not launched:
            if not resume:
                check_fresh_out_dir(out_dir)
            held.enter_context(hold(out_dir, what="--resume" if resume else "--out", create=not resume))
        _run_rank(config, out_dir, rank, resume=resume, branch=branch, data_moved=data_moved,
                  accept_damaged=accept_damaged)


def _run_rank(config: Config, out_dir: Path, rank: int, *, resume: bool | str | Path, branch: bool,
              data_moved: bool, accept_damaged: bool) -> None:

    _watchdog(out_dir, rank)
    try:
        maybe_fault(rank, when="start")
        # The device type decides the backend; a config asking for a missing CUDA fails in the setup, on
        # every rank alike (the ranks agree on the config).
        cuda = config.train.device != "cpu" and torch.cuda.is_available()
        init_backend(timeout_s=timeout_s(), device_type="cuda" if cuda else "cpu")
        train(config, out_dir=out_dir, resume=resume, branch=branch, data_moved=data_moved,
              accept_damaged=accept_damaged, lock=False,
              barrier=_agree, executor=_executor, stop=StopAgreement(config.pipeline.stages))
        if dist.is_initialized():
            dist.destroy_process_group()
    except Interrupted:  # every rank stopped at the same step after a checkpoint: not a failure to report
        if dist.is_initialized():
            dist.destroy_process_group()  # a clean stop, so the process may exit normally (no exit_at_once)
        raise
    except BaseException as exc:
        _write_error(out_dir, rank, exc)
        raise  # the entry point leaves at once with its code (cli.main), without tearing the process group down


def exit_at_once(code: int) -> None:
    """End a failed rank's process now, with ``code``, skipping the interpreter's teardown.

    After a failure gloo's background threads are still running; a normal exit destroys them while they are
    joinable and C++ aborts the process ("terminate called without an active exception" on stderr, SIGABRT
    instead of ``code``). The rank's error record is already written; nothing is left to flush but stdio."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawned(index: int, config: Config, out_dir: str, nprocs: int, port: int, resume: bool | str | Path,
             threads: int, branch: bool, data_moved: bool, accept_damaged: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), LOCAL_RANK=str(index),
                      WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs))
    torch.set_num_threads(threads)
    try:
        run_worker(config, out_dir=out_dir, resume=resume, branch=branch, data_moved=data_moved,
                   accept_damaged=accept_damaged, launched=True)
    except Interrupted:  # the launcher says where the checkpoint is; a normal exit releases what spawn shared
        sys.exit(130)
    except BaseException:  # recorded by run_worker; launch_local reads the record, not this exit code
        exit_at_once(1)


def launch_local(config: Config, out_dir: str | Path, nprocs: int | None = None, *,
                 resume: bool | str | Path = False, branch: bool = False, data_moved: bool = False,
                 accept_damaged: bool = False) -> None:
    """Run ``config`` with ``nprocs`` local processes (default ``pipeline.stages``; a multiple of it gives
    ``nprocs / P`` data-parallel replicas). Raises :class:`PipelineFailure` naming the first failed rank, or
    the :class:`~bubblefree.errors.UserError` a rank raised. The launcher holds the run folder's lock for the
    life of the run (``resume``, ``branch``, ``data_moved``, ``accept_damaged``: as :func:`bubblefree.train.train`
    takes them)."""
    nprocs = nprocs or config.pipeline.stages
    if nprocs < 1 or nprocs % config.pipeline.stages:
        raise ValueError(f"Invalid nprocs: {nprocs} (must be a multiple of pipeline.stages = {config.pipeline.stages})")
    config = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, runtime="distributed"))
    validate(config, replicas=nprocs // config.pipeline.stages)
    out_dir = Path(out_dir)
    if not resume:
        check_fresh_out_dir(out_dir)
    with hold(out_dir, what="--resume" if resume else "--out", create=not resume):
        _launch(config, out_dir, nprocs, resume=resume, branch=branch, data_moved=data_moved,
                accept_damaged=accept_damaged)


def _launch(config: Config, out_dir: Path, nprocs: int, *, resume: bool | str | Path, branch: bool,
            data_moved: bool, accept_damaged: bool) -> None:
    shutil.rmtree(out_dir / ERRORS_DIR, ignore_errors=True)  # an earlier attempt's failures are not this run's
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    ctx = mp.start_processes(_spawned, args=(config, str(out_dir), nprocs, _free_port(), resume, threads, branch,
                                             data_moved, accept_damaged),
                             nprocs=nprocs, join=False, start_method="spawn")
    # join() logs a warning for every process it terminates after a failure; the failure raised below names
    # the rank and cause in one line, which a user error must be alone in saying.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    signals = {"count": 0}

    def forward(signum, frame):
        # The ranks stop together at a step boundary (bubblefree.distributed.stop); they have the news with the
        # first signal, and further ones change nothing (to end them at once: SIGKILL this launcher, and its
        # ranks exit within a second; the resume from the last checkpoint is exact).
        signals["count"] += 1
        if signals["count"] == 1:
            for process in ctx.processes:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not ctx.join(timeout=1.0):
            pass
    except ProcessException as exc:  # join() has already terminated the other processes
        if signals["count"] or (isinstance(exc, ProcessExitedException) and exc.exit_code == 130):
            raise _interrupted(out_dir) from None
        own_errors = [r for r in read_errors(out_dir) if r["peer"] is None]
        if _user_error(out_dir):
            message = _user_error(out_dir)
            # Invalid input leaves nothing behind: the error records were only the ranks' way to stop together.
            shutil.rmtree(out_dir / ERRORS_DIR, ignore_errors=True)  # (hold removes a new folder left empty)
            raise UserError(message) from None
        diverged = [r["diverged"] for r in own_errors if r.get("diverged")]
        if diverged:  # the writer stopped the run on a non-finite loss: the CLI's exit code 3, not a crash
            raise TrainingDiverged(diverged[0]) from None
        refused = [r["filesystem"] for r in own_errors if r.get("filesystem")]
        if refused:  # the writer's filesystem refused a write (read-only, full): exit code 4, one line
            raise FileSystemFault(refused[0]) from None
        if isinstance(exc, ProcessExitedException) and exc.signal_name and not own_errors:
            cause = f"rank {exc.error_index} was killed by {exc.signal_name}"
        else:
            cause = root_cause(out_dir) or str(exc).strip().splitlines()[-1]
        raise PipelineFailure(cause) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupted(out_dir: Path) -> BaseException:
    return Interrupted(f"interrupted; {resume_hint(out_dir)}")
