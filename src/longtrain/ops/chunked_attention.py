"""Chunked causal attention with an online softmax and exact chunk-wise backward.

Two autograd functions share the block kernels of :mod:`.attention_blocks` and the
masking decisions of :mod:`.masking`:

- :func:`chunked_attention` — the whole sequence is given; it is split into chunks of
  ``chunk`` tokens. Forward: each query chunk meets the key/value chunks at or before
  it (inside the sliding window, when one is set), merged with their log-sum-exp.
  Backward, as in FPDT (the FPDT paper §4.2): outer loop over key/value
  chunks, inner loop over the query chunks that see them, accumulating dK/dV for the
  outer chunk and dQ for each inner one, from the saved output and LSE.
- :func:`attend_chunk` — one query chunk with its own keys/values, plus a *history*
  of earlier chunks' keys/values kept elsewhere (a chunk store, on the device or in
  host memory). Only one earlier chunk needs to be on the device at a time. Backward
  sends each earlier chunk's dK/dV to the history's accumulator and adds what later
  chunks accumulated for this chunk into its own dK/dV. Running the query chunks in
  reverse order therefore gives exact gradients chunk by chunk: this is how the
  chunked engines (:mod:`longtrain.engines.chunked.run`) recompute a layer one chunk at a
  time.

Neither needs a gradient through an LSE output. Grouped K/V heads are used as they are.
"""

from __future__ import annotations

import functools
import math
from typing import Iterator, Protocol

import torch
from torch._subclasses.fake_tensor import is_fake

from .attention_blocks import block_backward, block_forward, lse_dtype, merge_
from .attention_node import attention_from_output
from .attention_sinks import add_sink
from .masking import BlockPlanner, SequenceMask

__all__ = [
    "attend_chunk",
    "attend_chunk_backward",
    "attend_chunk_forward",
    "chunk_bounds",
    "chunked_attention",
    "chunked_backward",
    "chunked_forward",
]


