"""The SeCO engine's options (:class:`SeCOOptions`) and the chunk settings they come to."""

from __future__ import annotations

from dataclasses import dataclass

from ... import validate
from ...memory.units import parse_bytes
from ..chunked.settings import ChunkSettings

__all__ = ["SeCOOptions"]


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
                             float32_grad_sum=self.float32_grad_sum, chunk_major=True)
