"""The ``fpdt`` engine: layer-major chunked attention with host offload (FPDT on one device).

FPDT (its paper) keeps only the chunks in use on the device. Here, with
the model's own layers run through its adapter (:mod:`.chunked` has the shared pieces):

**Forward** (no gradients, layer-major): each layer runs over chunk 0, 1, … (the first
on the chunk's embeddings, a lookup recomputed whenever needed), its attention parking
the chunk's K/V and attending over the parked K/V of earlier chunks, and its output
chunks are parked in the store as the next layer's inputs (the checkpoints). The head
takes each chunk of the last layer's output as it comes: its loss, and in training its
backward at once (with gradients, the only part of the forward that has them), parking
the gradient of that output — so the head runs forward once per step, not again in
backward. With ``recompute_kv`` a layer's K/V are dropped once the layer is done.

**Backward** (layer-major, in reverse): for each layer from the top — first parking its K/V again if
they were dropped, by running its attention sub-block up to attention itself (no
attention, no output projection) — each chunk from the last
is recomputed on its parked input with gradients, attending over the parked K/V of
earlier chunks, and backpropagated. The gradients of earlier chunks' K/V wait in the
store and join those chunks' own K/V gradients when their turn comes, so the result is
exact. The first layer's backward runs on through the chunk's embeddings.

Device memory holds one chunk's working set plus what the store keeps on the device
(nothing with ``offload`` and ``offload_inputs``). Compute is that of layer
checkpointing — one extra forward, without the MLP's output (the recomputed layer is only
backpropagated through: ``ops.tiled_mlp.outputs_unread``, where nothing after the MLP saves a tensor,
which ``ops.unread_outputs`` learns per layer) — plus,
with ``recompute_kv``, each layer's q/k/v projections once more. With ``keep_output`` (Memo's idea, the Memo paper §4)
each chunk's attention output and LSE are parked too (beside its layer input), and the
recomputation hands them to attention's backward instead of attending again: the
extra forward is token-wise work only, and the earlier chunks' K/V are fetched once per
chunk in backward instead of twice. At long lengths, where attention dominates, that is
about a fifth of the attention time (forward, recomputed forward and backward ≈ 1 + 1 +
2.5 become 1 + 2.5). It parks about as much again as the layer inputs (Llama-3-8B: 8 KiB + 128 B per token
and layer in bf16), so it is off by default; ``keep_output=N`` keeps the lowest N layers'
outputs and ``keep_output=fit`` as many layers' as the host budget holds beside the parked
inputs and K/V (with ``offload_inputs``, which ``offload`` implies; the rest re-run attention as without it), and
``longtrain plan`` / ``--strategy auto`` weigh every layer's, as many as fit, and none
(docs/speed.md). ``offload_inputs`` alone parks the inputs (and kept outputs) and
leaves one layer's K/V and their gradient sums on the device: no copy per pair of chunks
(:func:`host_traffic` counts what each setting copies).
Parameter gradients reach ``.grad`` through autograd; with ``float32_grad_sum`` (default)
a bf16/fp16 layer's gradients are summed over its chunks in float32 and rounded once
(:mod:`.gradient_sum`), the head's over the last layer's forward likewise.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import validate
from ..errors import LongtrainError
from ..memory.units import parse_bytes
from ..ops.unread_outputs import UnreadMLPOutputs
from ..parallel.fsdp import gathered
from ..registry import EngineSpec, register
from .base import EngineContext
from .batch import prepare_batch
from .chunked import ChunkedRun, ChunkSettings, check_chunkable, check_host_budget
from .fpdt_costs import FPDTCosts, HostTraffic, host_traffic

__all__ = ["FPDTOptions", "fpdt_step", "forward_layer_major", "backward_layer_major", "HostTraffic", "host_traffic"]


@dataclass
class FPDTOptions:
    """Knobs of the FPDT engine."""

    chunk: int = 4096  # tokens per chunk
    offload: bool = False  # park K/V chunks in host memory (pinned pool, side streams)
    offload_inputs: bool | None = None  # park the layer inputs too; default: = offload
    prefetch: int = 1  # chunks fetched ahead (1 = double buffering)
    host_memory: str | int | None = None  # host budget, e.g. "120GiB"; default: half the physical memory on CUDA
    recompute_kv: bool = True  # keep one layer's K/V; recompute them (attention sub-block) in backward
    keep_output: bool | int | str = False  # park attention output + LSE (Memo's idea): every layer, the lowest N, or "fit"
    segment: int = 1  # park every segment-th layer's input only; backward recomputes the layers between (one more forward)
    float32_grad_sum: bool = True  # bf16/fp16 parameters: sum each layer's chunk gradients in float32, round once

    def __post_init__(self):
        validate.positive_int("fpdt", "chunk", self.chunk)
        validate.positive_int("fpdt", "prefetch", self.prefetch, minimum=0)
        validate.flag("fpdt", "offload", self.offload)
        validate.flag("fpdt", "recompute_kv", self.recompute_kv)
        keep = self.keep_output
        if not (isinstance(keep, bool) or keep == "fit" or (isinstance(keep, int) and keep >= 0)):
            raise LongtrainError(f"fpdt option keep_output must be true, false, fit (as many layers as the host budget "
                                 f"holds) or a number of layers, got {keep!r}")
        validate.positive_int("fpdt", "segment", self.segment)
        validate.flag("fpdt", "float32_grad_sum", self.float32_grad_sum)
        if self.segment > 1 and (self.keep_output or not self.recompute_kv):
            raise LongtrainError("fpdt: segment > 1 parks fewer layer inputs; keep_output and recompute_kv=false park "
                                 "something per layer again — use segment alone (or segment=1 with them)")
        if self.offload_inputs is not None:
            validate.flag("fpdt", "offload_inputs", self.offload_inputs)
        if self.host_memory is not None:
            validate.byte_size("fpdt", "host_memory", self.host_memory)  # a clear error now rather than at the first step

    def settings(self) -> ChunkSettings:
        return ChunkSettings(
            chunk=self.chunk, offload=self.offload, prefetch=self.prefetch,
            host_budget=None if self.host_memory is None else parse_bytes(self.host_memory),
            offload_inputs=self.offload if self.offload_inputs is None else self.offload_inputs,
            recompute_kv=self.recompute_kv, keep_output=self.keep_output, segment=self.segment,
            float32_grad_sum=self.float32_grad_sum,
        )


def forward_layer_major(run: ChunkedRun, train: bool) -> torch.Tensor:
    """The summed loss (detached); leaves every layer's input chunks but the first
    (embeddings are recomputed: a lookup) parked, and with ``train`` the gradient of the
    loss with respect to the last layer's output: each chunk's head runs forward and
    backward as soon as that output exists, so backward never runs the head again."""
    store, ahead = run.store, run.settings.prefetch
    parked = run.settings.offload_inputs
    chunks = range(len(run.bounds))
    total = None
    carry = run.head_carry() if train else None
    for layer in range(len(run.layers)):
        last = layer == len(run.layers) - 1
        run.prefetch_inputs(layer, 0)
        # The head's gradients, one backward per chunk, are summed in float32 (bf16 weights): the
        # fused head's in its own buffer (carry), the final norm's (and an unfused head's) here.
        with run.gradient_sum(run.head_parameters() if last and train else ()) as sums:
            for i in chunks:
                for j in range(i + 1, i + 1 + ahead):
                    run.prefetch_inputs(layer, j)
                run.record_draws((layer, i))
                out = run.run_layer(layer, _layer_input(run, layer, i), i, "forward")
                if last:
                    loss = _head(run, out, i, train, carry)
                    sums.collect()
                    total = loss if total is None else total + loss
                else:
                    store.put(("x", layer + 1, i), out, offload=parked)
        if run.settings.recompute_kv:
            for i in chunks:
                run.discard_kv(layer, i)
        if layer % run.settings.segment:  # inside a segment: backward recomputes this input
            for i in chunks:
                store.discard(("x", layer, i))
    return total


def _head(run: ChunkedRun, out: torch.Tensor, i: int, train: bool, carry=None) -> torch.Tensor:
    """Chunk ``i``'s loss from the last layer's output; with ``train`` its backward too,
    the output's gradient parked for the layers' backward. ``carry``: the fused head's
    weight gradient is summed over the chunks and reaches ``.grad`` at the last one."""
    if not train:
        return run.chunk_loss(run.adapter.final_norm(out), i)
    if carry is not None:
        carry.last = i == len(run.bounds) - 1
    with torch.enable_grad():
        y = out.detach().requires_grad_(True)
        loss = run.chunk_loss(run.adapter.final_norm(y), i, carry)
        torch.autograd.backward(loss)
    run.store.put(("dy", i), y.grad, offload=run.settings.offload_inputs)
    return loss.detach()


def _layer_input(run: ChunkedRun, layer: int, i: int) -> torch.Tensor:
    """Chunk ``i``'s input to ``layer``: parked, or for the first layer its embeddings."""
    return run.adapter.embed(run.input_ids(i)) if layer == 0 else run.store.get(("x", layer, i))


