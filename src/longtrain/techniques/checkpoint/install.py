"""What ``checkpoint`` runs: each checkpointed layer's ``forward`` patched to run under
non-reentrant checkpointing, its attention call recording the output in the forward and
replaying it in the recomputation, its input parked in host memory with ``offload_inputs``.

Shapes: B batch rows, S tokens, d hidden size; a layer's input (B, S, d); attention's
output and LSE as :mod:`longtrain.models.kept_attention` keeps them (q's size and
(B, H, S) float32).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ...errors import LongtrainError
from ...memory.chunk_store import ChunkStore
from ...memory.token_swap import storage_id
from ...models.attention import AttentionCall
from ...models.kept_attention import KeptOutputStore, attend_keeping, kept_layers_that_fit
from .options import CheckpointOptions

_INPUT_IN_STORE = object()  # what a parked input's pack hook leaves in the graph (the store has the tensor)


@dataclass
class _LayerSlot:
    """One checkpointed layer's place in a step: its key in the store, its index (1: the
    bottom layer), its parked input's size (each layer above will park as much) and the
    layer below that parked its input (whose input backward fetches next)."""

    key: int
    index: int
    input_bytes: int = 0
    below: "_LayerSlot | None" = None


class CheckpointLayers:
    """Checkpointing's state for one model: a slot per checkpointed layer and step
    (:meth:`layer_slot`), and every checkpointed layer's kept attention output and LSE
    (``keep_attention``) and parked input (``offload_inputs``), in one store.

    Entries belong to one step and stay until the next step's first layer drops them
    (also when that step's backward never ran). A step is one attention call (the
    engine's, shared by its layers) or, in a model without attention, one pass from its
    bottom checkpointed layer up. The outputs are kept and served by
    :class:`~longtrain.models.kept_attention.KeptOutputStore` (:attr:`outputs`, in
    :attr:`store`) and budgeted by :func:`~longtrain.models.kept_attention.kept_layers_that_fit`,
    as Memo's and FPDT's are; this class decides only which layers keep theirs."""

    def __init__(self, options: CheckpointOptions, context, layers: int):
        self.options, self.context, self.pool, self.layers = options, context, context.pool, layers
        self.store: ChunkStore | None = None
        self.outputs = KeptOutputStore(self._store)  # the kept outputs and LSEs, by layer, in ``store``
        self._step: object | None = None  # the attention call (or a marker of the pass) the entries belong to
        self._last: _CheckpointedAttention | None = None  # the latest layer of that step that kept its output
        self._last_input: _LayerSlot | None = None  # ... and that parked its input
        self._count = 0
        self._index = 0  # checkpointed layers of this step so far

    def layer_slot(self, call: AttentionCall | None, bottom: bool) -> _LayerSlot:
        """A fresh slot for one layer's checkpointed forward and its replay. A new step
        starts where the attention call changes or, without one, at the bottom layer."""
        if (self._step is not call) if call is not None else bottom:
            if self.store is not None:
                self.store.clear()
            self._step, self._last, self._last_input, self._index = call or object(), None, None, 0
        self._count += 1
        self._index += 1
        return _LayerSlot(self._count, self._index)

    def _store(self, device: torch.device) -> ChunkStore:
        if self.store is None or self.store.device != device:
            if self.store is not None:
                self.store.clear()  # its entries' buffers go back in stream order
            self.store = ChunkStore(device, offload=self.options.offload, pool=self.pool)
        return self.store

    def _host_used(self) -> int:
        return self.store.host_bytes if self.store is not None else 0

    @property
    def budget(self) -> float:
        """``host_memory``, else the run's host memory (:attr:`EngineContext.host_memory`:
        this machine's for a real run, the simulated machine's in a simulation, read when
        the step runs); unbounded where that is None."""
        if self.options.host_memory is not None:
            return self.options.host_memory
        room = self.context.host_room()
        return room if room is not None else float("inf")

    def has_room(self, slot: _LayerSlot, q: torch.Tensor) -> bool:
        """Whether this layer keeps its output: with ``keep_attention``, whether the output
        (q's size) and the float32 LSE fit the host budget beside the inputs the layers
        above will park (``offload_inputs``: inputs come first). Asked before attention
        runs, so a layer past it computes attention once, the plain way."""
        if not self.options.keep_attention:
            return False
        if not self.options.offload:
            return True
        inputs_above = (self.layers - slot.index) * slot.input_bytes if self.options.offload_inputs else 0
        return kept_layers_that_fit(1, self.budget, self._host_used() + inputs_above, q.nbytes + q[..., 0].numel() * 4) == 1

    def parking_input(self, slot: _LayerSlot, hidden: torch.Tensor):
        """Saved-tensor hooks for one layer's checkpoint call: its input (what checkpointing
        saves to recompute from) goes to pinned host memory, within the budget, and comes
        back when backward recomputes the layer, the layer below's copy started then."""
        # The hooks live as long as the graph: they hold the input's identity, not the input.
        identity, shape = storage_id(hidden), hidden.shape
        slot.input_bytes = hidden.nbytes
        key = (slot.key, "input")

        def pack(tensor):
            if storage_id(tensor) != identity or tensor.shape != shape:
                return tensor  # not the hidden state (the checkpoint's own marker, an attention mask)
            if self._host_used() + tensor.nbytes > self.budget:
                return tensor  # past the budget: this input stays on the device
            self._store(tensor.device).put(key, tensor.detach(), offload=True)
            slot.below, self._last_input = self._last_input, slot
            return _INPUT_IN_STORE

        def unpack(packed):
            if packed is not _INPUT_IN_STORE:
                return packed
            store = self.store
            if store is None or key not in store:
                raise LongtrainError(
                    "checkpoint:offload_inputs parks the layer inputs of one forward at a time, and a later forward "
                    "dropped these before their backward ran; run each forward's backward before the next forward "
                    "(as gradient accumulation does), or drop offload_inputs")
            tensor = store.get(key)
            if slot.below is not None:  # its recomputation comes after this layer's backward
                store.prefetch((slot.below.key, "input"))
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def kept(self, call: "_CheckpointedAttention") -> None:
        """``call`` kept its output (in :attr:`outputs`): its replay fetches the one below's."""
        call.previous, self._last = self._last, call


