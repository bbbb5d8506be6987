"""The state of one chunked step, shared by the ``fpdt``, ``seco`` and ``spaco`` engines.

A :class:`ChunkedRun` cuts a batch's sequence into chunks and keeps what outlives a
chunk in a :class:`~longtrain.memory.chunk_store.ChunkStore` (on the device, or parked
in host memory and prefetched): every layer's K/V per chunk, their gradient
accumulators and, for FPDT's layer-major order, the layer inputs. The engines decide
the order of work (:mod:`..fpdt`: layer by layer; :mod:`..seco`: chunk by chunk); the
run gives them the pieces:

- :meth:`ChunkedRun.call` — the :class:`ChunkAttention` a layer receives in place of
  its attention mask. In ``"forward"`` mode attention parks the chunk's K/V and attends
  over the parked K/V of earlier chunks, one at a time
  (:func:`~longtrain.ops.chunked_attention.attend_chunk`); in ``"recompute"`` mode
  (backward) the K/V are already parked; in ``"kv"`` mode attention only parks them
  (K/V recomputation).
- :meth:`ChunkedRun.position_embeddings` — the rotary tables of chunk i, computed once
  for the whole sequence (dynamic-NTK and longrope tables depend on its length).
- :meth:`ChunkedRun.chunk_loss` — the head and loss of one chunk.
- :meth:`ChunkedRun.record_draws` / :meth:`ChunkedRun.replay_draws` — a region's (a
  layer's chunk, a chunk's pass through the model) generator states, taken before its
  forward and set again around each recomputation, so that dropout draws the same masks
  (:mod:`~longtrain.ops.replay`).

Everything a layer's attention needs travels in the call object, so a checkpointed
layer recomputes with the same call, on whichever thread autograd runs the backward.
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...errors import LongtrainError
from ...memory.chunk_store import ChunkStore
from ...memory.tracker import mark_repeat
from ...memory.units import format_bytes, pinned_host_budget
from ...models.adapters import describe_model
from ...models.attention import AttentionCall, KeysParked
from ...models.kept_attention import KeptOutputStore
from ...ops.attention_sinks import add_sink
from ...ops.chunked_attention import attend_chunk, attend_chunk_forward, chunk_backward, chunk_bounds
from ...ops.chunked_loss import GradientCarry
from ...ops.masking import BlockPlanner
from ...ops.replay import RegionStates
from ..base import EngineContext, HeadLossCall
from ..batch import Shard
from ..gradient_sum import Float32GradientSum
from .costs import outputs_that_fit, parked_host_bytes
from .settings import ChunkSettings

_ROTARY_IN_STORE = object()  # marks a rotary table whose chunks live in the store


class ChunkAttention(AttentionCall):
    """Attention of chunk ``index`` of ``run`` in ``mode`` ("forward", "recompute", "kv")."""

    def __init__(self, run: "ChunkedRun", index: int, mode: str):
        self.run, self.index, self.mode = run, index, mode
        self.mask = run.shard.mask
        if run.shard.rows is not None:
            a, b = run.bounds[index]
            self.rows = run.shard.rows[:, a:b]

    def attend(self, module, q, k, v, *, scale, window, softcap, sink=None):
        return self.run.attend(self.index, self.mode, module, q, k, v, scale=scale, window=window, softcap=softcap,
                               sink=sink)


class _LayerHistory:
    """One layer's earlier K/V chunks for :func:`attend_chunk`, read from the store."""

    def __init__(self, run: "ChunkedRun", layer: int, index: int, first: int):
        self.run, self.layer, self.index, self.first = run, layer, index, first

    def blocks(self, backward: bool = False):
        store, ahead = self.run.store, self.run.settings.prefetch
        # In backward the gradient accumulators travel with the K/V they belong to.
        kinds = ("k", "v", "dk", "dv") if backward else ("k", "v")
        indices = range(self.first, self.index)
        for n in range(min(ahead, len(indices))):
            self._prefetch(indices[n], kinds)
        for n, j in enumerate(indices):
            mark_repeat("attention block")  # (for the simulator: this loop's length grows with the sequence)
            if n + ahead < len(indices):
                self._prefetch(indices[n + ahead], kinds)
            yield j, store.get(("k", self.layer, j)), store.get(("v", self.layer, j))

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
        if self.run.settings.prefetch:
            # Chunk-major engines (SeCO) take the layer below's sum next, complete by now; in
            # layer-major FPDT that entry does not exist yet (its schedule prefetches its own).
            store.prefetch(("dk", self.layer - 1, self.index))
            store.prefetch(("dv", self.layer - 1, self.index))
        if ("dk",) + key not in store:
            return None
        return store.pop(("dk",) + key), store.pop(("dv",) + key)


