"""Chunked causal attention with an online softmax and an FPDT-style backward.

The sequence is split into chunks of ``chunk`` tokens. Forward: each query chunk meets
the key/value chunks at or before it (and inside the sliding window, when one is set);
partial results are merged with their log-sum-exp, so only one chunk pair's scores exist
at a time. Backward, as in FPDT: the outer loop runs over key/value chunks and the inner
loop over the query chunks that see them, accumulating dK/dV for the outer chunk and dQ
for each inner one, from the saved output and log-sum-exp — so exactness never depends
on a gradient flowing through an LSE output. Grouped K/V heads are used as they are
(no repeated copies). Packed documents are kept apart by per-token segment ids.

This is the compute core of FPDT (../shared/papers/fpdt.txt §3.1); where the chunks live
(device or host, prefetched) is the chunk store's business, not this op's.
"""

from __future__ import annotations

import math

import torch


def _block_mask(q_pos, k_pos, window, q_seg, k_seg):
    """Boolean (…, Cq, Ck) mask of allowed pairs for one chunk pair, or None if all are allowed."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask = mask & (k_pos[None, :] > q_pos[:, None] - window)
    if q_seg is not None:  # (B, Cq), (B, Ck) -> (B, 1, 1, Cq, Ck)
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
    return mask


def _pairs(n_chunks, chunk, window):
    """(query chunk, key chunk) pairs that can hold an allowed pair of positions."""
    for i in range(n_chunks):
        for j in range(i + 1):
            # Skip when even the closest pair (first query of i, last key of j) is out of the window.
            if window is not None and i * chunk - ((j + 1) * chunk - 1) >= window:
                continue
            yield i, j


def _scores(q, k, scale):
    # q (B, Hkv, G, Cq, D), k (B, Hkv, Ck, D) -> (B, Hkv, G, Cq, Ck)
    return torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, chunk, window, scale):
        b, h, s, d = q.shape
        hkv = k.shape[1]
        g = h // hkv
        qg = q.view(b, hkv, g, s, d)
        out = torch.zeros_like(qg)
        lse = torch.full((b, hkv, g, s), -math.inf, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device)
        positions = torch.arange(s, device=q.device)
        n_chunks = -(-s // chunk)
        for i, j in _pairs(n_chunks, chunk, window):
            qs, ks = slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk)
            scores = _scores(qg[:, :, :, qs], k[:, :, ks], scale).to(lse.dtype)
            mask = _block_mask(positions[qs], positions[ks], window,
                               None if segments is None else segments[:, qs], None if segments is None else segments[:, ks])
            scores = scores.masked_fill(~mask, -math.inf)
            block_lse = torch.logsumexp(scores, dim=-1)
            new_lse = torch.logaddexp(lse[..., qs], block_lse)
            # Rows with nothing allowed yet keep -inf; guard their weights against nan.
            old_w = torch.exp(lse[..., qs] - new_lse).nan_to_num(0.0)
            probs = torch.exp(scores - new_lse[..., None]).nan_to_num(0.0)
            block = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(v.dtype), v[:, :, ks])
            out[:, :, :, qs] = out[:, :, :, qs] * old_w[..., None].to(out.dtype) + block
            lse[..., qs] = new_lse
        ctx.save_for_backward(q, k, v, segments, out, lse)
        ctx.chunk, ctx.window, ctx.scale = chunk, window, scale
        return out.view(b, h, s, d), lse.view(b, h, s)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, segments, out, lse = ctx.saved_tensors
        chunk, window, scale = ctx.chunk, ctx.window, ctx.scale
        b, h, s, d = q.shape
        hkv = k.shape[1]
        g = h // hkv
        qg = q.view(b, hkv, g, s, d)
        dout = grad_out.reshape(b, hkv, g, s, d)
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # rowsum(dO ∘ O)
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(k), torch.zeros_like(v)
        positions = torch.arange(s, device=q.device)
        n_chunks = -(-s // chunk)
        pairs = sorted(_pairs(n_chunks, chunk, window), key=lambda p: (p[1], p[0]))  # outer: key chunks
        for i, j in pairs:
            qs, ks = slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk)
            scores = _scores(qg[:, :, :, qs], k[:, :, ks], scale).to(lse.dtype)
            mask = _block_mask(positions[qs], positions[ks], window,
                               None if segments is None else segments[:, qs], None if segments is None else segments[:, ks])
            probs = torch.exp(scores.masked_fill(~mask, -math.inf) - lse[..., qs, None]).nan_to_num(0.0)
            dv[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", probs.to(v.dtype), dout[:, :, :, qs])
            dprobs = torch.einsum("bhgqd,bhkd->bhgqk", dout[:, :, :, qs], v[:, :, ks]).to(lse.dtype)
            dscores = (probs * (dprobs - delta[..., qs, None]) * scale).to(q.dtype)
            dq[:, :, :, qs] += torch.einsum("bhgqk,bhkd->bhgqd", dscores, k[:, :, ks])
            dk[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", dscores, qg[:, :, :, qs])
        return dq.view(b, h, s, d), dk, dv, None, None, None, None


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk: int,
    window: int | None = None,
    segments: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of (B, H, S, D) queries over (B, H_kv, S, D) keys/values in chunks.

    ``window``: a query attends to at most the last ``window`` positions, itself
    included (Mistral / Gemma-2 convention). ``segments`` (B, S): packed documents; a
    query attends only to keys of its own segment.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out, _ = _ChunkedAttention.apply(q, k, v, segments, chunk, window, scale)
    return out
