"""Where the token-wise loops (the tiled MLP, the chunked LM head) start their tiles.

On real tensors every tile runs. On fake tensors (the simulator, plan/simulate.py) only
the first two and the last do: each loop allocates its outputs and accumulators before or
in its first tile, and every later whole tile allocates and frees the same transients in
the same order, so the middle tiles repeat the second one's memory events exactly — the
peaks are those of the whole loop (tests/test_simulate_fast.py, and every test that
compares a simulation with an exact CPU measurement) — and the simulation of a long
sequence costs three tiles' dispatch per loop instead of hundreds.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["tile_starts"]


def tile_starts(n_tokens: int, tile: int, reference: torch.Tensor) -> range | list[int]:
    """Start of each tile of ``tile`` tokens over ``n_tokens``; on a fake ``reference``
    only the first two tiles and the last (module docstring)."""
    starts = range(0, n_tokens, tile)
    if len(starts) > 3 and is_fake(reference):
        return [starts[0], starts[1], starts[-1]]
    return starts
