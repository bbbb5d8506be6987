"""The one exception type for mistakes a user can fix, and the file-system failures that
become one.

Anything raised as :class:`LongtrainError` is printed by the command line as a single
line (no traceback) and exits with a non-zero code, so every message must name the
problem *and* the fix.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path

__all__ = ["LongtrainError", "writing"]


class LongtrainError(Exception):
    """A user-fixable problem: bad input, an unsupported combination, a corrupt file."""


_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
_IN_THE_WAY = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR)


def is_disk_full(exc: BaseException, path: str | Path | None = None) -> bool:
    """Whether ``exc`` is a write that failed for want of space. Writers built on native
    code do not raise OSError for it: safetensors raises its own error naming "No space
    left on device", torch.save a RuntimeError saying only that a write failed — for
    those, the disk at ``path`` having (almost) nothing free is the evidence."""
    if isinstance(exc, OSError) and exc.errno in _FULL:
        return True
    if "No space left on device" in str(exc) or "StorageFull" in str(exc):
        return True
    if path is None or isinstance(exc, OSError):
        return False
    try:
        return shutil.disk_usage(Path(path)).free < (1 << 20)
    except OSError:
        return False


def file_error(exc: BaseException, what: str, path: str | Path | None = None, then: str = "") -> LongtrainError:
    """One line for a failed write of ``what``: the reason and what to do about it.
    ``then`` says how to carry on once it is fixed (``"continue with --resume"``)."""
    code = exc.errno if isinstance(exc, OSError) else None
    where = path or getattr(exc, "filename", None)  # what the user named, not a temporary file
    if is_disk_full(exc, path):
        reason, fix = "the disk is full", "free space on it or pass --out on another disk"
    elif code in _DENIED:
        reason, fix = "permission denied", "make it writable or pass --out a directory you can write to"
    elif code in _IN_THE_WAY:
        reason, fix = f"{exc.strerror.lower()} (a file stands where a directory is needed, or the reverse)", \
            "pass --out a path whose parts are directories or do not exist yet"
    else:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        fix = "check the disk and the path, or pass --out elsewhere"
    at = f" ({where})" if where else ""
    return LongtrainError(f"cannot write {what}{at}: {reason}; {fix}" + (f", then {then}" if then else ""))


@contextlib.contextmanager
def writing(what: str, path: str | Path | None = None, then: str = ""):
    """Turn a failed write inside the block into one :func:`file_error` line. OSError
    always counts (the file system said no); other exceptions only when they are a full
    disk in disguise (see :func:`is_disk_full`) — anything else keeps its traceback."""
    try:
        yield
    except LongtrainError:
        raise
    except OSError as exc:
        raise file_error(exc, what, path, then) from None
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a full disk
        if not is_disk_full(exc, path):
            raise
        raise file_error(exc, what, path, then) from None
