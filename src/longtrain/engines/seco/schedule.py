"""The ``seco`` engine's schedule (exact chunk-wise optimization), which ``spaco`` shares.

Paper: the SeCO/SpaCO paper (Alg. 1–2). Both run the sequence through the
whole model chunk by chunk without gradients, parking every layer's K/V per chunk in a
:class:`~longtrain.memory.chunk_store.ChunkStore` (on the device or in host memory);
then, from the last chunk to the first, each chunk is recomputed with gradients against
the parked K/V of the earlier chunks (attention merged by log-sum-exp, never by
concatenating copies) and backpropagated. The gradient this sends to earlier chunks'
K/V waits in the store and joins those chunks' own K/V gradient when their turn comes
(and is freed then). Forward activations exist for one chunk at a time; only K/V grows
with the sequence. The pieces (store, attention calls, rotary tables, head) come from
:class:`~longtrain.engines.chunked.run.ChunkedRun`; the chunk-major order is this module's.
"""

from __future__ import annotations

import contextlib

import torch

from ...ops.token_stats import paused
from ..base import EngineContext
from ..batch import prepare_batch
from ..chunked.run import ChunkedRun, check_host_budget

__all__ = ["backward_chunk_major", "forward_chunk_major", "seco_step", "start_run"]


def forward_chunk_major(run: ChunkedRun) -> torch.Tensor:
    """SeCO's pass 1: the whole model on each chunk in turn, without gradients, parking
    every layer's K/V; returns the summed loss."""
    total = None
    with torch.no_grad(), run.context.forward_pass():
        for i in range(len(run.bounds)):
            loss = _chunk_forward(run, i, "forward")
            total = loss if total is None else total + loss
    return total


def backward_chunk_major(run: ChunkedRun, grad_loss: torch.Tensor, own_factor: float = 1.0) -> None:
    """Chunks from the last, each recomputed through the whole model against the parked
    K/V of earlier chunks and backpropagated from its own loss (times ``own_factor``)
    plus the K/V gradients later chunks relayed to it. With ``run.selected`` set
    (SpaCO), only those chunks are recomputed. Every chunk's backward reaches every
    layer: with ``float32_grad_sum`` the whole model's gradients are summed in float32."""
    with run.gradient_sum(run.adapter.model.parameters()) as sums:
        for i in reversed(range(len(run.bounds))):
            if run.selected is None or i in run.selected:
                # K/V gradients reach this chunk inside attend_chunk's backward (take_grad, which
                # brings back the layer below's while this one runs); the top layer's start now.
                if run.settings.prefetch:
                    run.store.prefetch(("dk", len(run.layers) - 1, i))
                    run.store.prefetch(("dv", len(run.layers) - 1, i))
                with _weighted_routes(run, own_factor):  # a router's balancing gradient, weighted as the chunk's loss
                    torch.autograd.backward(_chunk_forward(run, i, "recompute"), grad_loss * own_factor)
                sums.collect()
            for layer in range(len(run.layers)):
                run.discard_kv(layer, i)


def _weighted_routes(run: ChunkedRun, factor: float):
    balance = run.context.router_balance
    return contextlib.nullcontext() if balance is None or factor == 1.0 else balance.scaled(factor)


def _chunk_forward(run: ChunkedRun, i: int, mode: str) -> torch.Tensor:
    """Chunk ``i`` through the whole model and its loss; a recomputation draws the random
    numbers the chunk's forward drew."""
    if mode == "forward":
        run.record_draws(i)
    recompute = mode == "recompute"
    # A recomputation draws the forward's random numbers, and counts no token metric twice.
    replaying = run.replay_draws(i) if recompute else contextlib.nullcontext()
    with replaying, paused() if recompute else contextlib.nullcontext():
        hidden = run.adapter.embed(run.input_ids(i))
        for layer in range(len(run.layers)):
            hidden = run.run_layer(layer, hidden, i, mode)
        return run.chunk_loss(run.adapter.final_norm(hidden), i)


def start_run(context: EngineContext, batch, num_label_tokens) -> ChunkedRun:
    """The chunked run of one step, its host budget checked before any work."""
    settings = context.engine_options.settings()
    shard = context.shard(prepare_batch(batch, num_label_tokens), chunk=settings.chunk)
    check_host_budget(context, shard, settings)
    return ChunkedRun(context, shard, settings)


def seco_step(context: EngineContext, batch, num_label_tokens: int | None = None):
    run = start_run(context, batch, num_label_tokens)
    try:
        loss = forward_chunk_major(run)
        backward_chunk_major(run, torch.ones_like(loss))
    finally:
        run.store.clear()
    return context.finish(loss)
