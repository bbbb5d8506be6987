"""The ``spaco`` engine's schedule: SeCO's (:mod:`..seco.schedule`) over a random subset of chunks.

**SpaCO** backpropagates a random subset of chunks. Each chunk is selected
*independently* with probability ρ = t/k (t = ``budget``, k = chunk count; t chunks
on average). A gradient path from a loss term of chunk j through the K/V of chunks
j > c₁ > … > c_p into the parameters survives only if all its p + 1 chunks are
selected, which has probability ρ^(p+1) because selections are independent. Each
selected chunk's own loss is weighted k/t and every relay hop multiplies the K/V
gradient by k/t, so the path carries (k/t)^(p+1) and its expected contribution is
exactly its share of the full gradient: the estimate is unbiased. (Sampling exactly t
chunks without replacement makes a path's survival probability a ratio of falling
factorials that no per-hop factor can undo — the paper's (k/t)^p is then only
approximate — hence independent selection.) ``cap`` limits the relay factor (the paper
recommends 2 to curb variance); any cap below k/t biases long paths towards zero, by the
factor (cap·t/k)^p for a p-hop path; docs/seco.md reports the measured bias.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..base import EngineContext
from ..seco.schedule import backward_chunk_major, forward_chunk_major, start_run

__all__ = ["select_chunks", "spaco_step"]


def select_chunks(n_chunks: int, budget: int, generator: torch.Generator) -> set[int]:
    """Each chunk independently with probability min(1, budget / n_chunks)."""
    rho = min(1.0, budget / n_chunks)
    draws = torch.rand(n_chunks, generator=generator)
    return {i for i in range(n_chunks) if float(draws[i]) < rho}


def spaco_step(context: EngineContext, batch, num_label_tokens: int | None = None, selected: set[int] | None = None):
    options = context.engine_options
    run = start_run(context, batch, num_label_tokens)
    k = len(run.bounds)
    ratio = max(1.0, k / options.budget)  # k/t; every chunk is taken when t >= k
    if selected is None and is_fake(run.shard.input_ids):
        # Simulation: the memory of a step does not depend on which chunks are drawn.
        selected = set(range(max(0, k - options.budget), k))
    if selected is None:
        # The step's seed comes from the global RNG, which the trainer seeds and saves in
        # checkpoints, so a resumed run draws the same chunks; ``seed`` varies the stream.
        step_seed = int(torch.randint(0, 2**62, (1,)))
        generator = torch.Generator().manual_seed(step_seed ^ options.seed)
        selected = select_chunks(k, options.budget, generator)
    run.selected = selected
    run.hop_factor = ratio if options.cap is None else min(ratio, options.cap)
    try:
        loss = forward_chunk_major(run)
        if selected:
            backward_chunk_major(run, torch.ones_like(loss), own_factor=ratio)
    finally:
        run.store.clear()
    return context.finish(loss)