class KVHistory(Protocol):
    """Earlier chunks' keys/values for one layer (what :func:`attend_chunk` reads).

    ``blocks(backward)`` yields ``(chunk_index, k, v)`` for every earlier chunk, in
    order, with its tensors on the device (prefetching the next ones, and in backward
    their gradient accumulators, is the history's business).
    ``add_grad(chunk_index, dk, dv)`` accumulates gradients for an earlier chunk;
    ``take_grad()`` returns (and forgets) what was accumulated for the current chunk,
    or None.
    """

    def blocks(self, backward: bool = False) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]: ...

    def add_grad(self, index: int, dk: torch.Tensor, dv: torch.Tensor) -> None: ...

    def take_grad(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...


def chunk_bounds(length: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of consecutive chunks of ``chunk`` tokens (the last shorter)."""
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


def _visible_blocks(planner: BlockPlanner, window, device, keys_outer=False, once_per_kind=False):
    """``(qi, ki, tiles, first)`` of every block with something visible, query chunks outer
    (forward) or key/value chunks outer (FPDT's backward order); ``tiles`` as
    :meth:`BlockPlanner.tiles` gives them (one tile, the block, unless it is masked and large);
    ``first``: the first such block of its query chunk.

    ``once_per_kind`` (fake tensors: the simulator) yields only the first block of each
    kind (:meth:`BlockPlanner.kind`, and ``first``): blocks of one kind allocate and free the
    same tensors around the same accumulators, so the loop's peaks are those of every block,
    and its cost grows with the number of kinds, not with the square of the length (a
    36K-token Gemma-2 layer has 666 blocks of 1,024 tokens, of a handful of kinds)."""
    n = len(planner.bounds)
    pairs = [(qi, ki) for qi in range(n) for ki in range(qi + 1)]
    if keys_outer:
        pairs.sort(key=lambda pair: (pair[1], pair[0]))
    started, seen = set(), set()
    for qi, ki in pairs:
        kind = planner.kind(qi, ki, window) if once_per_kind else None
        if once_per_kind and (kind is None or (kind, qi not in started) in seen):
            if kind is not None:
                started.add(qi)
            continue
        tiles = planner.tiles(qi, ki, window, device)
        if tiles:
            first = qi not in started
            started.add(qi)
            seen.add((kind, first))
            yield qi, ki, tiles, first


def _tiles_forward(q, k, v, tiles, q0, k0, out, lse, scale, softcap) -> None:
    """Merge the tiles of one block (positions relative to ``q0``/``k0``, where q's and k's
    rows start) into the running ``out``/``lse`` of q's rows, in place."""
    for (qa, qb), (ka, kb), causal, mask in tiles:
        rows, keys = slice(qa - q0, qb - q0), slice(ka - k0, kb - k0)
        bo, bl = block_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], scale=scale, causal=causal, mask=mask,
                               softcap=softcap)
        merge_(out[:, :, rows], lse[:, :, rows], bo, bl)


def _tiles_backward_(grad_out, q, k, v, out, lse, tiles, q0, k0, scale, softcap, dq, dk, dv) -> None:
    """Add one block's tiles' gradients (positions relative to ``q0``/``k0``, where q's and
    k's rows start) into ``dq``/``dk``/``dv``, from the global output and LSE."""
    for (qa, qb), (ka, kb), causal, mask in tiles:
        rows, keys = slice(qa - q0, qb - q0), slice(ka - k0, kb - k0)
        bq, bk, bv = block_backward(grad_out[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                                    lse[:, :, rows], scale=scale, causal=causal, mask=mask, softcap=softcap)
        dq[:, :, rows] += bq
        dk[:, :, keys] += bk
        dv[:, :, keys] += bv


def _whole(tiles, q_range, k_range) -> tuple[bool, object] | None:
    """``(causal, mask)`` when ``tiles`` is the one block ``q_range`` × ``k_range``, else None."""
    if len(tiles) == 1 and tiles[0][0] == q_range and tiles[0][1] == k_range:
        return tiles[0][2], tiles[0][3]
    return None


def chunked_forward(q, k, v, planner: BlockPlanner, window, scale, softcap) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, S, D) and LSE (B, H, S) of chunked causal attention, without autograd."""
    acc = lse_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
    bounds = planner.bounds
    # The first block of a query chunk is copied into out/lse, the later ones merged.
    for qi, ki, tiles, first in _visible_blocks(planner, window, q.device, once_per_kind=is_fake(q)):
        (qa, qb), (ka, kb) = bounds[qi], bounds[ki]
        whole = _whole(tiles, bounds[qi], bounds[ki])
        if whole is None:  # a large masked block, tile by tile
            _tiles_forward(q, k, v, tiles, 0, 0, out, lse, scale, softcap)
        else:
            bo, bl = block_forward(q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], scale=scale,
                                   causal=whole[0], mask=whole[1], softcap=softcap)
            if first:
                out[:, :, qa:qb], lse[:, :, qa:qb] = bo, bl
            else:
                merge_(out[:, :, qa:qb], lse[:, :, qa:qb], bo, bl)
    return out.to(q.dtype), lse


def chunked_backward(grad_out, q, k, v, out, lse, planner: BlockPlanner, window, scale, softcap):
    """(dq, dk, dv) of chunked causal attention from the global output and LSE."""
    grad_out = grad_out.contiguous()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # Outer loop over key/value chunks (their dK/dV finish there), inner over queries.
    for _, _, tiles, _ in _visible_blocks(planner, window, q.device, keys_outer=True, once_per_kind=is_fake(q)):
        _tiles_backward_(grad_out, q, k, v, out, lse, tiles, 0, 0, scale, softcap, dq, dk, dv)
    return dq, dk, dv


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, planner, window, scale, softcap):
        out, lse = chunked_forward(q, k, v, planner, window, scale, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.planner, ctx.window, ctx.scale, ctx.softcap = planner, window, scale, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = chunked_backward(grad_out, q, k, v, out, lse, ctx.planner, ctx.window, ctx.scale, ctx.softcap)
        return dq, dk, dv, None, None, None, None


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
    mask: SequenceMask | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    planner: BlockPlanner | None = None,
) -> torch.Tensor:
    """Causal attention of (B, H, S, D) queries over (B, H_kv, S, D) keys/values in chunks.

    ``window``: a query attends to at most the last ``window`` positions, itself
    included (Mistral / Gemma-2 convention). ``mask``: packed documents and padding
    (:class:`~longtrain.ops.masking.SequenceMask`). ``softcap``: attention logit
    soft-capping ``c·tanh(s/c)`` (Gemma-2). ``planner``: the block decisions for these
    chunks, when the caller already has them (one per step instead of one per call).
    """
    _check_heads(q, k)
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if planner is None:
        planner = BlockPlanner(mask, chunk_bounds(q.shape[2], chunk))
    return _ChunkedAttention.apply(q, k, v, planner, window, scale, softcap)


def attend_chunk_forward(q, k, v, history: KVHistory, planner: BlockPlanner, index: int, window, scale, softcap):
    """Output and LSE of query chunk ``index`` over its own K/V and ``history``, without autograd."""
    acc = lse_dtype(q.dtype)
    bounds = planner.bounds
    out = lse = None  # the first block's output and LSE start the running pair (no merge)

    def attend(j, keys, values):
        nonlocal out, lse
        tiles = planner.tiles(index, j, window, q.device)
        whole = _whole(tiles, bounds[index], bounds[j])
        if whole is not None:
            bo, bl = block_forward(q, keys, values, scale=scale, causal=whole[0], mask=whole[1], softcap=softcap)
            if out is None:
                out, lse = bo, bl
                return
            if out.dtype != acc:
                out = out.to(acc)
            merge_(out, lse, bo, bl)
        elif tiles:  # a large masked block, tile by tile
            if out is None:
                out = torch.zeros(q.shape, dtype=acc, device=q.device)
                lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
            elif out.dtype != acc:
                out = out.to(acc)
            _tiles_forward(q, keys, values, tiles, bounds[index][0], bounds[j][0], out, lse, scale, softcap)

    for j, k_past, v_past in history.blocks():  # one earlier chunk on the device at a time
        attend(j, k_past, v_past)
    attend(index, k, v)
    return out.to(q.dtype), lse


def _block_backward(grad_out, q, k, v, out, lse, planner, index, j, window, scale, softcap):
    """(dq, dk, dv) of query chunk ``index`` against key chunk ``j``, or None when skipped."""
    tiles = planner.tiles(index, j, window, q.device)
    if not tiles:
        return None
    whole = _whole(tiles, planner.bounds[index], planner.bounds[j])
    if whole is not None:
        return block_backward(grad_out, q, k, v, out, lse, scale=scale, causal=whole[0], mask=whole[1], softcap=softcap)
    grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _tiles_backward_(grad_out, q, k, v, out, lse, tiles, planner.bounds[index][0], planner.bounds[j][0], scale, softcap,
                     *grads)
    return grads


def attend_chunk_backward(grad_out, q, k, v, out, lse, history: KVHistory, planner: BlockPlanner, index: int, window,
                          scale, softcap):
    """(dq, dk, dv) of :func:`attend_chunk`: earlier chunks' K/V gradients go to
    ``history``, and what later chunks sent to this chunk's K/V is added."""
    grad_out = grad_out.contiguous()
    own = _block_backward(grad_out, q, k, v, out, lse, planner, index, index, window, scale, softcap)
    dq, dk, dv = own if own is not None else (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    for j, k_past, v_past in history.blocks(backward=True):
        grads = _block_backward(grad_out, q, k_past, v_past, out, lse, planner, index, j, window, scale, softcap)
        if grads is None:
            continue
        bq, bk, bv = grads
        dq += bq  # dq is the first block's fresh gradient: accumulated in place
        history.add_grad(j, bk, bv)
    later = history.take_grad()  # what the later query chunks sent to this chunk's K/V
    if later is not None:
        dk, dv = dk + later[0], dv + later[1]
    return dq, dk, dv


class _AttendChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, history, planner, index, window, scale, softcap):
        out, lse = attend_chunk_forward(q, k, v, history, planner, index, window, scale, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (history, planner, index, window, scale, softcap)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attend_chunk_backward(grad_out, q, k, v, out, lse, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None, None


def attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    history: KVHistory,
    *,
    planner: BlockPlanner,
    index: int,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query chunk ``index`` (B, H, C, D) of ``planner.bounds`` over
    its own keys/values (B, H_kv, C, D) and the earlier chunks in ``history``.

    The planner holds the sequence's packed documents and padding; masked keys are
    never attended. See the module docstring for the gradient contract. ``sink``: (H,)
    logits in every row's normaliser, added once the chunk's blocks are merged
    (:mod:`.attention_sinks`).
    """
    _check_heads(q, k)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if sink is None:
        return _AttendChunk.apply(q, k, v, history, planner, index, window, scale, softcap)
    with torch.no_grad():
        out, lse = add_sink(*attend_chunk_forward(q, k, v, history, planner, index, window, scale, softcap), sink)
    backward = functools.partial(chunk_backward, history, planner, index, window, scale, softcap)
    return attention_from_output(q, k, v, out, lse, backward, sink=sink)


def chunk_backward(history, planner, index, window, scale, softcap, grad_out, q, k, v, out, lse):
    """:func:`attend_chunk_backward` with the chunk's settings first, as a kept output's
    node calls it (``functools.partial`` of the settings)."""
    return attend_chunk_backward(grad_out, q, k, v, out, lse, history, planner, index, window, scale, softcap)
