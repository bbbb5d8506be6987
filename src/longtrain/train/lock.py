"""One run at a time in a run directory.

A run holds an advisory lock (``flock``) on ``.lock`` in its ``--out`` directory from
the moment it touches the directory until it ends. The operating system releases the
lock with the process — however it ends, ``kill -9`` included — so a stale lock never
blocks the next run. Kept free of torch: the command line may check before loading it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ..errors import LongtrainError

__all__ = ["LOCK_FILE", "RunLock", "check_not_in_use"]

LOCK_FILE = ".lock"

try:
    import fcntl
except ImportError:  # not a POSIX system: runs are not locked
    fcntl = None

_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _holder(path: Path) -> int | None:
    """The process holding the lock on ``path``, where the system says (Linux's
    /proc/locks, same machine); None otherwise."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 00:2e:67890 0 EOF" (blocked waiters carry a "->" field)
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device and fields[4].isdigit():
            return int(fields[4]) or None
    return None


def _in_use(out: Path, path: Path) -> LongtrainError:
    pid = _holder(path)
    who = f" (process {pid})" if pid is not None and pid != os.getpid() else ""
    return LongtrainError(f"--out {out} is in use by another longtrain run{who}; wait for it to end or stop it, "
                          "or pass --out NEW_DIR")


def _try_lock(fd: int) -> bool | None:
    """Lock ``fd`` without waiting: True when locked, False when another holds it,
    None where the file system takes no locks (the run goes on unlocked)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        return None


def check_not_in_use(out: str | Path) -> None:
    """Refuse ``out`` while another run holds it, touching nothing (its lock file is
    only opened, and the lock let go at once)."""
    out = Path(out)
    path = out / LOCK_FILE
    if fcntl is None or not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # unreadable: taking the lock for real (RunLock) reports it
    try:
        if _try_lock(fd) is False:
            raise _in_use(out, path)
    finally:
        os.close(fd)  # closing lets go of the lock


class RunLock:
    """The lock a run holds on its ``--out``: :meth:`acquire` or a one-line refusal
    while another process holds it; :meth:`release` (or the process ending) lets go."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = self.out / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (the directory must exist); a file system without locks lets
        the run go on unlocked."""
        if fcntl is None or self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        locked = _try_lock(fd)
        if locked is False:
            os.close(fd)
            raise _in_use(self.out, self.path)
        if locked is None:
            os.close(fd)
            return
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor lets go of the lock

    def __del__(self):
        self.release()
