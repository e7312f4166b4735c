"""Helpers the test files share (``from helpers import ...``); conftest.py holds the fixtures and settings.

* the optimizer tests' random problem (tests/test_optim.py, tests/test_soap.py): :data:`SEED`,
  :func:`random_params`, :func:`random_grads`, :func:`trajectory`, :func:`relative_error`,
  :func:`write_rounding_bound`, and :func:`pytorch_optimizer`, the reference package or a skip;
* processes a test starts: :func:`wait_for`, :func:`group_alive` and :func:`killed_at_exit`
  (tests/test_reliability.py, tests/test_faults.py);
* the command line in this process and a folder's bytes: :func:`run_cli`, :func:`folder_digest`;
* a stand-in for a suite's training run: :func:`finished_run` (tests/test_reproduce.py and its neighbours).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

# -------------------------------------------------------------------------- the optimizer tests' problem

SEED = 1234
"""The seed of every optimizer test's parameters and gradients."""


def pytorch_optimizer():
    """The reference package of SOAP, Adan, Lion and MARS, or a skip of the one test that needs it."""
    return pytest.importorskip("pytorch_optimizer", reason="the test extra's pytorch-optimizer is not installed")


def random_params(shapes, seed: int = SEED, dtype=torch.float32) -> list[nn.Parameter]:
    """Standard normal parameters of ``shapes``."""
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def random_grads(shapes, steps: int, seed: int = SEED, dtype=torch.float32) -> list[list[Tensor]]:
    """Fresh gradients, each step and tensor with its own scale in [0.01, 3] (exercises MARS's clipping). They
    do not depend on the parameters, so two optimizers fed them see the same problem whatever they do."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        scales = torch.rand(len(shapes), generator=g, dtype=torch.float64) * 3 + 0.01
        out.append([torch.randn(s, generator=g, dtype=dtype) * float(k) for s, k in zip(shapes, scales)])
    return out


def run_steps(opt: torch.optim.Optimizer, params: list[Tensor], grads: list[list[Tensor]]) -> None:
    """One ``opt.step()`` per entry of ``grads``, each after setting those gradients."""
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


def trajectory(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], shapes, steps: int, *,
               seed: int = SEED, dtype=torch.float32):
    """``(x0, params, opt)`` after ``steps`` steps of ``make(params)`` on :func:`random_grads`."""
    params = random_params(shapes, seed, dtype)
    x0 = [p.detach().clone() for p in params]
    opt = make(params)
    run_steps(opt, params, random_grads(shapes, steps, seed, dtype))
    return x0, params, opt


def _norm(tensors) -> float:
    return sum(float(t.detach().double().pow(2).sum()) for t in tensors) ** 0.5


def relative_error(ours, ref, x0) -> float:
    """``||x_ours - x_ref|| / ||x_ref - x_0||``: the error relative to how far the parameters moved, the
    strictest scale (a relative error of the parameters themselves would be ~100x smaller in these tests)."""
    return _norm(a.detach() - b.detach() for a, b in zip(ours, ref)) / _norm(b.detach() - a for a, b in zip(x0, ref))


def write_rounding_bound(x0, ref, steps: int) -> float:
    """What float32 allows when the step is small next to x: each step both sides round x (ours once in
    x - u, a reference in (1 - lr wd) x, whose float32 scalar is itself off by up to 2^-25, and again in the
    subtraction), at most 4 half-ulps = 2^-22 |x| per step together. Summed over ``steps`` and taken relative
    to the displacement, as :func:`relative_error` measures (float64 runs show the math itself agrees)."""
    return steps * 2.0**-22 * _norm(ref) / _norm(b.detach() - a for a, b in zip(x0, ref))


# -------------------------------------------------------------------------- processes a test starts

def wait_for(condition: Callable[[], bool], *, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Poll ``condition()`` until it holds or ``timeout_s`` has passed; return whether it held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def killed_at_exit(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Run the body, then SIGKILL whatever is left of ``proc``'s process group (it must have been started with
    ``start_new_session=True``), so that a failing test leaves no process behind."""
    try:
        yield proc
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


# -------------------------------------------------------------------------- the command line, in this process

def run_cli(argv: list[str]) -> tuple[int, str]:
    """Run the CLI in this process; return (exit code, stderr). argparse's errors exit through SystemExit."""
    from bubblefree.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def folder_digest(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root``: equal before and after means no byte changed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def finished_run(run, loss, *, final=None, **extra):
    """What a finished run's JSON holds, for a stand-in ``experiments.runner._execute``: ``loss`` on its curves
    and, unless ``final`` says otherwise, as its final validation loss."""
    from bubblefree.config import config_to_dict
    from bubblefree.experiments import run_id

    return {"id": run_id(run), "config": config_to_dict(run.config), "final_val_loss": loss if final is None else final,
            "val_curve": [[1, 1, loss]], "train_curve": [[1, 1, loss]], "tokens_per_s": 1.0, "wall_time_s": 1.0,
            "commit": "c", "machine": "m", **extra}
