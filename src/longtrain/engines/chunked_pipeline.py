"""The chunked pipeline: a Hugging Face decoder trained one sequence chunk at a time.

FPDT (../shared/papers/fpdt.txt) keeps only the chunks in use on the device. Applied to
a model as it is — its own decoder layers, norms and projections, no edits — that means:

**Forward** (no gradients, layer-major as in FPDT): the decoder's preamble (embedding,
scaling, rotary tables) runs per chunk up to the first layer, whose input chunks are
parked in the :class:`~longtrain.memory.chunk_store.ChunkStore` (the checkpoints); then
each layer runs over chunk 0, 1, …, its attention (the ``longtrain_chunked`` backend)
parking the chunk's K/V and attending over the parked K/V of the earlier chunks, one at
a time, and its output chunks parked as the next layer's inputs. The head computes each
chunk's loss. With ``recompute_kv`` a layer's K/V are dropped once the layer is done.

**Backward** (layer-major, in reverse): the head's gradient is computed chunk by chunk
from the parked final-layer outputs; then for each layer from the top — first re-parking
its K/V if they were dropped, by running the layer only up to its attention call — each
chunk from the last is recomputed on its parked input with gradients, attending over
the parked K/V of earlier chunks (:func:`~longtrain.ops.chunked_attention.attend_chunk`),
and backpropagated. The gradients of earlier chunks' K/V go to accumulators in the store
and are added to those chunks' own K/V gradients when their turn comes, so the result
is exact. Last, the embedding's gradient is computed by re-running the decoder's
preamble for each chunk.

SeCO and SpaCO (:mod:`longtrain.engines.seco`) drive the same run chunk-major instead:
the whole decoder per chunk forward (parking every layer's K/V, no layer inputs), and
per chunk in reverse backward (:meth:`ChunkedRun.backward_chunk_major`).

Device memory then holds one chunk's working set, plus whatever the store keeps on the
device (nothing with ``offload`` and ``offload_inputs``). Compute is that of layer
checkpointing — one extra forward — plus, with ``recompute_kv``, the K/V projections once
more.

The whole schedule is one autograd node (:class:`_PipelineLoss`) whose backward runs
the reverse pass, so ``loss.backward()``, gradient accumulation and the optimizer work
as usual; parameter gradients accumulate in ``.grad`` as in reentrant checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import LongtrainError
from ..memory.chunk_store import ChunkStore, PinnedPool
from ..memory.units import format_bytes
from ..models.attention import chunked_run
from ..models.layers import decoder_layers, unwrap
from ..ops.chunked_loss import chunked_causal_lm_loss
from ..ops.chunked_attention import attend_chunk
from ..ops.loss import shift_labels


# Where the chunked-attention technique records its options on a model; other techniques
# and the chunk-wise engines look here to adapt (or refuse) when it is installed.
PIPELINE_ATTR = "_longtrain_chunked_attention"


@dataclass
class PipelineSettings:
    chunk: int
    offload: bool  # park K/V chunks (and K/V gradients) in host memory
    offload_inputs: bool  # park checkpointed layer inputs (and their gradients) too
    prefetch: int  # chunks fetched ahead of use
    host_budget: int | None  # bytes; None: unbounded
    recompute_kv: bool = False  # park one layer's K/V at a time; recompute them in backward


class _StopPreamble(Exception):
    """Raised by a pre-hook on the first layer to stop the decoder after its preamble."""

    def __init__(self, hidden=None):
        self.hidden = hidden


class _StopAfterKV(Exception):
    """Raised by the attention backend once a layer's K/V are parked (K/V recomputation)."""


