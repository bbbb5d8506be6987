"""What a chunked engine's options come to (:class:`ChunkSettings`): the one description of
a chunked step that its run (:mod:`.run`) and its costs (:mod:`.costs`) both read."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkSettings"]


@dataclass(frozen=True)
class ChunkSettings:
    chunk: int  # tokens per chunk
    offload: bool  # park K/V chunks (and their gradients) in host memory
    prefetch: int  # chunks fetched ahead of use
    host_budget: int | None  # bytes; None: half the physical memory on CUDA (check_host_budget)
    offload_inputs: bool = False  # FPDT: park the layer inputs (and their gradients) too
    recompute_kv: bool = False  # FPDT: park one layer's K/V at a time; recompute them in backward
    keep_output: bool | int | str = False  # FPDT: park attention outputs + LSEs of every layer (True), the lowest N, or "fit"
    segment: int = 1  # FPDT: layers per checkpoint segment (only every segment-th layer's input is parked)
    float32_grad_sum: bool = False  # bf16 parameters: chunk gradients summed in float32, rounded once (engines/gradient_sum.py)
    # The schedule runs chunk by chunk through every layer (SeCO, SpaCO), so every layer's K/V
    # gradient sums wait at once; layer by layer (FPDT), one layer's.
    chunk_major: bool = False
