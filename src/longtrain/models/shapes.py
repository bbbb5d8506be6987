"""Sizes of a decoder's per-token tensors, from its config: what engines, techniques and
the planner count when they park or plan attention's pieces."""

from __future__ import annotations


def head_dim(config) -> int:
    """Elements per attention head."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config, item: int, kv_heads: int | None = None) -> int:
    """One layer's K and V of one token: ``kv_heads`` (default: the model's) of
    :func:`head_dim` elements each, ``item`` bytes per element."""
    kv_heads = kv_heads or getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * kv_heads * head_dim(config) * item


def kept_output_bytes(config, batch: int, length: int, item: int) -> int:
    """One layer's kept attention output and its LSE for ``batch`` × ``length`` tokens (the
    LSE in float32, float64 in a float64 step)."""
    return batch * length * config.num_attention_heads * (head_dim(config) * item + max(4, item))
