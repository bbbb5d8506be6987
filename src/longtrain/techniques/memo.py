"""``memo``: token-wise activation swapping and recomputation (the Memo paper, §4.1).

Each decoder layer keeps its input and its attention output (and the attention's
log-sum-exp) in host memory; of every other tensor it saves for backward, a fraction
``alpha`` of the tokens goes to host memory too and the rest is recomputed in backward
— by running the layer on those tokens alone with the kept attention output standing
in for attention (:mod:`longtrain.memory.token_swap`). So attention runs once per layer
forward whatever ``alpha`` is, and with ``alpha = 1`` no layer op runs twice. The last
``keep_last`` layers keep what they save on the device: their backward starts at once.

``alpha="auto"`` is Memo's rule (DESIGN.md): the largest α whose copies hide under one
layer's forward and whose host bytes fit the host budget,

    α = min( (B·T_layer − S_in − S_attn) / S_others,
             (M_host / (n − keep_last) − S_in − S_attn) / S_others )  clipped to [0, 1],

with the sizes S measured on the second layer of the first step (both run with α = 0),
one layer's forward time T_layer by one more forward of that layer with nothing saved
or parked (the first layer has paid the kernels' one-time costs, and the training
forward's time would include page-locking its host buffers), and the host bandwidth B
measured by one copy of that layer's input. Under the simulator (fake tensors) nothing can be timed: the
layer time comes from its FLOPs at :data:`DEFAULT_FLOPS_PER_S` and the bandwidth is
:data:`DEFAULT_HOST_BANDWIDTH`. The chosen α and what it came from are reported in the
engine context's notes (the trainer's summary shows them).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
import weakref
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

import dataclasses

from .. import validate
from ..costs import StepWork, TechniqueCosts
from ..errors import LongtrainError
from ..memory.chunk_store import ChunkStore
from ..models.kept_attention import KeepOutputAttention, KeptOutputAttention, KeptOutputs, kept_layers_that_fit
from ..memory.pinned import host_empty
from ..memory.token_swap import LayerActivations, storage_id
from ..memory.tracker import untracked
from ..memory.units import format_bytes
from ..models.adapters import describe_model
from ..models.attention import AttentionCall
from ..ops import replay
from ..ops.causal_attention import attention_from_output
from ..registry import TechniqueSpec, register

# Used where nothing can be measured (the simulator): an H100's rates at long context in
# our run (650 TFLOP/s matmuls, 460 fused attention; longtrain.plan.time_model.H100) and a
# pinned PCIe Gen5 x16 copy.
DEFAULT_FLOPS_PER_S = 6.0e14
DEFAULT_HOST_BANDWIDTH = 2.5e10


@dataclass
class MemoOptions:
    """Knobs of Memo's token-wise swapping."""

    alpha: float | str = "auto"  # fraction of tokens of the other saved tensors swapped to host; "auto": Memo's rule
    host_memory: int | str | None = None  # host budget for the swapped activations; default: the run's host memory
    offload: bool = True  # swap to host memory (false: keep on the device, to test the schedule)
    keep_last: int = 2  # the last layers keep what they save on the device

    def __post_init__(self):
        if self.alpha != "auto":
            if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
                raise LongtrainError(f"memo alpha must be a number in [0, 1] or 'auto', got {self.alpha!r}")
            self.alpha = float(self.alpha)
        if self.host_memory is not None:
            self.host_memory = validate.byte_size("memo", "host_memory", self.host_memory)
            if self.host_memory <= 0:
                raise LongtrainError(f"memo host_memory must be positive, got {self.host_memory!r}")
        validate.flag("memo", "offload", self.offload)
        validate.positive_int("memo", "keep_last", self.keep_last, minimum=0)


def memo_alpha(*, input_bytes: float, attention_bytes: float, other_bytes: float, bandwidth: float,
               layer_seconds: float, layers: int, host_budget: float, keep_last: int = 2) -> float:
    """Memo's α (module docstring): the largest fraction of the other saved tensors'
    tokens that can go to host memory without exposing copies or exceeding the budget."""
    swapped_layers = max(1, layers - keep_last)
    always = input_bytes + attention_bytes
    # The inputs first (a layer needs its input to recompute), then the attention outputs: every one must fit.
    if kept_layers_that_fit(swapped_layers, host_budget, swapped_layers * input_bytes, attention_bytes) < swapped_layers:
        raise LongtrainError(
            f"memo keeps every layer's input and attention output in host memory: {swapped_layers} layers × "
            f"{format_bytes(always)} = {format_bytes(swapped_layers * always)}, over the host budget of "
            f"{format_bytes(host_budget)}; raise memo:host_memory, shorten the sequence, or use another strategy"
        )
    if other_bytes <= 0:
        return 1.0
    by_time = (bandwidth * layer_seconds - always) / other_bytes
    by_host = (host_budget / swapped_layers - always) / other_bytes
    return float(min(1.0, max(0.0, min(by_time, by_host))))


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


