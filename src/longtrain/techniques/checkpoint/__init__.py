"""``checkpoint``: per-layer activation checkpointing (non-reentrant).

Each decoder block keeps only its input during the forward pass and recomputes its
internals in the backward pass. We patch the block's ``forward`` on the instance rather
than wrapping the module, so parameter names (and therefore checkpoints and LoRA
targets) are unchanged. Everything a block's attention needs arrives as an argument
(the engine's attention call), so the recomputation — which CUDA runs on autograd's
device thread — sees exactly what the forward saw.

Attention is not recomputed (``keep_attention``, on by default): the forward keeps each
layer's attention output and log-sum-exp — one hidden-state-sized tensor per layer, in
pinned host memory with ``offload`` — and the recomputation reads them back instead of
running attention's forward again; the previous layer's are fetched while this one's
backward runs. Attention is the one op of a layer whose cost grows with the sequence
squared, so this takes a quarter to a third of the step at 32K–128K tokens (the
forward, the recomputation and the backward's two passes become forward and backward).
Layers whose outputs would pass ``host_memory`` recompute as before; attention calls
that cannot give their output (chunked engines' calls) recompute too.

``offload_inputs`` parks each checkpointed layer's input in pinned host memory too (what
Hugging Face runs as ``save_on_cpu`` around checkpointing), fetched a layer ahead in
backward: device memory no longer grows by one hidden state per layer, which is what
lets whole-sequence checkpointing run where only chunked attention did (256K tokens of
Llama-3-8B on 80 GB). Inputs come first in the host budget — a layer needs its input
to recompute, its attention output only saves time — so outputs are kept while the
inputs of the layers still to run would fit beside them; an input past the budget
stays on the device.

``except_last`` leaves the top layers whole: not checkpointed, their MLP not tiled by MsT
(a tiled MLP recomputes its forward), nothing of theirs recomputed. Each costs one
layer's activations in device memory (at 16K tokens of Llama-3-8B about 3 GiB as the
simulator counts stock ops) and saves its recomputation. Where the device has room beside the
checkpointed inputs — short and medium contexts — that is the fastest exact schedule;
``longtrain plan`` (and ``--strategy auto``) sizes it by simulating the step. The top
layers rather than the bottom ones: their backward runs first, so their activations are
freed before any recomputation needs room (bottom layers' would sit under every one).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

import dataclasses

from ... import validate
from ...costs import StepWork, TechniqueCosts
from ...errors import LongtrainError
from ...memory.chunk_store import ChunkStore
from ...models.kept_attention import KeptOutputs, attend_keeping, kept_layers_that_fit
from ...memory.token_swap import storage_id
from ...models.attention import AttentionCall
from ...models.adapters import describe_model
from ...models.shapes import kept_output_bytes
from ...registry import TechniqueSpec, register


_PARKED = object()  # what a parked input's pack hook leaves in the graph (the store has the tensor)


@dataclass
class CheckpointOptions:
    """Knobs of layer checkpointing."""

    keep_attention: bool = True  # keep attention's output and LSE so the recomputation skips attention's forward
    offload: bool = True  # kept outputs wait in pinned host memory (false: on the device)
    host_memory: int | str | None = None  # budget for kept outputs on the host; default: the run's host memory (EngineContext)
    except_last: int = 0  # the top layers left whole: not checkpointed, MLP not tiled (device memory for speed)
    offload_inputs: bool = False  # park the checkpointed inputs in pinned host memory too (first in host_memory's budget)

    def __post_init__(self):
        validate.flag("checkpoint", "keep_attention", self.keep_attention)
        validate.flag("checkpoint", "offload_inputs", self.offload_inputs)
        validate.positive_int("checkpoint", "except_last", self.except_last, minimum=0)
        validate.flag("checkpoint", "offload", self.offload)
        if self.host_memory is not None:
            self.host_memory = validate.byte_size("checkpoint", "host_memory", self.host_memory)
            if self.host_memory <= 0:
                raise LongtrainError(f"checkpoint host_memory must be positive, got {self.host_memory!r}")

    def host_bytes_wanted(self, config, batch: int, tokens: int, item: int) -> int:
        """What the checkpointed layers of a step of ``batch`` × ``tokens`` tokens (``item``
        bytes per element) would put in host memory with no budget — each one's input
        (``offload_inputs``) and attention output + LSE (``keep_attention`` with ``offload``),
        at least what the step parks: where ``host_memory`` is this much or more it stops no layer."""
        shape = describe_model(config)
        layers = max(0, shape.layers - self.except_last)
        inputs = shape.layer_inputs_bytes(batch * tokens, item, layers) if self.offload_inputs else 0
        outputs = kept_output_bytes(config, batch, tokens, item) if self.keep_attention and self.offload else 0
        return inputs + layers * outputs


@dataclass
class _LayerSlot:
    """One checkpointed layer's place in a step: its key in the store, its index (1: the
    bottom layer), its parked input's size (each layer above will park as much) and the
    layer below that parked its input (whose input backward fetches next)."""

    key: int
    index: int
    input_bytes: int = 0
    below: "_LayerSlot | None" = None


class KeptAttention:
    """Every checkpointed layer's kept attention output and LSE (``keep_attention``) and
    parked input (``offload_inputs``) for one model, in one store.

    Entries belong to one step and stay until the next step's first layer drops them
    (also when that step's backward never ran). A step is one attention call (the
    engine's, shared by its layers) or, in a model without attention, one pass from its
    bottom checkpointed layer up. The outputs are kept and served by
    :class:`~longtrain.models.kept_attention.KeptOutputs` (:attr:`outputs`, in
    :attr:`store`) and budgeted by :func:`~longtrain.models.kept_attention.kept_layers_that_fit`,
    as Memo's and FPDT's are; this class decides only which layers keep theirs."""

    def __init__(self, options: CheckpointOptions, context, layers: int):
        self.options, self.context, self.pool, self.layers = options, context, context.pool, layers
        self.store: ChunkStore | None = None
        self.outputs = KeptOutputs(self._store)  # the kept outputs and LSEs, by layer, in ``store``
        self._step: object | None = None  # the attention call (or a marker of the pass) the entries belong to
        self._last: _KeepingAttention | None = None  # the latest layer of that step that kept its output
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
        return self.context.host_memory if self.context.host_memory is not None else float("inf")

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
            return _PARKED

        def unpack(packed):
            if packed is not _PARKED:
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

    def kept(self, call: "_KeepingAttention") -> None:
        """``call`` kept its output (in :attr:`outputs`): its replay fetches the one below's."""
        call.previous, self._last = self._last, call


class _KeepingAttention(AttentionCall):
    """One checkpointed layer's attention. Its first call (the forward) computes the
    output and LSE once and keeps them; its second (the recomputation in backward)
    returns the kept ones as the same autograd node, so the saved tensors match."""

    def __init__(self, inner: AttentionCall, kept: KeptAttention, slot: _LayerSlot):
        self.inner, self.kept, self.slot, self.key, self.mask = inner, kept, slot, slot.key, inner.mask
        self.rows = inner.rows
        self.backward = None  # the kernels' backward; None: this layer recomputes attention
        self.previous: _KeepingAttention | None = None  # the layer below, whose replay comes next
        self._calls = 0

    def attend(self, module, q, k, v, *, scale, window, softcap):
        self._calls += 1
        settings = dict(scale=scale, window=window, softcap=softcap)
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
        return self.kept.outputs.serve(self.key, q, k, v, self.backward, prefetch=None if below is None else below.key)

    def attend_keeping_output(self, module, q, k, v, *, scale, window, softcap):
        raise NotImplementedError


def _checkpointed_forward(forward, kept: KeptAttention | None, bottom: bool, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation, or a chunked engine's no-grad pass: nothing to save
        return forward(*args, **kwargs)
    call = kwargs.get("attention_mask")
    parking = contextlib.nullcontext()
    if kept is not None:
        attention = call if isinstance(call, AttentionCall) else None  # None: a model without attention
        slot = kept.layer_slot(attention, bottom)
        if attention is not None:
            kwargs = {**kwargs, "attention_mask": _KeepingAttention(attention, kept, slot)}
        if kept.options.offload_inputs:
            if not args:  # checkpointing saves positional tensors only; decoder layers take hidden_states first
                args = (kwargs.pop("hidden_states"),)
            parking = kept.parking_input(slot, args[0])
    # Non-reentrant: works with keyword arguments, frozen inputs (LoRA) and nested
    # autograd, and lets the recomputation stop early once the saved tensors exist. Its
    # inputs are saved outside its own hooks, so ``parking``'s hooks see them.
    with parking:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def whole_layers(strategy, layers: int) -> range:
    """Indices of the layers ``strategy``'s checkpointing leaves whole (``except_last``): no
    recomputation there, so MsT leaves their MLP untiled too."""
    options = strategy.techniques.get("checkpoint")
    keep = min(options.except_last, layers) if options is not None else 0
    return range(layers - keep, layers)


def kept_output_share(config, tokens: int, checkpoint) -> float:
    """The share of checkpointed layers whose attention output is kept (their recomputation
    skips attention's forward): all of them on the device; in host memory, as many as
    ``host_memory`` holds beside the parked inputs (``offload_inputs``), which come first —
    a budget not given is not this machine's default but unknown, taken as enough (a plan
    always gives one). ``tokens``: of the whole batch; activations in bf16."""
    if checkpoint is None or not checkpoint.keep_attention:
        return 0.0
    if not checkpoint.offload or checkpoint.host_memory is None:
        return 1.0
    layers = describe_model(config).layers - min(checkpoint.except_last, describe_model(config).layers)
    if layers <= 0:
        return 1.0
    item = 2
    output = tokens * (describe_model(config).attention_width * item + describe_model(config).heads * 4)  # and its float32 LSE
    inputs = describe_model(config).layer_inputs_bytes(tokens, item, layers) if checkpoint.offload_inputs else 0
    return kept_layers_that_fit(layers, checkpoint.host_memory, inputs, output) / layers


class CheckpointCosts(TechniqueCosts):
    """Checkpointing: every layer's input parked (in host memory with ``offload_inputs``,
    first in the host budget), each layer's forward once more in backward, attention's
    skipped where its output is kept; ``except_last`` top layers left whole."""

    def layers_apart_at_top(self, options: CheckpointOptions) -> int:
        return options.except_last

    def small_options(self, options: CheckpointOptions, layers: int, full: int):
        # Fewer layers than the whole model are simulated only where the budget stops none.
        return dataclasses.replace(options, host_memory=None) if layers < full else options

    def parked(self, config, seq_len, options: CheckpointOptions, item, batch, engine_offloads):
        inputs = describe_model(config).layer_inputs_bytes(batch * seq_len, item)
        if options.offload_inputs:
            on_host = inputs if options.host_memory is None else min(inputs, options.host_memory)
            return inputs - on_host, on_host
        return (0, inputs) if engine_offloads else (inputs, 0)

    def with_host_budget(self, options: CheckpointOptions, room: int):
        return options if options.host_memory is None else dataclasses.replace(options, host_memory=max(1, room))

    def candidates(self, host_memory):
        budget = {"host_memory": host_memory} if host_memory else {}
        # Kept attention outputs wait in host memory within the budget; with offload_inputs the
        # checkpointed inputs too, first (whole-sequence layers past where their inputs fit the device).
        return {"checkpoint": budget or True, "checkpoint:offload_inputs": {"offload_inputs": True, **budget}}

    def with_whole_layers(self, name, options: CheckpointOptions, count):
        return dataclasses.replace(options, except_last=count), f"{name}:except_last={count}"

    def describe(self, work: StepWork, options: CheckpointOptions) -> None:
        n = work.layers
        work.recomputes_layers = True
        work.mlp_forward_charged = True
        # Layers left whole (except_last) recompute nothing, their MLP untiled.
        work.recomputed = 1.0 - (min(options.except_last, n) / n if n else 0.0)
        work.kept_attention = 0.0 if work.chunk else kept_output_share(work.config, work.tokens * work.batch, options)


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
    kept = KeptAttention(options, context, len(checkpointed)) if keeps else None
    for index, layer in enumerate(checkpointed):
        layer.forward = functools.partial(_checkpointed_forward, layer.forward, kept, index == 0)


register(TechniqueSpec("checkpoint", CheckpointOptions, install_checkpoint, "per-layer activation checkpointing (attention kept, not recomputed)",
                    costs=CheckpointCosts()))
