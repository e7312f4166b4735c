"""The exception types that end a run in a defined way, and the exit code each one gets.

The CLI turns a ``UserError`` (and a ``ValueError`` raised while a run is being set up, which is how the
library reports invalid arguments) into one line on stderr and exit code 2, a ``TrainingDiverged`` into one
line and exit code 3; anything else is a bug (exit 1, with its traceback).
"""

from __future__ import annotations

import sys
import traceback

__all__ = ["TrainingDiverged", "UserError", "exit_code"]


class UserError(ValueError):
    """Invalid input: an unknown name, a bad value, a missing or corrupt file. The message is shown as is."""


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient norm is not finite (``train.nonfinite = "stop"``); the CLI exits 3."""


def exit_code(e: BaseException) -> int:
    """Report a failure the way every bubblefree entry point does and return its exit code: 2 invalid input
    (one line), 3 a diverged run (one line naming the step and the last good checkpoint), 130 interrupted,
    1 anything else (with its traceback: a bug)."""
    if isinstance(e, UserError):
        print(f"bubblefree: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if isinstance(e, KeyboardInterrupt):  # a stopped run's message says where its checkpoint is
        if str(e) or type(e) is KeyboardInterrupt:  # the other ranks of a distributed run stop silently
            print(f"bubblefree: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130
    if isinstance(e, TrainingDiverged):
        print(f"bubblefree: error: {e}", file=sys.stderr)
        return 3
    traceback.print_exception(e)
    return 1
