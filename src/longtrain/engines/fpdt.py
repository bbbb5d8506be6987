"""The ``fpdt`` engine: layer-major chunked attention with host offload (FPDT on one device).

FPDT (../shared/papers/fpdt.txt) keeps only the chunks in use on the device. Here, with
the model's own layers run through its adapter (:mod:`.chunked` has the shared pieces):

**Forward** (no gradients, layer-major): the embeddings of each chunk are parked in the
store as layer 0's inputs (the checkpoints); then each layer runs over chunk 0, 1, …,
its attention parking the chunk's K/V and attending over the parked K/V of earlier
chunks, and its output chunks are parked as the next layer's inputs. The head computes
each chunk's loss. With ``recompute_kv`` a layer's K/V are dropped once the layer is done.

**Backward** (layer-major, in reverse): the head's gradient chunk by chunk from the
parked final outputs; then for each layer from the top — first parking its K/V again if
they were dropped, by running only its attention sub-block — each chunk from the last
is recomputed on its parked input with gradients, attending over the parked K/V of
earlier chunks, and backpropagated. The gradients of earlier chunks' K/V wait in the
store and join those chunks' own K/V gradients when their turn comes, so the result is
exact. Last, the embedding's gradient, chunk by chunk.

Device memory holds one chunk's working set plus what the store keeps on the device
(nothing with ``offload`` and ``offload_inputs``). Compute is that of layer
checkpointing — one extra forward — plus, with ``recompute_kv``, each layer's attention
projections once more. Parameter gradients accumulate in ``.grad`` through autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import validate
from ..memory.units import parse_bytes
from ..registry import register_engine
from .base import EngineContext
from .batch import prepare_batch
from .chunked import ChunkedRun, ChunkSettings, check_chunkable, check_host_budget


@dataclass
class FPDT:
    """Knobs of the FPDT engine."""

    chunk: int = 4096  # tokens per chunk
    offload: bool = False  # park K/V chunks in host memory (pinned pool, side streams)
    offload_inputs: bool | None = None  # park the layer inputs too; default: = offload
    prefetch: int = 1  # chunks fetched ahead (1 = double buffering)
    host_memory: str | int | None = None  # host budget, e.g. "120GiB"; None: unbounded
    recompute_kv: bool = True  # keep one layer's K/V; recompute them (attention sub-block) in backward

    def __post_init__(self):
        validate.positive_int("fpdt", "chunk", self.chunk)
        validate.positive_int("fpdt", "prefetch", self.prefetch, minimum=0)
        validate.flag("fpdt", "offload", self.offload)
        validate.flag("fpdt", "recompute_kv", self.recompute_kv)
        if self.offload_inputs is not None:
            validate.flag("fpdt", "offload_inputs", self.offload_inputs)
        if self.host_memory is not None:
            parse_bytes(self.host_memory)  # a clear error now rather than at the first step

    def settings(self) -> ChunkSettings:
        return ChunkSettings(
            chunk=self.chunk, offload=self.offload, prefetch=self.prefetch,
            host_budget=None if self.host_memory is None else parse_bytes(self.host_memory),
            offload_inputs=self.offload if self.offload_inputs is None else self.offload_inputs,
            recompute_kv=self.recompute_kv,
        )


def forward_layer_major(run: ChunkedRun) -> torch.Tensor:
    """The summed loss; leaves every layer's input chunks (and the final output) parked."""
    store, adapter, ahead = run.store, run.adapter, run.settings.prefetch
    parked = run.settings.offload_inputs
    chunks = range(len(run.bounds))
    for i in chunks:
        store.put(("x", 0, i), adapter.embed(run.input_ids(i)), offload=parked)
    for layer in range(len(run.layers)):
        for i in chunks:
            for j in range(i + 1, min(i + 1 + ahead, len(run.bounds))):
                store.prefetch(("x", layer, j))
            out = run.run_layer(layer, store.get(("x", layer, i)), i, "forward")
            store.put(("x", layer + 1, i), out, offload=parked)
        if run.settings.recompute_kv:
            for i in chunks:
                run.discard_kv(layer, i)
    total = None
    for i in chunks:
        loss = run.chunk_loss(adapter.final_norm(store.get(("x", len(run.layers), i))), i)
        total = loss if total is None else total + loss
    return total


def backward_layer_major(run: ChunkedRun, grad_loss: torch.Tensor) -> None:
    store, adapter, n = run.store, run.adapter, len(run.layers)
    parked = run.settings.offload_inputs
    chunks = range(len(run.bounds))
    # Head: gradient of each chunk's loss with respect to the last layer's output.
    for i in chunks:
        y = store.pop(("x", n, i)).detach().requires_grad_(True)
        torch.autograd.backward(run.chunk_loss(adapter.final_norm(y), i), grad_loss)
        store.put(("dy", i), y.grad, offload=parked)
    # Layers from the top; in each, chunks from the last.
    for layer in reversed(range(n)):
        if run.settings.recompute_kv:
            with torch.no_grad():
                for i in chunks:
                    adapter.run_attention(run.layers[layer], store.get(("x", layer, i)), run.position_embeddings(i),
                                          run.call(i, "kv"))
        for i in reversed(chunks):
            if i > 0:
                store.prefetch(("x", layer, i - 1))
                store.prefetch(("dy", i - 1))
            x = store.pop(("x", layer, i)).detach().requires_grad_(True)
            torch.autograd.backward(run.run_layer(layer, x, i, "recompute"), store.pop(("dy", i)))
            store.put(("dy", i), x.grad, offload=parked)
            run.discard_kv(layer, i)
    # Embeddings, chunk by chunk.
    embeddings_train = any(p.requires_grad for p in adapter.base.get_input_embeddings().parameters())
    for i in chunks:
        grad = store.pop(("dy", i))
        if embeddings_train:
            torch.autograd.backward(adapter.embed(run.input_ids(i)), grad)


@register_engine(
    "fpdt", FPDT, "layer-major chunked attention with host offload and prefetch (FPDT on one device, exact)",
    accepts=("mst",),
    conflicts={"checkpoint": "the fpdt engine already recomputes every layer chunk by chunk; drop 'checkpoint'"},
    check=lambda context: check_chunkable(context, "fpdt"),
)
def fpdt_step(context: EngineContext, batch, num_label_tokens: int | None = None):
    seq = prepare_batch(batch, num_label_tokens)
    settings = context.engine_options.settings()
    check_host_budget(context, seq, settings, "fpdt")
    run = ChunkedRun(context, seq, settings)
    try:
        with torch.no_grad():
            loss = forward_layer_major(run)
        if torch.is_grad_enabled():
            backward_layer_major(run, torch.ones_like(loss))
    finally:
        run.store.clear()
    return loss.detach()