class _InRecord:
    """A layer's record (:class:`LayerActivations`) as the store of its kept attention
    output and LSE: kept whole, every saved view of them rebuilt from them."""

    _NAMES = {"out": "attention_output", "lse": "attention_lse"}

    def __init__(self, record: LayerActivations):
        self.record = record

    def put(self, key, tensor, offload=None):
        self.record.keep(self._NAMES[key[0]], tensor, views=True)

    def get(self, key):
        return self.record.fetch(self._NAMES[key[0]])


def _kept_outputs(record: LayerActivations) -> KeptOutputs:
    """The layer's attention output, kept in the (B, S, H, D) layout the layer reads next,
    so that the output projection's saved input is a view of the kept tensor, not a second copy."""
    return KeptOutputs(_InRecord(record), layout="BSHD")


def _KeptOutputAttention(inner: AttentionCall, record: LayerActivations) -> KeepOutputAttention:
    """The forward's attention: computed once, its output and LSE kept whole."""
    return KeepOutputAttention(inner, _kept_outputs(record), "attention",
                               refusal="memo needs attention over the whole sequence (the backprop engine)")


def _StandInAttention(record: LayerActivations, split: int, mask) -> KeptOutputAttention:
    """The recomputation's attention: the kept output of tokens ``[split, S)``."""
    return KeptOutputAttention(_kept_outputs(record), "attention", mask, start=split)


class _ShapeOnlyAttention(AttentionCall):
    """A shape-only run's attention: an output and LSE of the right shapes, laid out as
    the forward keeps them, saved as the forward's attention node saves them."""

    def __init__(self, mask):
        self.mask = mask

    def attend(self, module, q, k, v, *, scale, window, softcap):
        batch, heads, tokens, dim = q.shape
        out = q.new_empty((batch, tokens, heads, dim)).transpose(1, 2)
        lse = q.new_empty((batch, heads, tokens), dtype=torch.float32)
        return attention_from_output(q, k, v, out, lse, None)


