"""A model's FLOPs per sample, from its description: a mixture of experts counts the
experts a token runs, not every expert it holds."""

from __future__ import annotations

from torch import nn

from ..memory.flops import causal_lm_flops, matmul_parameters
from .adapters import describe_model
from .layers import unwrap

__all__ = ["active_matmul_parameters", "model_flops_per_sample"]


def active_matmul_parameters(model: nn.Module) -> int:
    """Matmul parameters one token multiplies by: all of them but the experts it is not routed to."""
    base = unwrap(model)
    return matmul_parameters(base) - describe_model(base.config).inactive_expert_parameters()


def model_flops_per_sample(model: nn.Module, seq_len: int) -> float:
    """Forward + backward FLOPs of one sample of ``seq_len`` tokens (the MFU convention)."""
    shape = describe_model(unwrap(model).config)
    return causal_lm_flops(seq_len, active_matmul_parameters(model), shape.layers, shape.attention_width)
