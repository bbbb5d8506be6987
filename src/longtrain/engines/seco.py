"""Chunk-wise optimization engines: ``seco`` (exact) and ``spaco`` (sparse, unbiased).

Paper: the SeCO/SpaCO paper (Alg. 1–2). Both run the sequence through the
whole model chunk by chunk without gradients, parking every layer's K/V per chunk in a
:class:`~longtrain.memory.chunk_store.ChunkStore` (on the device or in host memory);
then, from the last chunk to the first, each chunk is recomputed with gradients against
the parked K/V of the earlier chunks (attention merged by log-sum-exp, never by
concatenating copies) and backpropagated. The gradient this sends to earlier chunks'
K/V waits in the store and joins those chunks' own K/V gradient when their turn comes
(and is freed then). Forward activations exist for one chunk at a time; only K/V grows
with the sequence. The pieces (store, attention calls, rotary tables, head) come from
:class:`~longtrain.engines.chunked.ChunkedRun`; the chunk-major order is this module's.

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

import contextlib
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import validate
from ..memory.units import parse_bytes
from ..registry import EngineSpec, register
from .base import EngineContext
from .batch import prepare_batch
from .chunked import ChunkedRun, ChunkSettings, check_chunkable, check_host_budget
from .chunked_costs import SeCOCosts, SpaCOCosts

__all__ = ["SeCOOptions", "SpaCOOptions", "seco_step", "select_chunks", "spaco_step"]


@dataclass
class SeCOOptions:
    """Knobs of the exact chunk-wise engine."""

    _name = "seco"
    chunk: int = 4096  # tokens per chunk
    offload: bool = False  # park K/V (and K/V gradients) in host memory
    prefetch: int = 1  # K/V chunks fetched ahead
    host_memory: str | int | None = None  # host budget, e.g. "64GiB"; default: half the physical memory on CUDA
    # bf16/fp16 parameters: sum the chunks' gradients in float32 and round once (stock's precision at any
    # chunk count) at the price of a float32 copy of every trainable parameter during backward.
    float32_grad_sum: bool = False

    def __post_init__(self):
        validate.positive_int(self._name, "chunk", self.chunk)
        validate.positive_int(self._name, "prefetch", self.prefetch, minimum=0)
        validate.flag(self._name, "offload", self.offload)
        validate.flag(self._name, "float32_grad_sum", self.float32_grad_sum)
        if self.host_memory is not None:
            validate.byte_size(self._name, "host_memory", self.host_memory)

    def settings(self) -> ChunkSettings:
        return ChunkSettings(chunk=self.chunk, offload=self.offload, prefetch=self.prefetch,
                             host_budget=None if self.host_memory is None else parse_bytes(self.host_memory),
                             float32_grad_sum=self.float32_grad_sum)


@dataclass
class SpaCOOptions(SeCOOptions):
    """Knobs of the sparse engine: ``budget`` chunks backpropagated per step on average."""

    _name = "spaco"
    chunk: int = 128
    budget: int = 8  # t: expected number of chunks backpropagated per step
    cap: float | None = None  # limit on the relay factor k/t (paper: 2); None: unbiased
    seed: int = 0  # chunk selection: seeded per step, so runs repeat

    def __post_init__(self):
        super().__post_init__()
        validate.positive_int("spaco", "budget", self.budget)
        if self.cap is not None:
            validate.finite_number("spaco", "cap", self.cap, minimum=1)
        validate.positive_int("spaco", "seed", self.seed, minimum=0, maximum=2**63 - 1)  # a torch generator's seed


def forward_chunk_major(run: ChunkedRun) -> torch.Tensor:
    """SeCO's pass 1: the whole model on each chunk in turn, without gradients, parking
    every layer's K/V; returns the summed loss."""
    total = None
    with torch.no_grad(), run.context.forward_pass():
        for i in range(len(run.bounds)):
            loss = _chunk_forward(run, i, "forward")
            total = loss if total is None else total + loss
    return total


