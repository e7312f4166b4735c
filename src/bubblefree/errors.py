"""The exception types that end a run in a defined way, and the exit code each one gets.

The CLI turns a ``UserError`` (and a ``ValueError`` raised while a run is being set up, which is how the
library reports invalid arguments) into one line on stderr and exit code 2, a ``TrainingDiverged`` into one
line and exit code 3, a ``FileSystemFault`` (and an ``OSError`` of a file operation the user can cause: a
read-only folder, a full disk, a name too long) into one line and exit code 4; anything else is a bug (exit
1, with its traceback).
"""

from __future__ import annotations

import errno
import sys
import traceback

__all__ = ["FILESYSTEM_ERRNOS", "FileSystemFault", "TrainingDiverged", "UserError", "describe_os_error",
           "exit_code"]

FILESYSTEM_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG,
                               errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EMLINK})
"""The errors of file operations that the user's machine causes, not the code: permissions, a read-only or
full filesystem, a quota, a name too long, a path through a file. Reported in one line, exit code 4."""


class UserError(ValueError):
    """Invalid input: an unknown name, a bad value, a missing or corrupt file. The message is shown as is."""


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient norm is not finite (``train.nonfinite = "stop"``); the CLI exits 3."""


class FileSystemFault(RuntimeError):
    """The operating system refused a file operation the command needs (``FILESYSTEM_ERRNOS``); the message
    names the file and, for a run, its last good checkpoint. The CLI exits 4."""


def describe_os_error(e: OSError) -> str:
    """``PATH: reason`` of an OSError, e.g. ``runs/a/checkpoints: Read-only file system``."""
    where = e.filename if e.filename is not None else "a file"
    return f"{where}: {e.strerror or e}"


def exit_code(e: BaseException) -> int:
    """Report a failure the way every bubblefree entry point does and return its exit code: 2 invalid input
    (one line), 3 a diverged run (one line naming the step and the last good checkpoint), 130 interrupted,
    4 the filesystem refused (one line), 1 anything else (with its traceback: a bug)."""
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
    if isinstance(e, FileSystemFault):
        print(f"bubblefree: error: {e}", file=sys.stderr)
        return 4
    if isinstance(e, OSError) and e.errno in FILESYSTEM_ERRNOS:
        print(f"bubblefree: error: {describe_os_error(e)}", file=sys.stderr)
        return 4
    traceback.print_exception(e)
    return 1