_UNREAD_MLP_OUTPUTS = UnreadMLPOutputs()  # per layer, learned at its first recomputation


def backward_layer_major(run: ChunkedRun) -> None:
    """The layers' backward, from the gradients of the last layer's output that the
    forward parked (:func:`forward_layer_major` with ``train``)."""
    store, adapter, n = run.store, run.adapter, len(run.layers)
    parked = run.settings.offload_inputs
    chunks = range(len(run.bounds))
    # Layers from the top; in each, chunks from the last. The first layer's backward goes
    # on through the embeddings of its chunk, in the same pass.
    segment = run.settings.segment
    for layer in reversed(range(n)):
        if segment > 1 and (layer == n - 1 or (layer + 1) % segment == 0):
            _recompute_segment_inputs(run, first=layer - layer % segment, top=layer)
        if run.settings.recompute_kv:
            # Only the attention sub-block runs, outside the layer's forward: its weights
            # are gathered here when they are sharded (FSDP).
            with torch.no_grad(), gathered(run.layers[layer]):
                run.prefetch_inputs(layer, 0)
                for i in chunks:
                    run.prefetch_inputs(layer, i + 1)
                    with run.replay_draws((layer, i)):
                        adapter.run_attention(run.layers[layer], _layer_input(run, layer, i), run.position_embeddings(i),
                                              run.call(i, "kv"))
        # While chunk i is recomputed and backpropagated, what chunk i - 1 reads comes back.
        _prefetch_backward(run, layer, chunks[-1])
        # The layer's gradients are summed over its chunks in float32 (bf16 weights); not the
        # embeddings' (the first layer's backward runs on through them): a token's row gets
        # gradients only from its own occurrences, and its error does not grow with the chunks.
        with run.gradient_sum(run.layers[layer].parameters()) as sums:
            for i in reversed(chunks):
                _prefetch_backward(run, layer, i - 1)
                with run.replay_draws((layer, i)):
                    if layer > 0:
                        x = store.pop(("x", layer, i)).detach().requires_grad_(True)
                    else:
                        x = adapter.embed(run.input_ids(i))
                    with _UNREAD_MLP_OUTPUTS.recomputing(run.layers[layer]) as learn:  # only backpropagated through
                        out = run.run_layer(layer, x, i, "recompute")
                        learn(out)
                torch.autograd.backward(out, store.pop(("dy", i)))
                sums.collect()
                if layer > 0:
                    store.put(("dy", i), x.grad, offload=parked)
                run.discard_kv(layer, i)
                if i > 0 and run.settings.prefetch:  # chunk i sent chunk i - 1's K/V its last gradient: back while i - 1 recomputes
                    store.prefetch(("dk", layer, i - 1))
                    store.prefetch(("dv", layer, i - 1))