def backward_chunk_major(run: ChunkedRun, grad_loss: torch.Tensor, own_factor: float = 1.0) -> None:
    """Chunks from the last, each recomputed through the whole model against the parked
    K/V of earlier chunks and backpropagated from its own loss (times ``own_factor``)
    plus the K/V gradients later chunks relayed to it. With ``run.selected`` set
    (SpaCO), only those chunks are recomputed. Every chunk's backward reaches every
    layer: with ``float32_grad_sum`` the whole model's gradients are summed in float32."""
    with run.gradient_sum(run.adapter.model.parameters()) as sums:
        for i in reversed(range(len(run.bounds))):
            if run.selected is None or i in run.selected:
                # K/V gradients reach this chunk inside attend_chunk's backward (take_grad, which
                # brings back the layer below's while this one runs); the top layer's start now.
                if run.settings.prefetch:
                    run.store.prefetch(("dk", len(run.layers) - 1, i))
                    run.store.prefetch(("dv", len(run.layers) - 1, i))
                with _weighted_routes(run, own_factor):  # a router's balancing gradient, weighted as the chunk's loss
                    torch.autograd.backward(_chunk_forward(run, i, "recompute"), grad_loss * own_factor)
                sums.collect()
            for layer in range(len(run.layers)):
                run.discard_kv(layer, i)


def _weighted_routes(run: ChunkedRun, factor: float):
    balance = run.context.router_balance
    return contextlib.nullcontext() if balance is None or factor == 1.0 else balance.scaled(factor)


def _chunk_forward(run: ChunkedRun, i: int, mode: str) -> torch.Tensor:
    """Chunk ``i`` through the whole model and its loss; a recomputation draws the random
    numbers the chunk's forward drew."""
    if mode == "forward":
        run.record_draws(i)
    with run.replay_draws(i) if mode == "recompute" else contextlib.nullcontext():
        hidden = run.adapter.embed(run.input_ids(i))
        for layer in range(len(run.layers)):
            hidden = run.run_layer(layer, hidden, i, mode)
        return run.chunk_loss(run.adapter.final_norm(hidden), i)


def _run(context: EngineContext, batch, num_label_tokens, engine: str) -> ChunkedRun:
    settings = context.engine_options.settings()
    shard = context.shard(prepare_batch(batch, num_label_tokens), chunk=settings.chunk)
    check_host_budget(context, shard, settings, engine)
    return ChunkedRun(context, shard, settings)


_ACCEPTS = ("checkpoint", "mst", "liger")


def seco_step(context: EngineContext, batch, num_label_tokens: int | None = None):
    run = _run(context, batch, num_label_tokens, "seco")
    try:
        loss = forward_chunk_major(run)
        backward_chunk_major(run, torch.ones_like(loss))
    finally:
        run.store.clear()
    return context.finish(loss)


def select_chunks(n_chunks: int, budget: int, generator: torch.Generator) -> set[int]:
    """Each chunk independently with probability min(1, budget / n_chunks)."""
    rho = min(1.0, budget / n_chunks)
    draws = torch.rand(n_chunks, generator=generator)
    return {i for i in range(n_chunks) if float(draws[i]) < rho}


def spaco_step(context: EngineContext, batch, num_label_tokens: int | None = None, selected: set[int] | None = None):
    options = context.engine_options
    run = _run(context, batch, num_label_tokens, "spaco")
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


register(EngineSpec("seco", SeCOOptions, seco_step, "sequential chunk-wise optimization: exact, activations of one chunk (K/V parked)",
                 accepts=_ACCEPTS, check=lambda context: check_chunkable(context, "seco"), sequence_parallel=True,
                 costs=SeCOCosts()))
register(EngineSpec("spaco", SpaCOOptions, spaco_step, "sparse chunk-wise optimization: backprop ~budget chunks, unbiased",
                 accepts=_ACCEPTS, check=lambda context: check_chunkable(context, "spaco"), sequence_parallel=True,
                 costs=SpaCOCosts()))
