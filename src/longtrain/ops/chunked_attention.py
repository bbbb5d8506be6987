"""Chunked causal attention with an online softmax and exact chunk-wise backward.

Two autograd functions share the block kernels of :mod:`.attention_blocks`:

- :func:`chunked_attention` — the whole sequence is given; it is split into chunks of
  ``chunk`` tokens. Forward: each query chunk meets the key/value chunks at or before
  it (inside the sliding window, when one is set), merged with their log-sum-exp.
  Backward, as in FPDT (../shared/papers/fpdt.txt §4.2): outer loop over key/value
  chunks, inner loop over the query chunks that see them, accumulating dK/dV for the
  outer chunk and dQ for each inner one, from the saved output and LSE.
- :func:`attend_chunk` — one query chunk with its own keys/values, plus a *history*
  of earlier chunks' keys/values kept elsewhere (a chunk store, on the device or in
  host memory). Only one earlier chunk needs to be on the device at a time. Backward
  sends each earlier chunk's dK/dV to the history's accumulator and adds what later
  chunks accumulated for this chunk into its own dK/dV. Running the query chunks in
  reverse order therefore gives exact gradients chunk by chunk: this is how the
  chunked pipeline (:mod:`longtrain.techniques.chunked_attention`) recomputes a layer
  one chunk at a time.

Neither needs a gradient through an LSE output. Grouped K/V heads are used as they are.
"""

from __future__ import annotations

import math
from typing import Iterator, Protocol

import torch

from .attention_blocks import block_backward, block_forward, lse_dtype, merge


class KVHistory(Protocol):
    """Earlier chunks' keys/values for one layer (what :func:`attend_chunk` reads).

    ``blocks(backward)`` yields ``(index, start, end, k, v)`` for every earlier chunk,
    in order, with its tensors on the device (prefetching the next ones, and in backward
    their gradient accumulators, is the history's business). ``add_grad(index, dk, dv)`` accumulates gradients for an earlier chunk;
    ``take_grad()`` returns (and forgets) what was accumulated for the current chunk,
    or None.
    """

    def blocks(self, backward: bool = False) -> Iterator[tuple[int, int, int, torch.Tensor, torch.Tensor]]: ...

    def add_grad(self, index: int, dk: torch.Tensor, dv: torch.Tensor) -> None: ...

    def take_grad(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...


def block_mask(q_start, q_end, k_start, k_end, *, window=None, q_segments=None, k_segments=None, key_valid=None, device=None):
    """What one (query range, key range) block needs: ``(skip, causal, mask)``.

    ``skip``: no pair in the block is allowed (outside the window). ``causal``: the block
    is the diagonal with nothing else masked (a kernel's own causal mode). ``mask``: a
    boolean (Cq, Ck) or (B, Cq, Ck) mask, or None when every pair is allowed. Decided from
    positions alone where possible, so the common cases never read tensors on the host.
    """
    if window is not None and q_start - (k_end - 1) >= window:
        return True, False, None
    diagonal = (q_start, q_end) == (k_start, k_end)
    window_cuts = window is not None and (q_end - 1) - k_start >= window
    if q_segments is None and key_valid is None and not window_cuts:
        if diagonal:
            return False, True, None
        if k_end <= q_start + 1:  # every key precedes every query
            return False, False, None
    q_pos = torch.arange(q_start, q_end, device=device)
    k_pos = torch.arange(k_start, k_end, device=device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask = mask & (k_pos[None, :] > q_pos[:, None] - window)
    if q_segments is not None:
        mask = mask & (q_segments[:, :, None] == k_segments[:, None, :])
    if key_valid is not None:
        mask = mask & key_valid[:, None, :]
    return False, False, mask


def _chunk_bounds(s: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, s)) for start in range(0, s, chunk)]


def _seg(segments, start, end):
    return None if segments is None else segments[:, start:end]


