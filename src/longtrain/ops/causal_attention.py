"""Whole-sequence causal attention: the fused kernel where nothing but causality masks,
exact chunked blocks where documents, padding, a window or soft-capping do.

One semantics for every path (:mod:`.masking`): a query sees earlier keys of its own
document that are not padding, inside the window; a row with nothing to see gives 0.
"""

from __future__ import annotations

import torch

from .chunked_attention import chunked_attention
from .masking import BlockPlanner, SequenceMask
from .sdpa import sdpa_gqa

# Tokens per block when the sequence needs masks: bounds the (block × block) score
# tile of the masked blocks, which are the only ones materialized.
MASKED_BLOCK = 1024


def needs_blocks(mask: SequenceMask | None, window: int | None, softcap: float | None, length: int) -> bool:
    """Whether attention over ``length`` tokens needs more than the fused causal kernel."""
    return not (mask is None or mask.trivial) or bool(softcap) or (window is not None and window < length)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: SequenceMask | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    planner: BlockPlanner | None = None,
) -> torch.Tensor:
    """Attention of (B, H, S, D) queries over (B, H_kv, S, D) keys/values of the same
    tokens. ``planner`` (for blocks of :data:`MASKED_BLOCK` tokens) may be passed by a
    caller that runs many layers over one mask."""
    if not needs_blocks(mask, window, softcap, q.shape[2]):
        return sdpa_gqa(q, k, v, is_causal=q.shape[2] > 1, scale=scale)
    return chunked_attention(q, k, v, chunk=MASKED_BLOCK, window=window, mask=mask, scale=scale,
                             softcap=softcap, planner=planner)
