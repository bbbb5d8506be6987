"""Each family's check in a forked child process of its own, its memory bounded."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict

import torch

from .check import check_family
from .result import FamilyResult, _finish, _one_line

__all__ = ["MEMORY_LIMIT", "check_in_process"]

MEMORY_LIMIT = 4 * 2**30  # bytes one family's check may use (its child process's address space)

# What an allocation refused under the limit raises (Python's MemoryError, the CPU allocator's
# "can't allocate memory", errno 12's text, C++'s bad_alloc), as a check's one-line verdicts spell it.
_OUT_OF_MEMORY = ("MemoryError", "can't allocate memory", "Cannot allocate memory", "bad_alloc")

def check_in_process(family: str, timeout: float = 120.0, memory_limit: int | None = MEMORY_LIMIT) -> FamilyResult:
    """:func:`check_family` in a forked child process of its own, its memory bounded: the
    child's address space (RLIMIT_AS, what it inherits from this process included) may not
    pass ``memory_limit`` bytes (None: unbounded), so neither can its resident memory. A
    family whose check needs more is reported as not built, "exceeded the memory limit of
    N GiB"; one that hangs past ``timeout`` seconds or crashes the interpreter as not built
    too, and the next one runs."""
    return _check_in_child(family, timeout, memory_limit)[0]

def _check_in_child(family: str, timeout: float = 120.0,
                    memory_limit: int | None = MEMORY_LIMIT) -> tuple[FamilyResult, int]:
    """:func:`check_in_process`'s verdict and the child's peak resident memory in bytes (its
    ``ru_maxrss``, from ``wait4`` as it ends). The child sends one line of JSON through a pipe."""
    import os
    import select
    import signal
    import sys

    from .. import strategy  # noqa: F401  (imported once here, inherited by every forked check)

    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written again by the child
        stream.flush()
    read, write = os.pipe()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(read)
            _check_into(family, write, memory_limit)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    received, timed_out = b"", False
    try:
        while not received.endswith(b"\n"):
            left = started + timeout - time.perf_counter()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                timed_out = True
                break
            chunk = os.read(read, 1 << 16)
            if not chunk:  # the child ended without a verdict
                break
            received += chunk
    finally:
        os.close(read)
        if timed_out or not received.endswith(b"\n"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
    peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # Linux counts KiB
    message = json.loads(received) if received.endswith(b"\n") else None
    if message is not None and not message.get("exceeded"):
        return FamilyResult(**message["verdict"]), peak
    partial = (message or {}).get("verdict") or {}
    result = FamilyResult(family, "not built", partial.get("adapter"),
                          cells={name: v for name, v in partial.get("cells", {}).items() if not _out_of_memory(v)})
    if message is not None:
        reason = f"exceeded the memory limit of {_gib(memory_limit)}" if memory_limit is not None else "out of memory"
    elif timed_out:
        reason = f"no verdict within {timeout:.0f} s"
    elif os.WIFSIGNALED(status):
        reason = f"the check was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        reason = f"the check exited with code {os.waitstatus_to_exitcode(status)}"
    return _finish(result, "not built", reason, started), peak

def _check_into(family: str, out: int, memory_limit: int | None) -> None:
    """The child's part: bound its address space, check ``family``, and write one line of
    JSON to the file descriptor ``out``: the verdict, and whether an allocation failed
    under the limit anywhere in the check (the check records most failures as its cells'
    or its reason's one line; those are read here) — then the verdict is "exceeded"."""
    import os
    import resource
    import warnings

    started = time.perf_counter()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny models gain nothing from more; idle OpenMP threads spin beside other work
    if memory_limit is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = memory_limit if hard == resource.RLIM_INFINITY else min(memory_limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        verdict = asdict(check_family(family))
        message = {"verdict": verdict,
                   "exceeded": any(_out_of_memory(v) for v in [verdict["reason"], *verdict["cells"].values(),
                                                                   *verdict["dropout"].values()])}
    except MemoryError:
        message = {"exceeded": True}
    except Exception as error:  # noqa: BLE001 - reported as the family's verdict, in one line
        line = _one_line(error)
        message = {"exceeded": True} if _out_of_memory(line) else \
            {"verdict": asdict(_finish(FamilyResult(family, "not built"), "not built", line, started))}
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(out, data):]

def _out_of_memory(value) -> bool:
    return isinstance(value, str) and any(sign in value for sign in _OUT_OF_MEMORY)

def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"
