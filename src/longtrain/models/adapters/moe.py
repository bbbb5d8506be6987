"""Mixtures of experts laid out as Llama, whose layers' ``mlp`` is a sparse block: a
router picks ``num_experts_per_tok`` experts per token, so the block is token-wise and
tiles, chunks and token subsets apply to it as to a dense MLP. What differs is what a
step costs: every expert's weights are held, a token multiplies by its active experts
(and any shared expert) only."""

from __future__ import annotations

from ..description import FeedForward
from .base import DecoderAdapter, register_adapter

__all__ = ["GptOssAdapter", "MixtralAdapter", "QwenMoEAdapter"]


@register_adapter
class QwenMoEAdapter(DecoderAdapter):
    """Qwen2-MoE (a gated shared expert beside the routed ones) and Qwen3-MoE: layers in
    ``mlp_only_layers``, or off the ``decoder_sparse_step``, are dense."""

    families = ("qwen2_moe", "qwen3_moe")

    @classmethod
    def layer_feed_forward(cls, config, index: int) -> FeedForward:
        sparse = (config.num_experts > 0 and index not in (getattr(config, "mlp_only_layers", None) or [])
                  and (index + 1) % getattr(config, "decoder_sparse_step", 1) == 0)
        if not sparse:
            return FeedForward(config.intermediate_size)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        return FeedForward(config.moe_intermediate_size, experts=config.num_experts, active=config.num_experts_per_tok,
                           shared_width=shared, shared_gate=shared > 0)


@register_adapter
class MixtralAdapter(DecoderAdapter):
    """Mixtral: every layer a mixture of ``num_local_experts`` experts of ``intermediate_size``."""

    families = ("mixtral",)

    def mlp_writes_input(self) -> bool:
        return bool(getattr(self.config, "router_jitter_noise", 0))  # multiplies its input by noise in place

    @classmethod
    def layer_feed_forward(cls, config, index: int) -> FeedForward:
        return FeedForward(config.intermediate_size, experts=config.num_local_experts, active=config.num_experts_per_tok)


@register_adapter
class GptOssAdapter(DecoderAdapter):
    """gpt-oss: every layer a mixture of ``num_local_experts`` experts (with biases and a
    clamped SwiGLU), attention with a learned sink per head (:mod:`longtrain.ops.attention_sinks`),
    sliding and full layers alternating. Its MLP returns ``(output, router scores)``."""

    families = ("gpt_oss",)

    def mlp_returns_pair(self) -> bool:
        return True

    @classmethod
    def layer_feed_forward(cls, config, index: int) -> FeedForward:
        return FeedForward(config.intermediate_size, experts=config.num_local_experts, active=config.num_experts_per_tok)