class ChunkedRun:
    """One chunked step over this rank's ``shard``: chunk bounds, the store, rotary tables,
    the head. Under sequence parallelism local chunk i meets the other ranks' chunk i in
    attention, which sees the gathered chunk ``shard.attention_bounds[i]``."""

    def __init__(self, context: EngineContext, shard: Shard, settings: ChunkSettings):
        _refuse_neftune(context)
        self.context = context
        self.adapter = context.adapter
        self.layers = self.adapter.layers
        self.shard = shard
        self.settings = settings
        self.bounds = chunk_bounds(shard.length, settings.chunk)
        self.planner = BlockPlanner(shard.mask, shard.attention_bounds or self.bounds)
        self.head_loss: HeadLossCall = context.head_loss(per_chunk=True)
        self.store = ChunkStore(shard.input_ids.device, offload=settings.offload, host_budget=settings.host_budget,
                                pool=context.pool)
        self.selected: set[int] | None = None  # chunks backpropagated (None: all)
        self.hop_factor = 1.0  # multiplies K/V gradients relayed to earlier chunks
        self._rotary = None  # (leaves, spec) of the whole sequence's rotary tables (_ROTARY_IN_STORE: in the store)
        self._draws = RegionStates()  # generator states before each region's forward
        # The lowest this-many layers park their attention output (keep_output, resolved for this shard).
        self.kept_outputs = kept_output_layers(context, shard, settings)
        # Their outputs and LSEs by (layer, chunk), parked with the layer inputs.
        self.outputs = KeptOutputStore(self.store, offload=settings.offload_inputs)
        if settings.keep_output is not False:  # what "fit" (or a count) came to, for the run's summary
            context.notes["kept_attention_outputs"] = self.kept_outputs

    # ---- pieces of the forward -----------------------------------------------------------
    def record_draws(self, key) -> None:
        """Region ``key``'s forward starts now: keep the generator states it draws from."""
        self._draws.record(key, self.shard.input_ids)

    def replay_draws(self, key):
        """A block that recomputes region ``key``: it draws what the region's forward drew."""
        return self._draws.replay(key)

    def call(self, index: int, mode: str):
        mark_repeat("chunk")
        return self.context.attention(ChunkAttention(self, index, mode))

    def input_ids(self, i: int) -> torch.Tensor:
        a, b = self.bounds[i]
        return self.shard.input_ids[:, a:b]

    def position_embeddings(self, i: int):
        """Chunk ``i``'s rotary tables: slices of the whole sequence's, computed once."""
        leaves, spec = self._rotary_tables()
        a, b = self.bounds[i]
        chunk = []
        for n, leaf in enumerate(leaves):
            if leaf is _ROTARY_IN_STORE:
                chunk.append(self.store.get(("rotary", i, n)))
            else:
                chunk.append(leaf[:, a:b] if isinstance(leaf, torch.Tensor) else leaf)
        return tree_unflatten(chunk, spec)

    def prefetch_inputs(self, layer: int, i: int) -> None:
        """Start bringing what :meth:`run_layer` reads for chunk ``i`` of ``layer`` to the
        device: its parked input and rotary tables (a fetch started only when they are read
        would put the copy on the critical path)."""
        if not 0 <= i < len(self.bounds) or not self.settings.prefetch:
            return
        if layer > 0:
            self.store.prefetch(("x", layer, i))
        for n, leaf in enumerate(self._rotary_tables()[0]):
            if leaf is _ROTARY_IN_STORE:
                self.store.prefetch(("rotary", i, n))

    def _rotary_tables(self):
        """(leaves, spec) of the whole sequence's rotary tables, computed on first use."""
        if self._rotary is None:
            self._rotary = self._compute_rotary()
        return self._rotary

    def _compute_rotary(self):
        # The tables' dtype and device follow the embeddings' output, as in the model's forward.
        with torch.no_grad():
            probe = self.adapter.embed(self.shard.input_ids[:, :0])
            leaves, spec = tree_flatten(self.context.rotary_tables(self.shard, probe))
        if self.settings.offload_inputs:  # each chunk's slice goes to host memory, the whole tables go
            for n, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    for i, (a, b) in enumerate(self.bounds):
                        self.store.put(("rotary", i, n), leaf[:, a:b], offload=True)
                    leaves[n] = _ROTARY_IN_STORE
        return leaves, spec

    def run_layer(self, index: int, hidden: torch.Tensor, i: int, mode: str) -> torch.Tensor:
        return self.adapter.run_layer(self.layers[index], hidden, self.position_embeddings(i), self.call(i, mode))

    def head_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the head's backward reaches, for a :meth:`gradient_sum`: the final
        norm's, and the LM head's unless the fused op sums them itself (:meth:`head_carry`)."""
        fused = self.head_loss.fused
        return [*self.adapter.norm().parameters(), *(() if fused else self.context.lm_head_module.parameters())]

    def head_carry(self) -> GradientCarry | None:
        """Where the settings ask for float32 sums over more than one chunk and the head is
        the fused op: one carry for the step's head calls, which sum the weight's gradient
        in the op's own float32 buffer and hand it to autograd once, at the last chunk."""
        if self.head_loss.fused and self.settings.float32_grad_sum and len(self.bounds) > 1:
            return GradientCarry()
        return None

    def gradient_sum(self, params) -> Float32GradientSum:
        """A float32 sum of ``params``' gradients over this step's chunks, where the settings
        ask for it and there is more than one chunk (:mod:`..gradient_sum`)."""
        return Float32GradientSum(params, enabled=self.settings.float32_grad_sum and len(self.bounds) > 1)

    def chunk_loss(self, hidden: torch.Tensor, i: int, carry: GradientCarry | None = None) -> torch.Tensor:
        mark_repeat("head chunk")
        a, b = self.bounds[i]
        return self.head_loss(hidden, self.shard.targets[:, a:b], self.shard.num_label_tokens, carry)

    # ---- called by the attention backend ---------------------------------------------------
    def attend(self, index, mode, module, q, k, v, *, scale, window, softcap, sink=None):
        layer = module.layer_idx
        if mode != "recompute":
            self.store.put(("k", layer, index), k.detach())
            self.store.put(("v", layer, index), v.detach())
        if mode == "kv":
            raise KeysParked  # only the K/V were wanted: no attention, no output projection
        first = 0
        if window is not None:  # chunks wholly outside the window are never fetched
            bounds = self.planner.bounds
            first = next(j for j, (_, end) in enumerate(bounds) if bounds[index][0] - (end - 1) < window)
        history = _LayerHistory(self, layer, index, first)
        keep = layer < self.kept_outputs  # kept and served by the mechanism checkpoint and memo share (self.outputs)
        if keep and mode == "forward":  # (a no-grad pass) keep what the recompute would redo
            out, lse = attend_chunk_forward(q, k, v, history, self.planner, index, window, scale, softcap)
            return self.outputs.keep((layer, index), *((out, lse) if sink is None else add_sink(out, lse, sink)))[0]
        if keep and mode == "recompute":
            backward = functools.partial(chunk_backward, history, self.planner, index, window, scale, softcap)
            return self.outputs.serve((layer, index), q, k, v, backward, pop=True, sink=sink)
        return attend_chunk(q, k, v, history, planner=self.planner, index=index, window=window, scale=scale,
                            softcap=softcap, sink=sink)

    def relay_factor(self, j: int) -> float | None:
        """Factor for K/V gradients sent to earlier chunk ``j``; None: not sent."""
        if self.selected is not None and j not in self.selected:
            return None
        return self.hop_factor

    def discard_kv(self, layer: int, i: int) -> None:
        for kind in ("k", "v", "dk", "dv"):
            self.store.discard((kind, layer, i))


