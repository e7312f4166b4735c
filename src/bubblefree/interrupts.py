"""SIGINT and SIGTERM: however many arrive, in whatever order and at whatever moment, a command ends with exit code
130 and one line, never with a traceback and never by the signal itself (143) (docs/reliability.md, "Signals").

One handler serves both signals for the whole command (:func:`command`, held by the CLI's ``main``):

* outside a training run (the command line being read, a simulation, a suite between its runs) a signal raises
  KeyboardInterrupt where it lands, which the CLI reports as ``bubblefree: interrupted``, except inside an
  import: raised while torch is being imported it aborts the process from C++ (a pybind11 callback:
  ``terminate called after throwing an instance of 'pybind11::error_already_set'``, exit 134), prints a
  traceback from a module lock's callback, or passes through the methods dataclasses generate by ``exec``, after
  which CPython ends the process by SIGINT whatever code it returns (all three measured: a storm of signals
  during the imports of ``bubblefree train``, one run in four). A signal inside an import is only counted, and
  acted on at the next point that asks (:func:`check`, a run's first check point) or at the command's end;
* inside a run (:func:`deferred`, held by ``train.loop.train`` from its start to its end) a signal only sets the
  run's flag, which the setup checks between its stages and the loop after each step (a checkpoint, then the
  line saying where it is); in the setup a second signal stops it at once, by one KeyboardInterrupt;
* while a KeyboardInterrupt is on its way out, and once the command's ending is settled (:func:`settle`: a run
  stopped and said where, or the CLI reports the command's outcome), a signal changes nothing. Raised then, a
  KeyboardInterrupt would land in an ``except`` or ``finally`` block on the way out (the message being printed,
  the lock being released) and replace the message with a bare one or end in a traceback; and a handler
  restored to the default before the process has exited lets a late SIGTERM kill it with 143. So for the
  program itself :func:`command` leaves both signals ignored when it returns, and the process exits with the
  command's code;
* a command that did all its work while a signal arrived (at a run's last step, in its last lines) still exits
  130, saying so (:func:`signalled`): the shell was asked to stop, and a script must not go on to its next
  command.

The window no handler can cover is Python's own start, before ``main`` runs (about a tenth of a second: the
``bubblefree.cli`` import loads no torch). Handlers belong to the main thread; in any other these do nothing.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["SIGNALS", "check", "command", "deferred", "settle", "signalled"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a command (SIGTERM acts as Ctrl-C); SIGKILL cannot be handled (exit 137)."""

_state: dict = {"signals": 0, "settled": False, "run": None}
"""``signals``: how many arrived during the command; ``settled``: the ending is decided, signals change nothing;
``run``: the flag of the run deferring them."""


def _on_signal(signum, frame) -> None:
    _state["signals"] += 1
    # While a KeyboardInterrupt is on its way out, the code running is an `except` or `finally` block (or an
    # `__exit__`) it passes through: one raised there would replace it. Once it is gone (swallowed by a library,
    # say), the next signal raises again.
    if _state["settled"] or isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return
    run = _state["run"]
    again = run is not None and run["hit"]
    if run is not None:
        run["hit"] = True
    if _in_import(frame):
        return
    if run is not None and not (again and run["setup"]):
        return
    raise KeyboardInterrupt


def _in_import(frame) -> bool:
    """Whether the interrupted code runs inside an import (importlib's frames are on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def check() -> None:
    """Stop the command here (KeyboardInterrupt) if a signal came that has not stopped it yet (one that landed
    inside an import, which only counts it); for long work outside a run, between its parts."""
    if _state["signals"] and not _state["settled"] and _state["run"] is None and _main_thread():
        raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install() -> dict[int, object] | None:
    """Install the handler unless it is installed; the handlers to put back, or None where nothing changed."""
    if all(signal.getsignal(sig) is _on_signal for sig in SIGNALS):
        return None
    _state.update(signals=0, settled=False, run=None)  # a new holder: a new command, or a run from Python
    return {sig: signal.signal(sig, _on_signal) for sig in SIGNALS}


def _put_back(previous: dict[int, object], *, ignore: bool = False) -> None:
    for sig, old in previous.items():
        signal.signal(sig, signal.SIG_IGN if ignore else old if old is not None else signal.SIG_DFL)


@contextlib.contextmanager
def command(*, program: bool) -> Iterator[None]:
    """Hold the handler for a command. ``program``: the process ends when the command does (the console script,
    ``python -m bubblefree``), so both signals are left ignored; otherwise (a caller in the same process, a
    test) the handlers found are put back."""
    if not _main_thread():
        yield
        return
    previous = _install()
    try:
        yield
    finally:
        if program:
            _put_back(dict.fromkeys(SIGNALS), ignore=True)
        elif previous is not None:
            _put_back(previous)


def settle() -> None:
    """The command's ending is decided (its outcome is being reported, or a stop it has said): from here on a
    signal is only counted."""
    _state["settled"] = True


def signalled() -> int:
    """How many signals the command has had (a command that did all its work while one arrived still exits
    130: the shell running it was asked to stop, and a script must not go on to its next command)."""
    return _state["signals"]


@contextlib.contextmanager
def deferred() -> Iterator[dict[str, bool]]:
    """Defer signals to a run's flag ``{"hit": bool, "setup": bool}`` for the duration of the block.

    The run checks ``hit`` at points of its setup and after every step, and clears ``setup`` once it writes
    its first file. No signal raises inside the run: a KeyboardInterrupt raised inside a library can be
    swallowed there (numpy's Cython import machinery does, and the run would train on), or escape an ``exec``
    of generated code (dataclasses), after which ``python -m`` exits by SIGINT, not 130; raised inside a step
    (in backward, say) it would lose the step. The one exception is a second signal during the setup, which
    stops it at once (the setup writes nothing, and a long one, loading data, need not be waited for). A step
    is short; to stop without waiting for it, SIGKILL: the resume from the last checkpoint is exact. A rank of
    a distributed run gets the same signal from several senders (the terminal, the launcher, torchrun's agent)
    alike; the launcher and the agent kill the ranks if they must.

    A KeyboardInterrupt leaving the block (the run stopped, and says where) settles the command's ending.
    Installed even where the shell set SIGINT to be ignored (a run started in the background): a run's stop
    keeps its checkpoint, so it is never worse than going on."""
    flag = {"hit": False, "setup": True}
    if not _main_thread():
        yield flag
        return
    previous = _install()
    # A signal the command had before this run (one whose KeyboardInterrupt a library swallowed, or one at the
    # last step of a suite's previous run) stops this run at its first check point.
    flag["hit"] = _state["signals"] > 0
    outer, _state["run"] = _state["run"], flag
    try:
        yield flag
    except KeyboardInterrupt:
        _state["settled"] = True
        raise
    finally:
        _state["run"] = outer
        if previous is not None:
            _put_back(previous)
