"""Sizes of a decoder's per-token tensors, from its description: what engines, techniques
and the planner count when they park or plan attention's pieces. ``config`` is a model
config; its adapter describes it (:func:`~longtrain.models.adapters.describe_model`)."""

from __future__ import annotations

from .adapters import describe_model

__all__ = ["head_dim", "kept_output_bytes", "kv_bytes_per_token"]


def head_dim(config) -> int:
    """Elements per attention head."""
    return describe_model(config).head_dim


def kv_bytes_per_token(config, item: int, kv_heads: int | None = None) -> int:
    """One layer's K and V of one token: ``kv_heads`` (default: the model's) of
    :func:`head_dim` elements each, ``item`` bytes per element."""
    shape = describe_model(config)
    return 2 * (kv_heads or shape.kv_heads) * shape.head_dim * item


def kept_output_bytes(config, batch: int, length: int, item: int) -> int:
    """One layer's kept attention output and its LSE for ``batch`` × ``length`` tokens (the
    LSE in float32, float64 in a float64 step)."""
    shape = describe_model(config)
    return batch * length * shape.heads * (shape.head_dim * item + max(4, item))