class _LayerHistory:
    """One layer's earlier K/V chunks for :func:`attend_chunk`, read from the store."""

    def __init__(self, run: "ChunkedRun", layer: int, index: int, first: int):
        self.run, self.layer, self.index, self.first = run, layer, index, first

    def blocks(self, backward: bool = False):
        store, bounds, ahead = self.run.store, self.run.bounds, self.run.settings.prefetch
        # In backward the gradient accumulators travel with the K/V they belong to.
        kinds = ("k", "v", "dk", "dv") if backward else ("k", "v")
        indices = range(self.first, self.index)
        for n in range(min(ahead, len(indices))):
            self._prefetch(indices[n], kinds)
        for n, j in enumerate(indices):
            if n + ahead < len(indices):
                self._prefetch(indices[n + ahead], kinds)
            yield j, bounds[j][0], bounds[j][1], store.get(("k", self.layer, j)), store.get(("v", self.layer, j))

    def _prefetch(self, j, kinds):
        for kind in kinds:
            self.run.store.prefetch((kind, self.layer, j))

    def add_grad(self, j, dk, dv):
        factor = self.run.relay_factor(j)
        if factor is None:  # chunk j is not backpropagated (SpaCO): its K/V gradient is dropped
            return
        if factor != 1.0:
            dk, dv = dk * factor, dv * factor
        self.run.store.add_(("dk", self.layer, j), dk)
        self.run.store.add_(("dv", self.layer, j), dv)

    def take_grad(self):
        store, key = self.run.store, (self.layer, self.index)
        if ("dk",) + key not in store:
            return None
        return store.pop(("dk",) + key), store.pop(("dv",) + key)


