"""Whole-sequence causal attention: the fused kernel where nothing but causality masks,
one fused call per document where packed documents or padding do, exact chunked blocks
where a window cuts inside a document or logits are soft-capped.

The fused path is one causal block of :mod:`.attention_blocks`, so it runs the same
kernel the chunked engines run (cuDNN on Hopper, FlashAttention-2 elsewhere on CUDA, the
CPU flash kernel on CPU; :func:`~.attention_blocks.attention_kernel`), with grouped K/V
heads, and saves what a flash kernel saves: q, k, v, the output and its LSE. Where no
fused block kernel runs (float32 on CUDA) it is PyTorch's SDPA, whose memory-efficient
kernel never holds the s×s scores.

Packed documents and padding (:class:`~.masking.DocumentSpans`) take the same fused
kernel once per document: a document attends only to itself, so its output, LSE and
gradients are written, never merged or accumulated across blocks — the kernel's own
float32 accumulation, as for a whole sequence, with no block-sized explicit scores and no
per-block host work (one 128K-token document in 1,024-token blocks is 8,256 block calls
and 8,128 merges per layer forward; four documents and some padding, 2,254 and 2,126).

One semantics for every path (:mod:`.masking`): a query sees earlier keys of its own
document that are not padding, inside the window; a row with nothing to see gives 0.
"""

from __future__ import annotations

import functools
from typing import Union

import torch

from .attention_blocks import attention_kernel, block_backward, block_forward, lse_dtype
from .attention_node import attention_from_output
from .attention_sinks import add_sink
from .chunked_attention import chunk_bounds, chunked_attention, chunked_backward, chunked_forward
from .masking import BlockPlanner, DocumentSpans, SequenceMask, document_spans
from .sdpa import sdpa_gqa

# Tokens per block when the sequence needs masks: bounds the (block × block) score
# tile of the masked blocks, which are the only ones materialized.
MASKED_BLOCK = 1024

# How whole-sequence attention runs: None (one fused causal block), one fused block per
# document (DocumentSpans) or blocks of MASKED_BLOCK tokens (BlockPlanner).
Plan = Union[None, DocumentSpans, BlockPlanner]


def needs_blocks(mask: SequenceMask | None, window: int | None, softcap: float | None, length: int) -> bool:
    """Whether attention over ``length`` tokens needs more than the fused causal kernel."""
    return not (mask is None or mask.trivial) or bool(softcap) or (window is not None and window < length)


