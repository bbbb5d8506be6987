"""Chunk-wise optimization engines: ``seco`` (exact) and ``spaco`` (sparse, unbiased).

Paper: ../shared/papers/seco_spaco.txt (Alg. 1–2). Both run the sequence through the
whole model chunk by chunk without gradients, parking every layer's K/V per chunk in a
:class:`~longtrain.memory.chunk_store.ChunkStore` (on the device or in host memory);
then, from the last chunk to the first, each chunk is recomputed with gradients against
the parked K/V of the earlier chunks (attention merged by log-sum-exp, never by
concatenating copies) and backpropagated. The gradient this sends to earlier chunks'
K/V waits in the store and joins those chunks' own K/V gradient when their turn comes
(and is freed then). Forward activations exist for one chunk at a time; only K/V grows
with the sequence. The schedule itself lives in
:class:`~longtrain.engines.chunked_pipeline.ChunkedRun`.

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

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import LongtrainError
from ..memory.units import parse_bytes
from ..models.attention import CHUNKED_NAME, use_chunked_backend
from ..models.layers import unwrap
from ..registry import register_engine
from .batch import label_token_count, prepare_batch
from .chunked_pipeline import PIPELINE_ATTR, ChunkedRun, PipelineSettings


@dataclass
class SeCOOptions:
    """Knobs of the exact chunk-wise engine."""

    chunk: int = 4096  # tokens per chunk
    offload: bool = False  # park K/V (and K/V gradients) in host memory
    prefetch: int = 1  # K/V chunks fetched ahead
    host_memory: str | int | None = None  # host budget, e.g. "64GiB"

    def __post_init__(self):
        if not isinstance(self.chunk, int) or self.chunk <= 0:
            raise LongtrainError(f"chunk must be a positive integer, got {self.chunk!r}")
        if self.host_memory is not None:
            parse_bytes(self.host_memory)


@dataclass
class SpaCOOptions(SeCOOptions):
    """Knobs of the sparse engine: ``budget`` chunks backpropagated per step on average."""

    chunk: int = 128
    budget: int = 8  # t: expected number of chunks backpropagated per step
    cap: float | None = None  # limit on the relay factor k/t (paper: 2); None: unbiased
    seed: int = 0  # chunk selection: seeded per step, so runs repeat

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.budget, int) or self.budget <= 0:
            raise LongtrainError(f"spaco budget must be a positive integer, got {self.budget!r}")
        if self.cap is not None and self.cap < 1:
            raise LongtrainError(f"spaco cap must be at least 1 (or none), got {self.cap!r}")


def _prepare(model, batch, options, num_label_tokens):
    if getattr(model, PIPELINE_ATTR, None) is not None:
        raise LongtrainError("the seco/spaco engines already run the sequence in chunks; drop the 'attention' technique")
    base = unwrap(model)
    if getattr(base.config, "_attn_implementation", None) != CHUNKED_NAME:
        use_chunked_backend(base)
    inputs = prepare_batch(batch)
    num_label_tokens = label_token_count(inputs.labels, num_label_tokens)
    settings = PipelineSettings(chunk=options.chunk, offload=options.offload, offload_inputs=False, prefetch=options.prefetch,
                                host_budget=None if options.host_memory is None else parse_bytes(options.host_memory))
    return ChunkedRun(model, inputs.input_ids, inputs.attention_mask, inputs.labels, num_label_tokens, settings)


def _forward(run: ChunkedRun) -> torch.Tensor:
    with torch.no_grad():
        return run.forward_chunk_major()


@register_engine("seco", SeCOOptions, "sequential chunk-wise optimization: exact, activations of one chunk (K/V parked)")
def seco_step(model, batch, options: SeCOOptions, num_label_tokens: int | None = None):
    run = _prepare(model, batch, options, num_label_tokens)
    loss = _forward(run)
    run.backward_chunk_major(torch.ones_like(loss))
    return loss.detach()


def select_chunks(n_chunks: int, budget: int, generator: torch.Generator) -> set[int]:
    """Each chunk independently with probability min(1, budget / n_chunks)."""
    rho = min(1.0, budget / n_chunks)
    draws = torch.rand(n_chunks, generator=generator)
    return {i for i in range(n_chunks) if float(draws[i]) < rho}


@register_engine("spaco", SpaCOOptions, "sparse chunk-wise optimization: backprop ~budget chunks, unbiased")
def spaco_step(model, batch, options: SpaCOOptions, num_label_tokens: int | None = None, selected: set[int] | None = None):
    run = _prepare(model, batch, options, num_label_tokens)
    k = len(run.bounds)
    ratio = max(1.0, k / options.budget)  # k/t; every chunk is taken when t >= k
    if selected is None and is_fake(run.input_ids):
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
    loss = _forward(run)
    if selected:
        run.backward_chunk_major(torch.ones_like(loss), own_factor=ratio)
    else:
        run.store.clear()
    return loss.detach()
