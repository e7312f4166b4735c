"""The exception types that end a run in a defined way, and the exit code each one gets.

The CLI turns a ``UserError`` (and a ``ValueError`` raised while a run is being set up, which is how the
library reports invalid arguments) into one line on stderr and exit code 2, a ``TrainingDiverged`` into one
line and exit code 3, a ``FileSystemFault`` (and an ``OSError`` of a file operation the user can cause: a
read-only folder, a full disk, a name too long) into one line naming the file and what to do, and exit code 4;
anything else is a bug (exit 1, with its traceback).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
import traceback
from collections.abc import Iterator

__all__ = ["FILESYSTEM_ERRNOS", "FileSystemFault", "TrainingDiverged", "UserError", "describe_os_error",
           "exit_code", "naming"]

_WHAT_TO_DO = {
    errno.EACCES: "this user may not use it: give the user access, or choose another place",
    errno.EPERM: "the system does not permit it: give this user access, or choose another place",
    errno.EROFS: "its filesystem is read-only: remount it writable, or choose a place on another filesystem",
    errno.ENOSPC: "its filesystem is full: free space there (df -h shows how much is left), or choose a place on "
                  "another filesystem",
    errno.EDQUOT: "your disk quota there is used up: free space within it, or choose a place elsewhere",
    errno.EFBIG: "the file reached the largest size this process may write (ulimit -f) or its filesystem holds: "
                 "raise the limit, or choose a place on another filesystem",
    errno.ENAMETOOLONG: "a name in the path is longer than its filesystem allows: choose a shorter one",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path",
    errno.EISDIR: "it is a folder where a file is needed: choose another path",
    errno.ELOOP: "the path runs through too many symbolic links: resolve them, or choose another path",
    errno.EMLINK: "its folder holds as many entries as its filesystem allows: choose another folder",
    errno.EIO: "the disk or the network filesystem failed to read or write it: check the device (dmesg shows "
               "its errors), or choose a place on another filesystem",
}
"""What the user can do about each of :data:`FILESYSTEM_ERRNOS`, said after the error."""

FILESYSTEM_ERRNOS = frozenset(_WHAT_TO_DO)
"""The errors of file operations that the user's machine causes, not the code: permissions, a read-only or
full filesystem, a quota, a file size limit, a name too long, a path through a file, a failing disk. Reported
in one line naming the file and what to do, exit code 4."""


class UserError(ValueError):
    """Invalid input: an unknown name, a bad value, a missing or corrupt file. The message is shown as is."""


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient norm is not finite (``train.nonfinite = "stop"``); the CLI exits 3."""


class FileSystemFault(RuntimeError):
    """The operating system refused a file operation the command needs (``FILESYSTEM_ERRNOS``); the message
    names the file and, for a run, its last good checkpoint. The CLI exits 4."""


def describe_os_error(e: OSError) -> str:
    """``PATH: reason (what to do)`` of an OSError, e.g. ``runs/a/checkpoints: Read-only file system (its
    filesystem is read-only: remount it writable, or choose a place on another filesystem)``."""
    where = _path_of(e) or "a file the system did not name"
    advice = f" ({_WHAT_TO_DO[e.errno]})" if e.errno in _WHAT_TO_DO else ""
    return f"{where}: {e.strerror or e}{advice}"


def _path_of(e: OSError) -> str | None:
    """The file ``e`` is about: its ``filename``; else, since a failed ``write()`` or ``flush()`` names none (the
    system call has only a file descriptor), the open file that the innermost frame of its traceback holding one
    was writing: a local of that frame (``Path.write_text``'s, ``open()``'s) or an attribute of its ``self`` (a
    writer keeping its file open). None when no frame holds a named file."""
    if e.filename is not None:
        return os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes, os.PathLike)) else str(e.filename)
    frames, tb = [], e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        owner = frame.f_locals.get("self")
        held = [*frame.f_locals.values(), *(vars(owner).values() if hasattr(owner, "__dict__") else ())]
        named = [f.name for f in held if isinstance(f, io.IOBase) and isinstance(getattr(f, "name", None), str)]
        if named:
            return named[0]
    return None


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Give an OSError raised in the block ``path`` as its file when it names none (a failed ``write()``,
    ``flush()`` or ``fsync()`` on a descriptor), so that its one line says which file (:func:`describe_os_error`)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = os.fspath(path)
        raise


def exit_code(e: BaseException, *, say: bool = True) -> int:
    """Report a failure the way every bubblefree entry point does and return its exit code: 2 invalid input
    (one line), 3 a diverged run (one line naming the step and the last good checkpoint), 130 interrupted,
    4 the filesystem refused (one line), 1 anything else (with its traceback: a bug). ``say``: print the one
    line (every rank of a torchrun job knows the same failure, and the first process of each node says it); a
    bug's traceback is printed whatever ``say``."""
    if isinstance(e, UserError):
        code, line = 2, f"error: {' '.join(str(e).split())}"
    elif isinstance(e, KeyboardInterrupt):  # a stopped run's message says where its checkpoint is
        # the other ranks of a distributed run stop silently (an empty subclass of KeyboardInterrupt)
        code, line = 130, str(e) or ("interrupted" if type(e) is KeyboardInterrupt else None)
    elif isinstance(e, (TrainingDiverged, FileSystemFault)):
        code, line = 3 if isinstance(e, TrainingDiverged) else 4, f"error: {e}"
    elif isinstance(e, OSError) and e.errno in FILESYSTEM_ERRNOS:
        code, line = 4, f"error: {describe_os_error(e)}"
    else:
        traceback.print_exception(e)
        return 1
    if say and line is not None:
        print(f"bubblefree: {line}", file=sys.stderr)
    return code