def host_bytes_needed(context: EngineContext, shard: Shard, settings: ChunkSettings, dtype: torch.dtype,
                      kept_outputs: int | None = None) -> int:
    """Host memory a chunked step parks at its fullest on this rank (an upper bound): K/V of
    every layer and chunk (one layer's with ``recompute_kv``) and one layer's K/V-gradient
    sums (every layer's in a ``chunk_major`` schedule) with ``offload``; plus the inputs of every
    layer but the first, the gradient of the last one's output, the rotary tables and the
    attention outputs of ``kept_outputs`` layers (default: as ``keep_output`` resolves) with
    ``offload_inputs``. Under sequence parallelism K/V are the whole sequence's for this
    rank's heads."""
    kv_heads = kv_length = None
    sp = context.sequence_parallel
    if sp is not None:  # the whole (padded) sequence, this rank's K/V heads (repeated where they do not group evenly)
        kv_heads = len(sp.kv_index) if sp.kv_index is not None else len(sp.heads.kv_heads_of(sp.rank))
        kv_length = shard.rotary_positions.shape[1]
    if kept_outputs is None:
        kept_outputs = kept_output_layers(context, shard, settings)
    batch, length = shard.input_ids.shape
    return parked_host_bytes(context.adapter.config, batch, length, torch.tensor([], dtype=dtype).element_size(), settings,
                             kept_outputs, kv_heads=kv_heads, kv_length=kv_length,
                             position_rows=shard.position_ids.shape[0])


