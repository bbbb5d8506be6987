"""The FPDT engine's options (:class:`FPDTOptions`) and the chunk settings they come to."""

from __future__ import annotations

from dataclasses import dataclass

from ... import validate
from ...errors import LongtrainError
from ...memory.units import parse_bytes
from ..chunked.settings import ChunkSettings

__all__ = ["FPDTOptions"]


@dataclass
class FPDTOptions:
    """Knobs of the FPDT engine."""

    chunk: int = 4096  # tokens per chunk
    offload: bool = False  # park K/V chunks in host memory (pinned pool, side streams)
    offload_inputs: bool | None = None  # park the layer inputs too; default: = offload
    prefetch: int = 1  # chunks fetched ahead (1 = double buffering)
    host_memory: str | int | None = None  # host budget, e.g. "120GiB"; default: half the physical memory on CUDA
    recompute_kv: bool = True  # keep one layer's K/V; recompute them (attention sub-block) in backward
    keep_output: bool | int | str = False  # park attention output + LSE (Memo's idea): every layer, the lowest N, or "fit"
    segment: int = 1  # park every segment-th layer's input only; backward recomputes the layers between (one more forward)
    float32_grad_sum: bool = True  # bf16/fp16 parameters: sum each layer's chunk gradients in float32, round once

    def __post_init__(self):
        validate.positive_int("fpdt", "chunk", self.chunk)
        validate.positive_int("fpdt", "prefetch", self.prefetch, minimum=0)
        validate.flag("fpdt", "offload", self.offload)
        validate.flag("fpdt", "recompute_kv", self.recompute_kv)
        keep = self.keep_output
        if not (isinstance(keep, bool) or keep == "fit" or (isinstance(keep, int) and keep >= 0)):
            raise LongtrainError(f"fpdt option keep_output must be true, false, fit (as many layers as the host budget "
                                 f"holds) or a number of layers, got {keep!r}")
        validate.positive_int("fpdt", "segment", self.segment)
        validate.flag("fpdt", "float32_grad_sum", self.float32_grad_sum)
        if self.segment > 1 and (self.keep_output or not self.recompute_kv):
            raise LongtrainError("fpdt: segment > 1 parks fewer layer inputs; keep_output and recompute_kv=false park "
                                 "something per layer again — use segment alone (or segment=1 with them)")
        if self.offload_inputs is not None:
            validate.flag("fpdt", "offload_inputs", self.offload_inputs)
        if self.host_memory is not None:
            validate.byte_size("fpdt", "host_memory", self.host_memory)  # a clear error now rather than at the first step

    def settings(self) -> ChunkSettings:
        return ChunkSettings(
            chunk=self.chunk, offload=self.offload, prefetch=self.prefetch,
            host_budget=None if self.host_memory is None else parse_bytes(self.host_memory),
            offload_inputs=self.offload if self.offload_inputs is None else self.offload_inputs,
            recompute_kv=self.recompute_kv, keep_output=self.keep_output, segment=self.segment,
            float32_grad_sum=self.float32_grad_sum,
        )