class MemoLayers:
    """Memo's state for one model: the host store, α, and the chain of layer records."""

    def __init__(self, context, options: MemoOptions):
        self.context, self.options = context, options
        self.layers = len(context.adapter.layers)
        self.alpha = None if options.alpha == "auto" else options.alpha
        self.store: ChunkStore | None = None
        self._below: tuple[int, weakref.ref] | None = None
        self._early: dict[int, list] | None = {} if self.alpha is None else None  # what layers before α kept
        self._shortfall: list[tuple] | None = None  # buffers those layers will lack at α (_warm_pool)
        self._later_shapes: dict[tuple, list] = {}  # what each layer saves on its later tokens, by call shape
        # Whether a layer draws random numbers outside dropout modules (functional dropout in
        # its forward): learned from its first forward in training, which records its draws.
        self._draws_outside: dict[int, bool] = {}
        if self.alpha is not None:
            context.notes["memo_alpha"] = self.alpha

    def _may_draw(self, index: int, layer) -> bool:
        """Whether layer ``index``'s forward may draw random numbers (and so is recorded)."""
        return replay.active_dropout(layer) > 0 or (layer.training and self._draws_outside.get(index, True))

    def _store(self, device: torch.device) -> ChunkStore:
        if self.store is None or self.store.device != device:
            self.store = ChunkStore(device, offload=self.options.offload, pool=self.context.pool)
        return self.store

    def forward(self, index: int, layer, layer_forward, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        call = kwargs.get("attention_mask")
        if not isinstance(call, AttentionCall):
            raise LongtrainError("memo runs layers through longtrain's engines (longtrain.step or longtrain train)")
        batch, tokens = hidden.shape[:2]
        # α is measured on the second layer of the first step (the first one where a model
        # has one): the first layer pays the kernels' one-time costs (cuDNN's plans, lazy
        # CUDA modules, cuBLAS heuristics), which would inflate its time and so α; its
        # time is that of a forward run again (_time_forward). Layers run with α = 0 until
        # it is known.
        measuring = self.alpha is None and index == min(1, self.layers - 1)
        alpha = 0.0 if self.alpha is None else self.alpha
        split = min(tokens, max(0, round(alpha * tokens)))
        offload = self.options.offload and index < self.layers - self.options.keep_last
        rest = args[1:], _without(kwargs, "hidden_states")
        later_shapes = self._later_shapes_of(index, layer, layer_forward, *rest, hidden, split) if 0 < split < tokens else None
        record = LayerActivations(
            self._store(hidden.device), batch=batch, tokens=tokens, split=split, offload=offload,
            external=self._external(layer, kwargs.get("position_embeddings")), later_shapes=later_shapes,
            describe=f"layer {index}",
        )
        draws = replay.SeededOps()  # what the forward draws, for a recomputation of its later tokens
        # A weak reference: the record must die with the graph that holds it (its host buffers return then).
        record.recompute = functools.partial(_recompute, layer_forward, *rest, split, hidden.requires_grad,
                                             _autocast_state(hidden.device), weakref.ref(record), draws)
        record.input_storage = storage_id(hidden)
        host_before = self.store.host_bytes
        if split < tokens:  # the recomputation starts from the layer input's recomputed tokens
            record.keep("input", hidden.detach()[:, split:].contiguous())
        plain = args, kwargs
        args, kwargs = _with_hidden(args, kwargs, hidden, _KeptOutputAttention(call, record))
        replays = split < tokens and not _is_fake(hidden)
        before = replay.capture(hidden) if replays else None
        recording = replay.recording(draws) if replays and self._may_draw(index, layer) else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(record.pack, record.unpack), recording:
            out = layer_forward(*args, **kwargs)
        record.finish_forward()
        if replays and layer.training and index not in self._draws_outside and replay.active_dropout(layer) == 0:
            self._draws_outside[index] = not draws.empty  # learned from its first recorded forward
        if before is not None and draws.empty and not replay.same_states(before, replay.capture(hidden)):
            raise LongtrainError(f"memo: layer {index} drew random numbers that its first training forward did not "
                                 "(a dropout switched on since?), which a recomputation of part of its tokens cannot "
                                 "replay; build a fresh model with the dropout set, or use memo:alpha=1 or checkpoint")
        if offload and self.alpha is not None and not measuring:
            self._check_host_budget(index, self.store.host_bytes - host_before)
        if measuring:
            self._resolve_alpha(record, hidden, self._time_forward(layer_forward, *plain, hidden), layer)
        self._warm_pool(record, index, measuring or self.alpha is None)
        below = self._below
        if below is not None and below[0] == index - 1:
            record.previous = below[1]
        self._below = (index, weakref.ref(record))
        return out

    def _warm_pool(self, record: LayerActivations, index: int, before_alpha: bool) -> None:
        """The layers that ran before α was known (with α = 0) will park α's share from the
        next step on: their buffers are pinned in this step — what the first layer run at α
        keeps and they lack (by the pool's key: element count and dtype), set aside after
        the last layer's forward so that no layer of this step takes them — and no later
        step pins memory (page-locking GBs is a slow system call; on the H100 the first
        timed step was the one that pinned them, 2.6 GB per layer at 32K)."""
        if self._early is None or not self.options.offload:
            return
        if before_alpha:
            self._early[index] = record.kept_sizes  # by index: a step that failed and reran overwrites
        elif self._shortfall is None:
            wanted = collections.Counter(record.kept_sizes)
            self._shortfall = []
            for early, kept in self._early.items():
                if early < self.layers - self.options.keep_last:  # it parks in host memory
                    self._shortfall += list((wanted - collections.Counter(kept)).elements())
        if index == self.layers - 1:
            for numel, dtype in self._shortfall or []:
                self.context.pool.reserve(torch.Size([numel]), dtype)
            self._early = None

    def _later_shapes_of(self, index: int, layer, layer_forward, rest_args, kwargs, hidden: torch.Tensor,
                         split: int) -> list:
        """What layer ``index`` saves when it runs on tokens ``[split, S)`` alone, slot by
        slot: from one shape-only run per call shape (:func:`_saved_shapes_on_later_tokens`)."""
        kind = hidden.device.type if hidden.device.type in ("cuda", "cpu") else "cpu"
        # Whatever changes what the layer saves: the call's shape and its other tensors' (rotary
        # tables are (1, S, d) for shared positions, (B, S, d) for packed rows), autocast,
        # train/eval mode and dropout, which parameters train.
        others = tuple(tuple(t.shape) for t in tree_flatten((rest_args, kwargs))[0] if isinstance(t, torch.Tensor))
        key = (index, tuple(hidden.shape), others, split, hidden.dtype, hidden.requires_grad, torch.is_autocast_enabled(kind),
               torch.get_autocast_dtype(kind), tuple(m.training for m in layer.modules()),
               tuple(p.requires_grad for p in layer.parameters()), replay.active_dropout(layer))
        if key not in self._later_shapes:
            if len(self._later_shapes) >= _SHAPE_RUNS_KEPT:
                self._later_shapes.pop(next(iter(self._later_shapes)))  # the oldest: lengths that vary do not pile up
            self._later_shapes[key] = _saved_shapes_on_later_tokens(layer_forward, rest_args, kwargs, hidden, split)
        return self._later_shapes[key]

    def host_budget(self) -> float:
        """Bytes of host memory the swapped activations may take."""
        return self.options.host_memory or self.context.host_memory or float("inf")  # the run's (EngineContext), else unbounded

    def _check_host_budget(self, index: int, layer_bytes: int) -> None:
        """Refuse, before the host fills, a step whose swapped activations will pass the
        budget: those parked so far and ``layer_bytes`` for each offloaded layer still to run."""
        budget = self.host_budget()
        still = max(0, self.layers - self.options.keep_last - index - 1)
        projected = self.store.host_bytes + still * layer_bytes
        if projected > budget:
            raise LongtrainError(
                f"memo at alpha={self.alpha:g} parks {format_bytes(layer_bytes)} per layer in host memory, "
                f"{format_bytes(projected)} for the step, over the host budget of {format_bytes(budget)}; "
                "lower memo:alpha (or alpha=auto), raise memo:host_memory, or shorten the sequence")

    # ---- measurement -------------------------------------------------------------------
    @staticmethod
    def _time_forward(layer_forward, args, kwargs, hidden: torch.Tensor) -> float | None:
        """Seconds of one more forward of the layer, with nothing saved or parked (None on
        fake tensors). Not the training forward's own time: in the first step that one
        also page-locks the host buffers its parked tensors go to (a slow system call, ~1 s
        per few GB), which on the H100 made T_layer three to five times what the layer's FLOPs
        take at 600 TFLOP/s and so overstated α (16K: 80 ms against ~16 ms, α 1.00; the
        exposed copies likely made Memo slower than checkpointing). Runs after the layer's training forward, so its kernels are warm."""
        if _is_fake(hidden):
            return None
        cuda = hidden.device.type == "cuda"
        if cuda:  # the copies the training forward queued finish outside the timed window
            torch.cuda.synchronize(hidden.device)
        started = time.perf_counter()
        # Its random draws are undone: the step's draws stay those of a step without this timing.
        with torch.no_grad(), replay.restoring(replay.capture(hidden)):
            layer_forward(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize(hidden.device)
        return time.perf_counter() - started

    def _resolve_alpha(self, record: LayerActivations, hidden: torch.Tensor, seconds: float | None, layer) -> None:
        tokens = hidden.shape[1]
        fake = seconds is None
        if fake:
            layer_seconds = _layer_flops(self.context, layer, hidden) / DEFAULT_FLOPS_PER_S
            bandwidth = DEFAULT_HOST_BANDWIDTH
        else:
            layer_seconds = seconds
            bandwidth = _measure_bandwidth(hidden)
        host_budget = self.host_budget()
        sizes = dict(input_bytes=hidden.nbytes, attention_bytes=record.saved_bytes["whole"],
                     other_bytes=record.saved_bytes["split"])
        self.alpha = memo_alpha(**sizes, bandwidth=bandwidth, layer_seconds=layer_seconds, layers=self.layers,
                                host_budget=host_budget, keep_last=self.options.keep_last)
        self.context.notes.update({
            "memo_alpha": self.alpha, "memo_layer_seconds": layer_seconds, "memo_host_bandwidth": bandwidth,
            "memo_measured": not fake, "memo_tokens": tokens, "memo_host_budget": host_budget, **{f"memo_{k}": v for k, v in sizes.items()},
        })

    def _external(self, layer, position_embeddings) -> set[int]:
        tables = [t for t in tree_flatten(position_embeddings)[0] if isinstance(t, torch.Tensor)]
        return {storage_id(t) for t in [*layer.parameters(), *layer.buffers(), *tables] if not t.is_meta}


def _recompute(layer_forward, rest_args, kwargs, split, requires_grad, autocast, record_ref, draws, capture):
    """Replay the layer on tokens ``[split, S)`` under ``capture`` (see token_swap), drawing
    the forward's random numbers of those tokens (``draws``)."""
    record = record_ref()
    hidden = record.fetch("input").detach().requires_grad_(requires_grad)
    kwargs = dict(kwargs)
    kwargs["attention_mask"] = _StandInAttention(record, split, kwargs["attention_mask"].mask)
    kwargs["position_embeddings"] = _from_token(kwargs.get("position_embeddings"), split)
    device_type, dtype, enabled = autocast
    with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled), \
            torch.autograd.graph.saved_tensors_hooks(capture, _never_unpacked), \
            replay.replaying(draws, record.batch, record.tokens, split, hidden.device):
        layer_forward(hidden, *rest_args, **kwargs)


def _saved_shapes_on_later_tokens(layer_forward, rest_args, kwargs, hidden: torch.Tensor, split: int) -> list[tuple]:
    """The shapes the layer saves for backward, slot by slot, when it runs on tokens
    ``[split, S)`` alone, as the recomputation will: a run on fake tensors (no compute,
    nothing counted by a memory tracker, no random numbers drawn)."""
    batch, tokens = hidden.shape[:2]
    shapes: list[tuple] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return None

    active = detect_fake_mode((hidden,))  # a simulation: its own fake mode runs on
    kwargs = dict(kwargs)
    kwargs["attention_mask"] = _ShapeOnlyAttention(kwargs["attention_mask"].mask)
    kwargs["position_embeddings"] = _from_token(kwargs.get("position_embeddings"), split)
    with untracked(), torch.random.fork_rng(devices=[]), _autocast_cache_off(), \
            (contextlib.nullcontext() if active else FakeTensorMode(allow_non_fake_inputs=True)):
        later = torch.empty((batch, tokens - split, *hidden.shape[2:]), dtype=hidden.dtype, device=hidden.device)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked), \
                replay.replaying(replay.SeededOps(), batch, tokens, split, hidden.device):
            layer_forward(later.requires_grad_(hidden.requires_grad), *rest_args, **kwargs)
    return shapes


