"""Which of the token rows an op sees are real tokens: a thread-local context.

Statistics over a batch's real tokens (a router's load-balancing counts) are taken deep
inside a layer, on its tokens flattened to rows (B·T, d) — or on a tile of those rows
under a tiled MLP. The layer's caller knows which tokens are padding; the op does not.
So the caller sets the rows' weights around the layer (:func:`layer_rows`), a tiled
MLP narrows them to each tile (:func:`tile`), and the op reads its own rows
(:func:`current`). A tiled MLP's backward runs on autograd's thread (on CUDA), so it
takes the context with it (:func:`capture`, :func:`restore`).

Shapes: weights (B, T) of the layer call's tokens, 1 for a real token and 0 for padding,
or None (every row is real); an op of N rows starting at flattened row ``offset`` reads
``weights.reshape(-1)[offset:offset + N]``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

__all__ = ["RowContext", "capture", "current", "layer_rows", "restore", "tile"]

_local = threading.local()


@dataclass(frozen=True)
class RowContext:
    """The layer call's row weights (None: all real) and the offset of the rows in use."""

    weights: torch.Tensor | None = None
    offset: int = 0

    def rows(self, count: int, device: torch.device) -> torch.Tensor | None:
        """Weights of ``count`` rows from :attr:`offset` (None: all real)."""
        if self.weights is None:
            return None
        return self.weights.reshape(-1)[self.offset:self.offset + count].to(device)


def current() -> RowContext | None:
    """The context set on this thread (None: no layer call declared its rows)."""
    return getattr(_local, "context", None)


capture = current


@contextlib.contextmanager
def restore(context: RowContext | None):
    """Set ``context`` (a :func:`capture`) for the block."""
    before = current()
    _local.context = context
    try:
        yield
    finally:
        _local.context = before


def layer_rows(weights: torch.Tensor | None):
    """Around a layer call whose tokens have ``weights`` (B, T) (None: all real)."""
    return restore(RowContext(weights, 0))


def tile(start: int):
    """Around an op on rows ``start:`` of the context's rows (a tile of a tiled MLP)."""
    context = current()
    return restore(None if context is None else RowContext(context.weights, context.offset + start))
