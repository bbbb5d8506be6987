"""A flag that a ``with`` block raises on the thread that runs it.

For signals from a caller to code it reaches only through a model's own forward
(an engine telling the tiled MLP its output goes unread; the pinned pool telling the
memory tracker its tensors are host memory). Thread-local, because CUDA runs autograd's
backward on another thread, which must not see a forward's flag."""

from __future__ import annotations

import contextlib
import threading

__all__ = ["ThreadFlag"]


class ThreadFlag:
    def __init__(self):
        self._local = threading.local()

    @property
    def on(self) -> bool:
        return getattr(self._local, "on", False)

    @contextlib.contextmanager
    def raised(self):
        before = self.on
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = before
