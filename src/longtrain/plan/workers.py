"""The worker processes that simulate a plan's candidates, started before torch loads.

A worker spends seconds importing torch, transformers and the simulator. The command line
starts them (:func:`start_early`) before its own process imports any of that, so the
imports overlap, and the plan adopts them (:func:`adopt`). Nothing heavy is imported here.
"""

from __future__ import annotations

__all__ = ["adopt", "pool", "start_early", "stop_now"]

_EARLY: list = []  # the pool start_early made, until a plan adopts it: [(workers, executor)]


def pool(workers: int):
    """A pool of ``workers`` fresh interpreters (spawned, not forked from a process that may
    hold threads), each importing the simulator as its first task."""
    import concurrent.futures
    import multiprocessing

    executor = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    for _ in range(workers):
        executor.submit(_ready)
    return executor


def start_early(workers: int) -> None:
    """Start a plan's ``workers`` now, for :func:`adopt` to hand over (none for one)."""
    if workers > 1 and not _EARLY:
        _EARLY.append((workers, pool(workers)))


def adopt(workers: int):
    """The pool :func:`start_early` started for ``workers``, or None; a pool of another
    size is stopped."""
    if not _EARLY:
        return None
    count, executor = _EARLY.pop()
    if count == workers:
        return executor
    stop_now(executor)
    return None


def discard() -> None:
    """Stop a pool that no plan adopted (the request was refused)."""
    while _EARLY:
        stop_now(_EARLY.pop()[1])


def stop_now(executor) -> None:
    """Cancel what has not started and end the worker processes at once, without waiting for
    the simulations they run (the standard library ends them only from Python 3.14 on)."""
    terminate = getattr(executor, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join()


def _ready() -> None:
    """A worker's first task: the simulator (torch, transformers, every engine) imported."""
    from . import simulate  # noqa: F401
