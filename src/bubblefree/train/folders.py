"""Who may write a folder: one process at a time per run (an OS lock), and only into folders bubblefree made.

A run folder (and a ``reproduce`` results folder) has one writer. :func:`hold` takes an exclusive
``fcntl.flock`` on ``FOLDER/.bubblefree.lock`` for as long as the writer lives; the kernel releases it when the
process ends, however it ends (SIGKILL included), so a crash never leaves a stale lock behind and nothing has
to be cleaned up by hand. A reader that must not see a run change under it (``export``) takes the lock shared:
readers exclude writers, not each other. A second writer is refused with one line naming the holder's pid,
read from ``/proc/locks`` (Linux) so that the lock file itself is never written: a refused command changes no
byte of the folder. The lock file stays empty and is kept (deleting a lock file while another process waits
on it would let two processes hold "the" lock on two different files).

:func:`check_ours` refuses an output folder that holds files bubblefree did not write there (the user's own
``loss.png``, say), so no command overwrites them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from bubblefree.errors import UserError

__all__ = ["LOCK_FILE", "check_ours", "hold", "holder_pids"]

LOCK_FILE = ".bubblefree.lock"
_held: dict[str, tuple[int, int]] = {}
"""The locks this process holds: resolved folder -> (file descriptor, nesting depth), so a library call
inside a command that already holds its folder's lock (``reproduce`` -> ``train``) does not refuse itself."""


def holder_pids(lock_file: Path) -> list[int]:
    """Pids of the processes holding a flock on ``lock_file``, from ``/proc/locks``; [] where unknown."""
    try:
        st = lock_file.stat()
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 1234 00:2f:5678 0 EOF" (blocked waiters have "->")
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device and fields[4].isdigit():
            pids.append(int(fields[4]))
    return sorted(set(pids))


@contextlib.contextmanager
def hold(folder: str | Path, *, what: str, shared: bool = False, create: bool = False) -> Iterator[None]:
    """Hold ``folder``'s lock while the block runs (exclusive: the one writer; ``shared``: a reader).

    ``create`` makes the folder first when it is missing, and removes it again on the way out when it still
    holds nothing but the lock file (a new run refused at setup leaves no folder behind). A shared lock on a
    folder this process may not write (a read-only copy of a run) is not needed: no one can write there.
    ``what`` names the command's argument in the refusal (``--resume``, ``--out``, ``export source``)."""
    folder = Path(folder)
    key = str(folder.resolve())
    if key in _held:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
        try:
            yield
        finally:
            _held[key] = (fd, _held[key][1] - 1)
        return
    made = create and not folder.exists()
    if made:
        folder.mkdir(parents=True)
    lock_file = folder / LOCK_FILE
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT if not shared else os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as e:
        if shared and e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            yield
            return
        raise
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            pids = [p for p in holder_pids(lock_file) if p != os.getpid()]
            who = f"pid {', '.join(map(str, pids))}" if pids else "another process"
            raise UserError(f"Invalid {what}: {folder} is in use by another bubblefree process ({who}); wait "
                            f"for it to end, or stop it (a run stops at its next step with kill -INT "
                            f"{pids[0] if pids else 'PID'})") from None
        _held[key] = (fd, 1)
        try:
            yield
        finally:
            del _held[key]
            with contextlib.suppress(OSError):  # best effort: a folder that cannot be tidied is only empty
                if made and {p.name for p in folder.iterdir()} <= {LOCK_FILE}:
                    lock_file.unlink()
                    folder.rmdir()
    finally:
        os.close(fd)  # releases the lock


_OUTPUTS = (*((name, "a bubblefree training run") for name in ("config.toml", "metrics.jsonl", "checkpoints")),
            ("runs", "the results of bubblefree reproduce"),
            ("simulate.json", "the output of bubblefree simulate"), ("plan.json", "the output of bubblefree plan"),
            ("bubblefree.toml", "a model written by bubblefree export"))
"""The files that mark each kind of folder a bubblefree command writes, and what to call the folder: a folder
without any of them holds no bubblefree output."""


def check_ours(folder: Path, *, what: str, ours: Iterable[str] = (), marker: str | None = None) -> None:
    """Refuse ``folder`` when it exists and holds anything bubblefree did not write: names outside ``ours``,
    unless it holds ``marker`` (the file that makes it a folder of the command's own, e.g. ``simulate.json``)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise UserError(f"Invalid {what}: {folder} exists and is not a folder")
    if marker is not None and (folder / marker).exists():
        return
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in {*ours, LOCK_FILE})
    if foreign:
        listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        kind = next((kind for name, kind in _OUTPUTS if name in foreign), None)
        holds = (f"holds {kind} ({listed}), not output of this command" if kind else
                 f"is not empty and holds no bubblefree output ({listed})")
        raise UserError(f"Invalid {what}: {folder} {holds}; nothing is written into it: choose a new or empty "
                        f"folder")