def _visible_blocks(bounds, window, segments, device, keys_outer=False):
    """(qa, qb, ka, kb, causal, mask) for every block with an allowed pair, query chunks
    outer (forward) or key/value chunks outer (FPDT's backward order)."""
    pairs = [(q, k) for q in bounds for k in bounds if k[0] < q[1]]
    if keys_outer:
        pairs.sort(key=lambda pair: (pair[1], pair[0]))
    for (qa, qb), (ka, kb) in pairs:
        skip, causal, mask = block_mask(qa, qb, ka, kb, window=window, q_segments=_seg(segments, qa, qb),
                                        k_segments=_seg(segments, ka, kb), device=device)
        if not skip:
            yield qa, qb, ka, kb, causal, mask


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, chunk, window, scale, softcap):
        s = q.shape[2]
        acc = lse_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
        for qa, qb, ka, kb, causal, mask in _visible_blocks(_chunk_bounds(s, chunk), window, segments, q.device):
            bo, bl = block_forward(q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], scale=scale,
                                   causal=causal, mask=mask, softcap=softcap)
            out[:, :, qa:qb], lse[:, :, qa:qb] = merge(out[:, :, qa:qb], lse[:, :, qa:qb], bo.to(acc), bl)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, segments, out, lse)
        ctx.chunk, ctx.window, ctx.scale, ctx.softcap = chunk, window, scale, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, segments, out, lse = ctx.saved_tensors
        window, scale, softcap = ctx.window, ctx.scale, ctx.softcap
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        bounds = _chunk_bounds(q.shape[2], ctx.chunk)
        # Outer loop over key/value chunks (their dK/dV finish there), inner over queries.
        for qa, qb, ka, kb, causal, mask in _visible_blocks(bounds, window, segments, q.device, keys_outer=True):
            bq, bk, bv = block_backward(
                grad_out[:, :, qa:qb], q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb],
                out[:, :, qa:qb], lse[:, :, qa:qb], scale=scale, causal=causal, mask=mask, softcap=softcap,
            )
            dq[:, :, qa:qb] += bq
            dk[:, :, ka:kb] += bk
            dv[:, :, ka:kb] += bv
        return dq, dk, dv, None, None, None, None, None


def _check_heads(q, k):
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk: int,
    window: int | None = None,
    segments: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of (B, H, S, D) queries over (B, H_kv, S, D) keys/values in chunks.

    ``window``: a query attends to at most the last ``window`` positions, itself
    included (Mistral / Gemma-2 convention). ``segments`` (B, S): packed documents; a
    query attends only to keys of its own segment. ``softcap``: attention logit
    soft-capping ``c·tanh(s/c)`` (Gemma-2).
    """
    _check_heads(q, k)
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return _ChunkedAttention.apply(q, k, v, segments, chunk, window, scale, softcap)


class _AttendChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, history, q_start, key_valid, window, scale, softcap):
        acc = lse_dtype(q.dtype)
        q_end = q_start + q.shape[2]
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
        for _, ka, kb, k_past, v_past in history.blocks():
            bo, bl = _past_block(block_forward, (q, k_past, v_past), q_start, q_end, ka, kb, key_valid, window, scale, softcap)
            if bo is not None:
                out, lse = merge(out, lse, bo.to(acc), bl)
        skip, causal, mask = block_mask(q_start, q_end, q_start, q_end, window=window,
                                        key_valid=_seg(key_valid, q_start, q_end), device=q.device)
        bo, bl = block_forward(q, k, v, scale=scale, causal=causal, mask=mask, softcap=softcap)
        out, lse = merge(out, lse, bo.to(acc), bl)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, key_valid, out, lse)
        ctx.history, ctx.q_start, ctx.window, ctx.scale, ctx.softcap = history, q_start, window, scale, softcap
        ctx.diag = (causal, mask)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, key_valid, out, lse = ctx.saved_tensors
        history, q_start, window, scale, softcap = ctx.history, ctx.q_start, ctx.window, ctx.scale, ctx.softcap
        q_end = q_start + q.shape[2]
        grad_out = grad_out.contiguous()
        causal, mask = ctx.diag
        dq, dk, dv = block_backward(grad_out, q, k, v, out, lse, scale=scale, causal=causal, mask=mask, softcap=softcap)
        for index, ka, kb, k_past, v_past in history.blocks(backward=True):
            grads = _past_block(
                lambda *t, **kw: block_backward(grad_out, *t, out, lse, **kw),
                (q, k_past, v_past), q_start, q_end, ka, kb, key_valid, window, scale, softcap,
            )
            if grads[0] is None:
                continue
            dq = dq + grads[0]
            history.add_grad(index, grads[1], grads[2])
        later = history.take_grad()  # what the later query chunks sent to this chunk's K/V
        if later is not None:
            dk, dv = dk + later[0], dv + later[1]
        return dq, dk, dv, None, None, None, None, None, None


def _past_block(kernel, tensors, q_start, q_end, ka, kb, key_valid, window, scale, softcap):
    skip, causal, mask = block_mask(q_start, q_end, ka, kb, window=window,
                                    key_valid=_seg(key_valid, ka, kb), device=tensors[0].device)
    if skip:
        return None, None, None
    return kernel(*tensors, scale=scale, causal=causal, mask=mask, softcap=softcap)


def attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    history: KVHistory,
    *,
    q_start: int,
    key_valid: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one query chunk (B, H, C, D) at positions ``q_start…`` over its
    own keys/values (B, H_kv, C, D) and the earlier chunks in ``history``.

    ``key_valid`` (B, S) marks real (non-padding) tokens of the whole sequence; padded
    keys are never attended. See the module docstring for the gradient contract.
    """
    _check_heads(q, k)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return _AttendChunk.apply(q, k, v, history, q_start, key_valid, window, scale, softcap)
