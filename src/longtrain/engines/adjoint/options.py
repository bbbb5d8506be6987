"""The adjoint engine's options (:class:`AdjointOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import validate
from ...errors import LongtrainError

__all__ = ["AdjointOptions"]


@dataclass
class AdjointOptions:
    """Knobs of the adjoint engine."""

    truncate: int | None = None  # T̄: count only the last T̄ states of each token (approximate); None: exact
    # Working memory of one batched VJP, which sets the tokens per block. Default: the
    # larger of 16 MiB and one layer's stored input, so the VJPs add at most about one
    # layer's record to the peak and a layer takes ~10 blocks at any length.
    vjp_memory: str | int | None = None
    block: int | None = None  # tokens per VJP block (overrides vjp_memory)
    # Working memory of a layer's scan (decays, states, adjoint states of one chunk of
    # tokens), which sets the tokens per scan chunk; the state entering each chunk is
    # kept from the forward. Default: the larger of 64 MiB and one layer's stored input
    # (so a Mamba layer's scan takes ~220 chunks at any length).
    chunk_memory: str | int | None = None
    chunk: int | None = None  # tokens per scan chunk (overrides chunk_memory)
    recompute: bool = True  # keep only each layer's input; recompute A, c, h layer by layer in the backward
    offload_inputs: bool = False  # park the kept layer inputs (all but the top one) in pinned host memory

    def __post_init__(self):
        if self.truncate is not None and (isinstance(self.truncate, bool) or not isinstance(self.truncate, int) or self.truncate <= 0):
            raise LongtrainError(f"adjoint truncate must be a positive integer (T̄ states), got {self.truncate!r}")
        if self.block is not None and (isinstance(self.block, bool) or not isinstance(self.block, int) or self.block <= 0):
            raise LongtrainError(f"adjoint block must be a positive integer (tokens), got {self.block!r}")
        if self.chunk is not None and (isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk <= 0):
            raise LongtrainError(f"adjoint chunk must be a positive integer (tokens), got {self.chunk!r}")
        for name in ("vjp_memory", "chunk_memory"):
            if getattr(self, name) is not None:
                validate.byte_size("adjoint", name, getattr(self, name))
        if not self.recompute and (self.chunk is not None or self.chunk_memory is not None):
            raise LongtrainError("adjoint chunk and chunk_memory split the scan that recompute rebuilds; "
                                 "recompute=false keeps every state whole: drop one of them")
        validate.flag("adjoint", "recompute", self.recompute)
        validate.flag("adjoint", "offload_inputs", self.offload_inputs)