class _CheckpointedAttention(AttentionCall):
    """One checkpointed layer's attention. Its first call (the forward) computes the
    output and LSE once and keeps them; its second (the recomputation in backward)
    returns the kept ones as the same autograd node, so the saved tensors match."""

    def __init__(self, inner: AttentionCall, kept: CheckpointLayers, slot: _LayerSlot):
        self.inner, self.kept, self.slot, self.key, self.mask = inner, kept, slot, slot.key, inner.mask
        self.rows = inner.rows
        self.backward = None  # the kernels' backward; None: this layer recomputes attention
        self.previous: _CheckpointedAttention | None = None  # the layer below, whose replay comes next
        self._calls = 0

    def attend(self, module, q, k, v, *, scale, window, softcap, sink=None):
        self._calls += 1
        settings = dict(scale=scale, window=window, softcap=softcap, sink=sink)
        if self._calls == 1:
            if not self.kept.has_room(self.slot, q):  # not kept (past the host budget): this layer recomputes attention
                return self.inner.attend(module, q, k, v, **settings)
            try:
                out, self.backward = attend_keeping(self.inner, module, q, k, v, **settings, kept=self.kept.outputs,
                                                    key=self.key)
            except NotImplementedError:  # a chunked engine's call: recompute as plain checkpointing does
                return self.inner.attend(module, q, k, v, **settings)
            self.kept.kept(self)
            return out
        if self.backward is None:
            return self.inner.attend(module, q, k, v, **settings)
        # Read, not popped: a second backward through the graph (retain_graph) replays again.
        # The entries go when the next step's first layer runs. The layer below's replay
        # comes after this layer's backward: its copies start now.
        below = self.previous
        return self.kept.outputs.serve(self.key, q, k, v, self.backward, prefetch=None if below is None else below.key,
                                       sink=sink)

    def attend_keeping_output(self, module, q, k, v, *, scale, window, softcap, sink=None):
        raise NotImplementedError


def _checkpointed_forward(forward, kept: CheckpointLayers | None, bottom: bool, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation, or a chunked engine's no-grad pass: nothing to save
        return forward(*args, **kwargs)
    call = kwargs.get("attention_mask")
    parking = contextlib.nullcontext()
    if kept is not None:
        attention = call if isinstance(call, AttentionCall) else None  # None: a model without attention
        slot = kept.layer_slot(attention, bottom)
        if attention is not None:
            kwargs = {**kwargs, "attention_mask": _CheckpointedAttention(attention, kept, slot)}
        if kept.options.offload_inputs:
            if not args:  # checkpointing saves positional tensors only; decoder layers take hidden_states first
                args = (kwargs.pop("hidden_states"),)
            parking = kept.parking_input(slot, args[0])
    # Non-reentrant: works with keyword arguments, frozen inputs (LoRA) and nested
    # autograd, and lets the recomputation stop early once the saved tensors exist. Its
    # inputs are saved outside its own hooks, so ``parking``'s hooks see them.
    with parking:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def install_checkpoint(context, options: CheckpointOptions) -> None:
    layers = context.adapter.layers
    if options.except_last > len(layers):
        raise LongtrainError(f"checkpoint except_last={options.except_last} leaves more layers whole than the model has "
                             f"({len(layers)}); use at most {len(layers)}")
    if options.offload_inputs and context.strategy.engine != "backprop":
        raise LongtrainError(f"checkpoint offload_inputs parks whole-sequence layer inputs; the {context.strategy.engine} "
                             f"engine parks its chunks itself: drop offload_inputs and set the engine's offload=true")
    checkpointed = layers[:len(layers) - options.except_last]
    keeps = (options.keep_attention and context.adapter.has_attention) or options.offload_inputs
    kept = CheckpointLayers(options, context, len(checkpointed)) if keeps else None
    for index, layer in enumerate(checkpointed):
        layer.forward = functools.partial(_checkpointed_forward, layer.forward, kept, index == 0)
