"""Whole-sequence causal attention: the fused kernel where nothing but causality masks,
exact chunked blocks where documents, padding, a window or soft-capping do.

The fused path is one causal block of :mod:`.attention_blocks`, so it runs the same
kernel the chunked engines run (cuDNN on Hopper, FlashAttention-2 elsewhere on CUDA, the
CPU flash kernel on CPU; :func:`~.attention_blocks.attention_kernel`), with grouped K/V
heads, and saves what a flash kernel saves: q, k, v, the output and its LSE. Where no
fused block kernel runs (float32 on CUDA) it is PyTorch's SDPA, whose memory-efficient
kernel never holds the s×s scores.

One semantics for every path (:mod:`.masking`): a query sees earlier keys of its own
document that are not padding, inside the window; a row with nothing to see gives 0.
"""

from __future__ import annotations

from typing import Callable

import torch

from .attention_blocks import attention_kernel, block_backward, block_forward
from .chunked_attention import chunk_bounds, chunked_attention, chunked_backward, chunked_forward
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
        if attention_kernel(q.device, q.dtype, q.shape[-1]) == "math":
            # No fused block kernel (float32 on CUDA): PyTorch's SDPA picks its
            # memory-efficient kernel, where one explicit-score block would hold s×s scores.
            return sdpa_gqa(q, k, v, is_causal=q.shape[2] > 1, scale=scale)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        return _FusedCausal.apply(q, k.to(q.dtype), v.to(q.dtype), scale)
    return chunked_attention(q, k, v, chunk=MASKED_BLOCK, window=window, mask=mask, scale=scale,
                             softcap=softcap, planner=planner)


class _FusedCausal(torch.autograd.Function):
    """One causal block over the whole sequence (fused kernel forward and backward)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = block_forward(q, k, v, scale=scale, causal=q.shape[2] > 1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(grad_out.contiguous(), q, k, v, out, lse, scale=ctx.scale, causal=q.shape[2] > 1)
        return dq, dk, dv, None


# ---- attention whose output is kept (Memo): forward once, backward from the kept output ----

def _planner_for(q, mask, window, softcap, planner):
    if not needs_blocks(mask, window, softcap, q.shape[2]):
        if q.shape[2] <= MASKED_BLOCK or attention_kernel(q.device, q.dtype, q.shape[-1]) != "math":
            return None  # one fused causal block
        # No fused kernel (float32 on CUDA): explicit-score blocks of MASKED_BLOCK tokens,
        # never one block of s×s scores (128 GiB at 32K tokens and 32 heads).
        return planner if planner is not None else BlockPlanner(None, chunk_bounds(q.shape[2], MASKED_BLOCK))
    return planner if planner is not None else BlockPlanner(mask, chunk_bounds(q.shape[2], MASKED_BLOCK))


def causal_attention_forward(q, k, v, *, mask=None, window=None, scale=None, softcap=None, planner=None):
    """Output (B, H, S, D) and log-sum-exp (B, H, S) of :func:`causal_attention`,
    computed without autograd (the LSE is what an exact backward needs later)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    with torch.no_grad():
        planner = _planner_for(q, mask, window, softcap, planner)
        if planner is None:  # one causal block over the whole sequence: the fused kernel
            return block_forward(q, k, v, scale=scale, causal=q.shape[2] > 1)
        return chunked_forward(q, k, v, planner, window, scale, softcap)


def causal_attention_backward(grad_out, q, k, v, out, lse, *, mask=None, window=None, scale=None, softcap=None,
                              planner=None):
    """(dq, dk, dv) of :func:`causal_attention` from its output and LSE."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    planner = _planner_for(q, mask, window, softcap, planner)
    if planner is None:
        return block_backward(grad_out.contiguous(), q, k, v, out, lse, scale=scale, causal=q.shape[2] > 1)
    return chunked_backward(grad_out, q, k, v, out, lse, planner, window, scale, softcap)


class _KnownOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, out, lse, backward):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attention_backward = backward
        return out  # a view of the kept output: no copy

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.attention_backward is None:
            raise RuntimeError("this attention output was a stand-in for recomputation and has no backward")
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.attention_backward(grad_out, q, k, v, out, lse)
        return dq, dk, dv, None, None, None


def attention_from_output(q, k, v, out, lse, backward: Callable | None):
    """``out``, as the attention of q, k, v whose output and LSE it is: autograd sees an
    attention node (saving q, k, v, out and LSE) whose backward is
    ``backward(grad_out, q, k, v, out, lse) -> (dq, dk, dv)``. With ``backward=None`` it
    is a stand-in that only replays the forward (a recomputation that never runs backward)."""
    return _KnownOutput.apply(q, k, v, out, lse, backward)
