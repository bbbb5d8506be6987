"""``attention``: chunked attention with host offload and prefetch (FPDT on one device).

``Strategy(attention=ChunkedAttention(chunk=4096, offload=True))`` trains the model one
sequence chunk at a time (:mod:`longtrain.engines.chunked_pipeline`): attention runs
over chunks with an online softmax, K/V chunks (and, with ``offload_inputs``, the
checkpointed layer inputs) are parked in host memory and prefetched ``prefetch``
chunks ahead, so the device holds one chunk's working set however long the sequence.

Installed through transformers' attention interface (backend ``longtrain_chunked``)
and the engine's loss hook; no model file changes. It subsumes layer checkpointing
(each layer is recomputed chunk by chunk in backward), so ``checkpoint`` alongside it
changes nothing. With ``mst`` the MLP runs in chunks of half the attention chunk and
the LM head in V/d mini-sequences per chunk, as the FPDT paper recommends.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LongtrainError
from ..engines.chunked_pipeline import PIPELINE_ATTR, PipelineSettings, pipelined_loss
from ..memory.units import parse_bytes
from ..models.attention import use_chunked_backend
from ..models.head import set_head_loss
from ..models.layers import decoder_layers, unwrap
from ..registry import register_technique

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3")


@dataclass
class ChunkedAttention:
    """Knobs of chunked attention."""

    chunk: int = 4096  # tokens per chunk
    offload: bool = False  # park K/V chunks in host memory (pinned pool, side streams)
    offload_inputs: bool | None = None  # park checkpointed layer inputs too; default: = offload
    prefetch: int = 1  # chunks fetched ahead (1 = double buffering)
    host_memory: str | int | None = None  # host budget, e.g. "120GiB"; None: unbounded
    recompute_kv: bool = True  # keep one layer's K/V; recompute them (projections only) in backward

    def __post_init__(self):
        if not isinstance(self.chunk, int) or self.chunk <= 0:
            raise LongtrainError(f"attention chunk must be a positive integer, got {self.chunk!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise LongtrainError(f"attention prefetch must be a non-negative integer, got {self.prefetch!r}")
        if self.host_memory is not None:
            parse_bytes(self.host_memory)  # a clear error now rather than at the first step

    def settings(self) -> PipelineSettings:
        return PipelineSettings(
            chunk=self.chunk,
            offload=self.offload,
            offload_inputs=self.offload if self.offload_inputs is None else self.offload_inputs,
            prefetch=self.prefetch,
            host_budget=None if self.host_memory is None else parse_bytes(self.host_memory),
            recompute_kv=self.recompute_kv,
        )


@register_technique("attention", ChunkedAttention, "chunked attention with host offload and prefetch (FPDT, exact)", order=30)
def install_chunked_attention(model, options: ChunkedAttention) -> None:
    base = unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in SUPPORTED:
        raise LongtrainError(
            f"chunked attention does not support {model_type or type(base).__name__} models; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    decoder_layers(model)  # a clear error if there are none
    use_chunked_backend(base)
    if hasattr(base.config, "use_cache"):
        base.config.use_cache = False
    object.__setattr__(model, PIPELINE_ATTR, options)

    def head_loss(input_ids, attention_mask, labels, num_label_tokens):
        return pipelined_loss(model, input_ids, attention_mask, labels, num_label_tokens, options.settings())

    set_head_loss(model, head_loss)