@contextlib.contextmanager
def _autocast_cache_off():
    """Autocast keeps the casts of trainable weights for reuse; cast in a fake run, they
    would be fake tensors the real forward then reads."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


_SHAPE_RUNS_KEPT = 256  # shape-only runs remembered (per layer and call shape)


def _from_token(position_embeddings, start: int):
    """The rotary tables (cos, sin: (B or 1, S, D), tokens on axis 1, as a layer receives
    them) of tokens ``[start, S)``."""
    if position_embeddings is None:
        return None
    return tree_map(lambda t: t[:, start:] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t, position_embeddings)


def _never_unpacked(_):
    raise RuntimeError("memo's recomputation graph is never differentiated")


def _without(kwargs: dict, name: str) -> dict:
    return {k: v for k, v in kwargs.items() if k != name}


def _with_hidden(args, kwargs, hidden, call):
    kwargs = dict(kwargs, attention_mask=call)
    if args:
        return (hidden,) + tuple(args[1:]), kwargs
    kwargs["hidden_states"] = hidden
    return (), kwargs


def _autocast_state(device: torch.device):
    kind = device.type if device.type in ("cuda", "cpu") else "cpu"
    return kind, torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind)


def _measure_bandwidth(hidden: torch.Tensor) -> float:
    """Bytes/s of one device→host copy of ``hidden`` into page-locked memory."""
    cuda = hidden.device.type == "cuda"
    buffer = host_empty(hidden.numel(), hidden.dtype, pin=cuda).view(hidden.shape)
    if cuda:
        torch.cuda.synchronize(hidden.device)
    started = time.perf_counter()
    buffer.copy_(hidden.detach())
    if cuda:
        torch.cuda.synchronize(hidden.device)
    return hidden.nbytes / max(time.perf_counter() - started, 1e-9)


def _layer_flops(context, layer, hidden: torch.Tensor) -> float:
    """Forward FLOPs of one layer over ``hidden``'s tokens: its matmuls (a token's experts,
    not all of a mixture's) and causal attention."""
    shape = describe_model(context.adapter.config)
    batch, tokens = hidden.shape[:2]
    matmul = sum(p.numel() for p in layer.parameters() if p.dim() >= 2)
    if shape.feed_forward:
        block = shape.feed_forward[context.adapter.layer_index(layer)]
        matmul -= block.parameters(shape.hidden) - block.parameters(shape.hidden, active_only=True)
    return batch * (2.0 * tokens * matmul + 2.0 * shape.attention_width * tokens * tokens)