class ChunkedRun:
    """State of one chunked step: the store, the chunk bounds and where we are.

    Chunked attention drives :meth:`forward_layer_major` and :meth:`backward_layer_major`
    (FPDT's order); SeCO and SpaCO drive :meth:`forward_chunk_major` and
    :meth:`backward_chunk_major`.
    """

    def __init__(self, model, input_ids, attention_mask, labels, num_label_tokens, settings: PipelineSettings):
        self.base = unwrap(model)
        self.decoder = self.base.get_decoder()
        self.layers = decoder_layers(model)
        self.settings = settings
        self.input_ids = input_ids
        seq = input_ids.shape[1]
        self.bounds = [(a, min(a + settings.chunk, seq)) for a in range(0, seq, settings.chunk)]
        self.positions = torch.arange(seq, device=input_ids.device)[None]
        self.key_valid = key_valid_mask(attention_mask)
        self.targets = shift_labels(labels)
        self.num_label_tokens = num_label_tokens
        self.store = ChunkStore(input_ids.device, offload=settings.offload, host_budget=settings.host_budget,
                                pool=pool_for(model))
        self.index = 0  # chunk being computed
        # "forward": park K/V and attend; "kv": park K/V and stop the layer there (K/V
        # recomputation); "recompute": K/V already parked, attend with gradients.
        self.mode = "forward"
        self.selected: set[int] | None = None  # chunks backpropagated (None: all)
        self.hop_factor = 1.0  # multiplies K/V gradients relayed to earlier chunks
        self._layer_arguments: dict[int, tuple] = {}  # chunk -> (flattened layer kwargs, spec)
        head = self.base.get_output_embeddings()
        if type(head) is not nn.Linear:
            raise LongtrainError(f"chunked attention needs a plain linear LM head, found {type(head).__name__}")
        self.head = head
        self.softcap = getattr(self.base.config, "final_logit_softcapping", None)
        # The head runs each chunk whole, or in MsT's mini-sequences (its default: V/d).
        mst = getattr(model, "_longtrain_mst", None)
        self.loss_chunks = mst.loss_chunks if mst is not None and mst.head else 1

    # ---- called by the attention backend -----------------------------------------------
    def attend(self, module, q, k, v, *, scaling=None, sliding_window=None, softcap=None, **_):
        layer = module.layer_idx
        if self.mode != "recompute":
            self.store.put(("k", layer, self.index), k.detach())
            self.store.put(("v", layer, self.index), v.detach())
        if self.mode == "kv":
            raise _StopAfterKV
        start = self.bounds[self.index][0]
        first = 0
        if sliding_window is not None:  # chunks wholly outside the window are never fetched
            first = next(j for j, (_, end) in enumerate(self.bounds) if start - (end - 1) < sliding_window)
        history = _LayerHistory(self, layer, self.index, first)
        return attend_chunk(q, k, v, history, q_start=start, key_valid=self.key_valid,
                            window=sliding_window, scale=scaling, softcap=softcap)

    def relay_factor(self, j: int) -> float | None:
        """Factor for K/V gradients sent to earlier chunk ``j``; None: not sent."""
        if self.selected is not None and j not in self.selected:
            return None
        return self.hop_factor

    # ---- forward ---------------------------------------------------------------------
    def forward_chunk_major(self) -> torch.Tensor:
        """SeCO's pass 1: the whole decoder on each chunk in turn, without gradients,
        parking every layer's K/V; returns the summed loss."""
        total = None
        with chunked_run(self):
            for i, (a, b) in enumerate(self.bounds):
                self.index = i
                hidden = self.decoder(input_ids=self.input_ids[:, a:b], position_ids=self.positions[:, a:b],
                                      use_cache=False).last_hidden_state
                loss = self._chunk_loss(hidden, a, b)
                total = loss if total is None else total + loss
        return total

    def forward_layer_major(self) -> torch.Tensor:
        """FPDT's order: the decoder's preamble per chunk, then each layer over all chunks
        (parking its output chunks as the next layer's inputs), then the head. With
        ``recompute_kv`` only the current layer's K/V are parked at any time."""
        n, store, ahead = len(self.layers), self.store, self.settings.prefetch
        park_first = self._park_input(0)

        def stop(module, args, kwargs):
            park_first(module, args, kwargs)
            raise _StopPreamble()

        handle = self.layers[0].register_forward_pre_hook(stop, with_kwargs=True)
        try:
            with chunked_run(self):
                for i, (a, b) in enumerate(self.bounds):
                    self.index = i
                    try:
                        self.decoder(input_ids=self.input_ids[:, a:b], position_ids=self.positions[:, a:b], use_cache=False)
                    except _StopPreamble:
                        pass
                handle.remove()
                for layer in range(n):
                    for i in range(len(self.bounds)):
                        self.index = i
                        for j in range(i + 1, min(i + 1 + ahead, len(self.bounds))):
                            store.prefetch(("x", layer, j))
                        out = self.layers[layer](store.get(("x", layer, i)), **self._layer_kwargs(i))
                        out = out[0] if isinstance(out, tuple) else out
                        store.put(("x", layer + 1, i), out, offload=self._offload_inputs)
                    if self.settings.recompute_kv:
                        self._discard_kv(layer)
                total = None
                for i, (a, b) in enumerate(self.bounds):
                    loss = self._chunk_loss(self.decoder.norm(store.get(("x", n, i))), a, b)
                    total = loss if total is None else total + loss
        finally:
            handle.remove()
        return total

    def _discard_kv(self, layer):
        for i in range(len(self.bounds)):
            self.store.discard(("k", layer, i))
            self.store.discard(("v", layer, i))

    def _recompute_kv(self, layer):
        """Park layer ``layer``'s K/V for every chunk again, running the layer only up to
        its attention call (norm and K/V projections: ~10% of the layer's forward)."""
        self.mode = "kv"
        try:
            with torch.no_grad():
                for i in range(len(self.bounds)):
                    self.index = i
                    try:
                        self.layers[layer](self.store.get(("x", layer, i)), **self._layer_kwargs(i))
                    except _StopAfterKV:
                        pass
        finally:
            self.mode = "recompute"

    def _park_input(self, layer):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.store.put(("x", layer, self.index), hidden.detach(), offload=self._offload_inputs)
            if layer == 0:  # the layer arguments (rotary tables, positions) are shared by all layers
                rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                rest["attention_mask"] = None  # masks come from positions and key_valid
                leaves, spec = tree_flatten(rest)
                for n, leaf in enumerate(leaves):
                    if isinstance(leaf, torch.Tensor):
                        self.store.put(("kw", self.index, n), leaf.detach(), offload=self._offload_inputs)
                        leaves[n] = ("kw", self.index, n)
                self._layer_arguments[self.index] = (leaves, spec)
            return None

        return hook

    @property
    def _offload_inputs(self):
        return self.settings.offload_inputs

    def _layer_kwargs(self, i):
        leaves, spec = self._layer_arguments[i]
        leaves = [self.store.get(x) if isinstance(x, tuple) and x[:1] == ("kw",) else x for x in leaves]
        return tree_unflatten(leaves, spec)

    def _chunk_loss(self, hidden, a, b):
        return chunked_causal_lm_loss(
            hidden, self.head.weight, self.targets[:, a:b], bias=self.head.bias, shifted=True,
            num_label_tokens=self.num_label_tokens, chunks=self.loss_chunks, softcap=self.softcap,
        )

    # ---- backward --------------------------------------------------------------------
    def backward_chunk_major(self, grad_loss, own_factor: float = 1.0) -> None:
        """SeCO: chunks from the last, each recomputed through the whole model against the
        parked K/V of earlier chunks and backpropagated from its own loss (times
        ``own_factor``) plus the K/V gradients later chunks relayed to it. With
        ``selected`` set (SpaCO), only those chunks are recomputed."""
        store = self.store
        try:
            with chunked_run(self):
                self.mode = "recompute"
                for i in reversed(range(len(self.bounds))):
                    if self.selected is None or i in self.selected:
                        self.index = i
                        a, b = self.bounds[i]
                        hidden = self.decoder(input_ids=self.input_ids[:, a:b], position_ids=self.positions[:, a:b],
                                              use_cache=False).last_hidden_state
                        loss = self._chunk_loss(hidden, a, b)
                        # K/V gradients reach this chunk inside attend_chunk's backward (take_grad).
                        torch.autograd.backward(loss, grad_loss * own_factor)
                    for layer in range(len(self.layers)):
                        for kind in ("k", "v", "dk", "dv"):
                            store.discard((kind, layer, i))
        finally:
            store.clear()

    def backward_layer_major(self, grad_loss: torch.Tensor) -> None:
        store, n = self.store, len(self.layers)
        try:
            with chunked_run(self):
                self.mode = "recompute"
                # Head: gradient of each chunk's loss with respect to the last layer's output.
                for i, (a, b) in enumerate(self.bounds):
                    y = store.pop(("x", n, i)).detach().requires_grad_(True)
                    loss = self._chunk_loss(self.decoder.norm(y), a, b)
                    torch.autograd.backward(loss, grad_loss)
                    store.put(("dy", i), y.grad, offload=self._offload_inputs)
                # Layers from the top; in each, chunks from the last.
                for layer in reversed(range(n)):
                    if self.settings.recompute_kv:
                        self._recompute_kv(layer)
                    for i in reversed(range(len(self.bounds))):
                        self.index = i
                        if i > 0:
                            store.prefetch(("x", layer, i - 1))
                            store.prefetch(("dy", i - 1))
                        x = store.pop(("x", layer, i)).detach().requires_grad_(True)
                        out = self.layers[layer](x, **self._layer_kwargs(i))
                        out = out[0] if isinstance(out, tuple) else out
                        torch.autograd.backward(out, store.pop(("dy", i)))
                        store.put(("dy", i), x.grad, offload=self._offload_inputs)
                        store.discard(("k", layer, i))
                        store.discard(("v", layer, i))
                self._embedding_backward()
        finally:
            store.clear()

    def _embedding_backward(self):
        embeddings = self.base.get_input_embeddings()
        if not any(p.requires_grad for p in embeddings.parameters()):
            for i in range(len(self.bounds)):
                self.store.discard(("dy", i))
            return

        def stop(module, args, kwargs):
            raise _StopPreamble(args[0] if args else kwargs["hidden_states"])

        handle = self.layers[0].register_forward_pre_hook(stop, with_kwargs=True)
        try:
            for i, (a, b) in enumerate(self.bounds):
                try:
                    self.decoder(input_ids=self.input_ids[:, a:b], position_ids=self.positions[:, a:b], use_cache=False)
                except _StopPreamble as stopped:
                    torch.autograd.backward(stopped.hidden, self.store.pop(("dy", i)))
        finally:
            handle.remove()