def _prefetch_backward(run: ChunkedRun, layer: int, i: int) -> None:
    """Start bringing back what the backward of chunk ``i`` of ``layer`` reads: its input
    and rotary tables, its output's gradient and (``keep_output``) its attention output and LSE."""
    if i < 0 or not run.settings.prefetch:
        return
    run.prefetch_inputs(layer, i)
    run.store.prefetch(("dy", i))
    if layer < run.kept_outputs:
        run.outputs.prefetch((layer, i))


def _recompute_segment_inputs(run: ChunkedRun, first: int, top: int) -> None:
    """Park the inputs of layers ``first + 1`` … ``top`` again, running layers ``first`` …
    ``top - 1`` forward from the parked input of ``first`` (``segment`` > 1)."""
    store, parked, chunks = run.store, run.settings.offload_inputs, range(len(run.bounds))
    with torch.no_grad():
        for layer in range(first, top):
            run.prefetch_inputs(layer, 0)
            for i in chunks:
                run.prefetch_inputs(layer, i + 1)
                with run.replay_draws((layer, i)):
                    out = run.run_layer(layer, _layer_input(run, layer, i), i, "forward")
                store.put(("x", layer + 1, i), out, offload=parked)
            for i in chunks:  # its backward parks them again ("kv" mode), one layer at a time
                run.discard_kv(layer, i)


def fpdt_step(context: EngineContext, batch, num_label_tokens: int | None = None):
    settings = context.engine_options.settings()
    shard = context.shard(prepare_batch(batch, num_label_tokens), chunk=settings.chunk)
    check_host_budget(context, shard, settings, "fpdt")
    run = ChunkedRun(context, shard, settings)
    train = torch.is_grad_enabled()
    try:
        with torch.no_grad(), context.forward_pass():
            loss = forward_layer_major(run, train)
        if train:
            backward_layer_major(run)
    finally:
        run.store.clear()
    return context.finish(loss)


register(EngineSpec("fpdt", FPDTOptions, fpdt_step, "layer-major chunked attention with host offload and prefetch (FPDT on one device, exact)",
    accepts=("mst", "liger"),
    conflicts={"checkpoint": "the fpdt engine already recomputes every layer chunk by chunk; drop 'checkpoint'"},
    check=lambda context: check_chunkable(context, "fpdt"), sequence_parallel=True, costs=FPDTCosts(),))