def kept_output_layers(context: EngineContext, shard: Shard, settings: ChunkSettings) -> int:
    """``settings.keep_output`` resolved for ``shard``, ``"fit"`` against the host budget."""
    dtype = context.adapter.base.get_input_embeddings().weight.dtype
    return outputs_that_fit(settings.keep_output, describe_model(context.adapter.config).layers, settings.offload_inputs,
                            host_budget(context, shard, settings)[0],
                            lambda kept: host_bytes_needed(context, shard, settings, dtype, kept_outputs=kept))


def host_budget(context: EngineContext, shard: Shard, settings: ChunkSettings) -> tuple[int | None, bool]:
    """(the host budget in bytes, whether it is the default): ``host_budget`` where given;
    in a simulation (fake tensors) the simulated machine's host memory
    (:attr:`EngineContext.host_memory`; None, unbounded, where none was named); on CUDA half
    the physical memory, as for every pinned budget
    (:func:`~longtrain.memory.units.pinned_host_budget`); CPU runs (nothing pinned) are unbounded.
    What a technique holds there for the whole run (streamed weights) comes off the default."""
    if settings.host_budget is not None:
        return settings.host_budget, False
    if is_fake(shard.input_ids):
        return context.host_room(), False
    if shard.input_ids.device.type != "cuda":
        return None, False
    return max(0, pinned_host_budget() - context.host_held), True


def check_host_budget(context: EngineContext, shard: Shard, settings: ChunkSettings) -> None:
    """Refuse a step whose parked chunks cannot fit the host budget (:func:`host_budget`),
    before any work. Parked chunks are page-locked, and past the budget the kernel's
    out-of-memory killer could end the run without a word."""
    if not (settings.offload or settings.offload_inputs):
        return
    budget, default = host_budget(context, shard, settings)
    if budget is None:
        return
    dtype = context.adapter.base.get_input_embeddings().weight.dtype
    need = host_bytes_needed(context, shard, settings, dtype)
    engine = context.strategy.engine
    if need > budget:
        which = " (half the physical memory, the default)" if default else ""
        if default and context.host_held:
            which = f" (half the physical memory less {format_bytes(context.host_held)} of streamed weights, the default)"
        raise LongtrainError(
            f"the {engine} engine needs {format_bytes(need)} of host memory for {shard.rotary_positions.shape[1]:,} tokens "
            f"(batch {shard.input_ids.shape[0]}), the host budget is {format_bytes(budget)}{which}; "
            f"raise it ({engine}:host_memory=...), shorten the sequence, or offload less"
        )


def _refuse_neftune(context: EngineContext) -> None:
    """NEFTune (a Trainer's ``neftune_noise_alpha``, set on the embedding module when training
    starts) scales its noise by the length of the sequence the embedding sees: a chunk's here."""
    if getattr(context.adapter.embeddings(), "neftune_noise_alpha", None):
        raise LongtrainError(f"NEFTune (neftune_noise_alpha) scales its noise by the whole sequence's length, and the "
                             f"{context.strategy.engine} engine embeds chunk by chunk; train with backprop (checkpoint, "
                             "mst, memo) or set neftune_noise_alpha=None")


def check_chunkable(context: EngineContext) -> None:
    """Chunked engines recompute layers and need attention to chunk: refuse other models."""
    adapter = context.adapter
    if not adapter.has_attention:
        raise LongtrainError(f"the {context.strategy.engine} engine chunks attention; {adapter.config.model_type} models have none "
                             "(use --engine backprop, or adjoint for SSM-ResNet)")