def key_valid_mask(attention_mask):
    """The padding mask attention must apply, or None (the fast, unmasked kernels).

    None when nothing is padded, and also for right padding: under a causal mask a real
    token never sees a later position, so padding at the end cannot reach a real token's
    output (padded positions carry no loss, and still see their real predecessors, so no
    row is empty). Left padding sits before real tokens and is masked.
    """
    if attention_mask is None:
        return None
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(attention_mask):
        return attention_mask.bool()
    mask = attention_mask.bool()
    if bool((mask[:, 1:] <= mask[:, :-1]).all()) and bool(mask[:, 0].all()):  # real tokens, then padding
        return None
    return mask


def pool_for(model) -> PinnedPool:
    """One pinned pool per model, reused across steps (pinning is the expensive part)."""
    pool = getattr(model, "_longtrain_pinned_pool", None)
    if pool is None:
        pool = PinnedPool()
        object.__setattr__(model, "_longtrain_pinned_pool", pool)
    return pool


class _PipelineLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, run):
        ctx.run = run
        return run.forward_layer_major()

    @staticmethod
    def backward(ctx, grad_loss):
        with torch.enable_grad():
            ctx.run.backward_layer_major(grad_loss)
        ctx.run = None
        return None, None


def host_bytes_needed(config, batch: int, seq: int, dtype: torch.dtype, settings: PipelineSettings) -> int:
    """Host memory a step parks at its fullest (forward end): K/V of every layer and chunk
    (one layer's with ``recompute_kv``) with ``offload``; plus every layer's input (and the
    final layer's output) with ``offload_inputs``. Used to refuse a step that cannot fit
    before it starts."""
    item = torch.tensor([], dtype=dtype).element_size()
    n = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = 2 * batch * seq * getattr(config, "num_key_value_heads", heads) * head_dim * item
    inputs = (n + 1) * batch * seq * config.hidden_size * item
    kv_layers = 1 if settings.recompute_kv else n
    return kv_layers * kv * settings.offload + inputs * settings.offload_inputs


def pipelined_loss(model, input_ids, attention_mask, labels, num_label_tokens, settings: PipelineSettings):
    """The step's loss (sum of token losses / ``num_label_tokens``); its backward runs the
    reverse pipeline. Without gradients (evaluation) it is just the chunked forward."""
    if settings.host_budget is not None and (settings.offload or settings.offload_inputs):
        config = unwrap(model).config
        dtype = unwrap(model).get_input_embeddings().weight.dtype
        need = host_bytes_needed(config, input_ids.shape[0], input_ids.shape[1], dtype, settings)
        if need > settings.host_budget:
            raise LongtrainError(
                f"chunked attention needs {format_bytes(need)} of host memory for {input_ids.shape[1]:,} tokens "
                f"(batch {input_ids.shape[0]}), the host budget is {format_bytes(settings.host_budget)}; "
                "raise --host-memory, shorten the sequence, or turn off offload_inputs"
            )
    run = ChunkedRun(model, input_ids, attention_mask, labels, num_label_tokens, settings)
    if not torch.is_grad_enabled():
        loss = run.forward_layer_major()
        run.store.clear()
        return loss
    anchor = torch.empty(0, device=input_ids.device, requires_grad=True)
    return _PipelineLoss.apply(anchor, run)