def span_limit(rows: int, length: int) -> int:
    """The most documents worth a fused call each: 16 per row, or two per block of the
    blocked path. Documents shorter than half a block on average are cheaper as a few
    masked blocks (each holds many of them) than as thousands of tiny kernel launches."""
    return rows * max(16, 2 * -(-length // MASKED_BLOCK))


# ``spans`` not read from the mask yet (None means read, and no per-document plan applies).
UNREAD = object()


def read_spans(q: torch.Tensor, mask: SequenceMask | None, softcap: float | None) -> DocumentSpans | None:
    """The documents of ``mask`` where a fused call per document can run (a fused kernel
    for q, no soft-capping, a mask that is not plain causal), else None: one host read."""
    if mask is None or mask.trivial or softcap or attention_kernel(q.device, q.dtype, q.shape[-1]) == "math":
        return None
    return document_spans(mask, span_limit(q.shape[0], q.shape[2]))


def attention_plan(q: torch.Tensor, mask: SequenceMask | None, window: int | None, softcap: float | None,
                   spans=UNREAD, planner: BlockPlanner | None = None) -> Plan:
    """How attention of ``q``'s tokens under ``mask``/``window``/``softcap`` runs. Callers
    that run many layers over one mask pass the ``spans`` (:func:`read_spans`) and
    ``planner`` they already made."""
    length = q.shape[2]
    if not needs_blocks(mask, window, softcap, length):
        if length <= MASKED_BLOCK or attention_kernel(q.device, q.dtype, q.shape[-1]) != "math":
            return None  # one fused causal block
        # No fused kernel (float32 on CUDA): explicit-score blocks of MASKED_BLOCK tokens,
        # never one block of s×s scores (128 GiB at 32K tokens and 32 heads).
        return planner if planner is not None else BlockPlanner(None, chunk_bounds(length, MASKED_BLOCK))
    if spans is UNREAD:
        spans = read_spans(q, mask, softcap)
    if spans is not None and not softcap and spans.fits_window(window):
        return spans
    return planner if planner is not None else BlockPlanner(mask, chunk_bounds(length, MASKED_BLOCK))


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: SequenceMask | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    plan: Plan | str = "auto",
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of (B, H, S, D) queries over (B, H_kv, S, D) keys/values of the same
    tokens. ``plan``: :func:`attention_plan`'s answer, when a caller that runs many layers
    over one mask already has it; ``"auto"`` works it out. ``sink``: (H,) logits in every
    row's normaliser (:mod:`.attention_sinks`)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if sink is not None:  # the output and LSE without autograd, rescaled once, and their backward
        plan = attention_plan(q, mask, window, softcap) if isinstance(plan, str) else plan
        settings = dict(mask=mask, window=window, scale=scale, softcap=softcap, plan=plan)
        k, v = k.to(q.dtype), v.to(q.dtype)
        out, lse = causal_attention_forward(q, k, v, sink=sink, **settings)
        return attention_from_output(q, k, v, out, lse, functools.partial(causal_attention_backward, **settings),
                                     sink=sink)
    if not needs_blocks(mask, window, softcap, q.shape[2]):
        if attention_kernel(q.device, q.dtype, q.shape[-1]) == "math":
            # No fused block kernel (float32 on CUDA): PyTorch's SDPA picks its
            # memory-efficient kernel, where one explicit-score block would hold s×s scores.
            return sdpa_gqa(q, k, v, is_causal=q.shape[2] > 1, scale=scale)
        return _FusedCausal.apply(q, k.to(q.dtype), v.to(q.dtype), scale)
    if isinstance(plan, str):
        plan = attention_plan(q, mask, window, softcap)
    if isinstance(plan, DocumentSpans):
        return _SpansAttention.apply(q, k.to(q.dtype), v.to(q.dtype), plan, scale)
    return chunked_attention(q, k, v, chunk=MASKED_BLOCK, window=window, mask=mask, scale=scale,
                             softcap=softcap, planner=plan)


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


def spans_forward(q, k, v, spans: DocumentSpans, scale):
    """Output and LSE of attention over ``spans``, one fused call per document (two where
    queries follow its last valid key), without autograd."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    for row, first, last, end in spans.spans:
        r = slice(row, row + 1)
        keys, values = k[r, :, first:last], v[r, :, first:last]
        out[r, :, first:last], lse[r, :, first:last] = block_forward(q[r, :, first:last], keys, values,
                                                                       scale=scale, causal=True)
        if end > last:  # queries after the last valid key (padding) see every valid key
            out[r, :, last:end], lse[r, :, last:end] = block_forward(q[r, :, last:end], keys, values, scale=scale)
    return out, lse


def spans_backward(grad_out, q, k, v, out, lse, spans: DocumentSpans, scale):
    """(dq, dk, dv) of :func:`spans_forward`: each document's slices written once."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for row, first, last, end in spans.spans:
        r, own = slice(row, row + 1), slice(first, last)
        keys, values = k[r, :, own], v[r, :, own]
        dq[r, :, own], dk[r, :, own], dv[r, :, own] = block_backward(
            grad_out[r, :, own], q[r, :, own], keys, values, out[r, :, own], lse[r, :, own].contiguous(),
            scale=scale, causal=True)
        if end > last:
            tail = slice(last, end)
            dq[r, :, tail], bk, bv = block_backward(grad_out[r, :, tail], q[r, :, tail], keys, values, out[r, :, tail],
                                                    lse[r, :, tail].contiguous(), scale=scale)
            dk[r, :, own] += bk
            dv[r, :, own] += bv
    return dq, dk, dv


class _SpansAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spans, scale):
        out, lse = spans_forward(q, k, v, spans, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spans, ctx.scale = spans, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        return *spans_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.spans, ctx.scale), None, None


# ---- attention whose output is kept (Memo): forward once, backward from the kept output ----

def causal_attention_forward(q, k, v, *, mask=None, window=None, scale=None, softcap=None, plan="auto", sink=None):
    """Output (B, H, S, D) and log-sum-exp (B, H, S) of :func:`causal_attention`,
    computed without autograd (the LSE is what an exact backward needs later); with
    ``sink``, both of attention with it."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    plan = attention_plan(q, mask, window, softcap) if isinstance(plan, str) else plan
    with torch.no_grad():
        if plan is None:  # one causal block over the whole sequence: the fused kernel
            out, lse = block_forward(q, k, v, scale=scale, causal=q.shape[2] > 1)
        elif isinstance(plan, DocumentSpans):
            out, lse = spans_forward(q, k, v, plan, scale)
        else:
            out, lse = chunked_forward(q, k, v, plan, window, scale, softcap)
    return (out, lse) if sink is None else add_sink(out, lse, sink)


def causal_attention_backward(grad_out, q, k, v, out, lse, *, mask=None, window=None, scale=None, softcap=None,
                              plan="auto"):
    """(dq, dk, dv) of :func:`causal_attention` from its output and LSE."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    plan = attention_plan(q, mask, window, softcap) if isinstance(plan, str) else plan
    if plan is None:
        return block_backward(grad_out.contiguous(), q, k, v, out, lse, scale=scale, causal=q.shape[2] > 1)
    if isinstance(plan, DocumentSpans):
        return spans_backward(grad_out.contiguous(), q, k, v, out, lse, plan, scale)
    return chunked_backward(grad_out, q, k, v, out, lse, plan, window, scale, softcap)