def _memo_forward(memo: MemoLayers, index: int, layer, layer_forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing is saved
        return layer_forward(*args, **kwargs)
    return memo.forward(index, layer, layer_forward, args, kwargs)


class MemoCosts(TechniqueCosts):
    """Memo: every layer's input and attention output in host memory, an α share of the
    rest; backward recomputes the (1 − α) share token-wise, never attention."""

    decides_at_first_step = True  # α is chosen from the first step's sizes

    def layers_apart_at_top(self, options: MemoOptions) -> int:
        return options.keep_last

    def small_options(self, options: MemoOptions, layers: int, full: int):
        """The budget of the layers below ``keep_last`` scaled to those simulated, so α is the full model's."""
        budget, top = options.host_memory, options.keep_last
        share = None if budget is None else max(1, budget * max(1, layers - top) // max(1, full - top))
        return dataclasses.replace(options, host_memory=share)

    def full_notes(self, options: MemoOptions, notes: dict) -> None:
        if "memo_host_budget" in notes:
            notes["memo_host_budget"] = options.host_memory  # the small simulations' is a share of it

    def parked(self, config, seq_len, options: MemoOptions, item, batch, engine_offloads):
        shape = describe_model(config)
        return 0, shape.layers * batch * seq_len * shape.hidden * item  # inputs, with more

    def fragmentation(self, options: MemoOptions) -> str:
        return "offload"

    def with_host_budget(self, options: MemoOptions, room: int):
        return dataclasses.replace(options, host_memory=max(1, room))

    def candidates(self, host_memory):
        return {"memo": {"host_memory": host_memory}}

    def serves(self, adapter_class, options) -> bool:
        return adapter_class.has_attention  # it keeps attention outputs

    def describe(self, work: StepWork, options: MemoOptions) -> None:
        work.mlp_forward_charged = True

    def add_work(self, work: StepWork, options: MemoOptions) -> None:
        notes = work.notes
        alpha = notes.get("memo_alpha", options.alpha if options.alpha != "auto" else 0.0)
        work.matmul += (1 - alpha) * (work.layer_fwd - (work.mlp_fwd if work.tiled_mlp else 0))
        if work.tiled_mlp:
            # The tiled backward's forward, and the (1 − α) share of checkpointing's third MLP
            # forward (the elementwise work a token-wise recomputation repeats): at α = 0 Memo
            # is checkpointing with attention kept, and is predicted as such.
            work.matmul += work.mlp_fwd + (1 - alpha) * work.mlp_fwd
        if "memo_input_bytes" in notes:
            moved = notes["memo_input_bytes"] + notes["memo_attention_bytes"] + alpha * notes["memo_other_bytes"]
            n = work.layers
            layer_seconds = (work.layer_fwd / n + work.attention_fwd / n) / work.rates.matmul
            work.exposed = n * max(0.0, moved / work.rates.host_bandwidth - layer_seconds)


def install_memo(context, options: MemoOptions) -> None:
    adapter = context.adapter
    if not adapter.has_attention:
        raise LongtrainError("memo keeps attention outputs; this model has no attention (use the adjoint engine)")
    if adapter.description.is_moe and options.alpha != 1:
        raise LongtrainError("memo recomputes part of each layer's tokens, and a mixture of experts saves its "
                             "activations in groups of tokens routed to each expert, not token by token; use "
                             "memo:alpha=1 (every activation swapped, nothing recomputed) or checkpoint")
    memo = MemoLayers(context, options)
    for index, layer in enumerate(adapter.layers):
        layer.forward = functools.partial(_memo_forward, memo, index, layer, layer.forward)


register(TechniqueSpec("memo", MemoOptions, install_memo, "token-wise activation swapping to host + recomputation without attention (exact)",
                    excludes={
                        "checkpoint": "memo already recomputes what it does not swap; drop 'checkpoint'",
                        "liger": "memo learns what a layer saves from a run on fake tensors, which Liger's Triton kernels "
                                 "cannot take; drop 'liger' or use checkpoint,mst,liger"},
                    costs=MemoCosts(), sequence_parallel=False))
