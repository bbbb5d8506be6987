"""Memo's machinery for one model (:class:`MemoLayers`): each layer's forward under
saved-tensor hooks that keep its input, its attention output and LSE whole and α's share of
the tokens of every other saved tensor (:class:`~longtrain.memory.token_swap.LayerActivations`),
the recomputation of the other tokens in backward, and the measurement that picks α.

Shapes: B batch rows, S tokens, d hidden size; a layer's input (B, S, d); attention's
output kept as (B, S, H, D) and its LSE as (B, H, S), H query heads of D dimensions; α·S
tokens (rounded) swapped, tokens ``[split, S)`` recomputed (``split`` = round(α·S)).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
import weakref

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from ...errors import LongtrainError
from ...memory.chunk_store import ChunkStore
from ...memory.pinned import host_empty
from ...memory.token_swap import LayerActivations, storage_id
from ...memory.tracker import untracked
from ...memory.units import format_bytes
from ...models.adapters import describe_model
from ...models.attention import AttentionCall
from ...models.kept_attention import KeptOutputStore, RecordingAttention, ReplayingAttention
from ...ops import replay
from ...ops.causal_attention import attention_from_output
from .costs import memo_alpha
from .options import MemoOptions

# Used where nothing can be measured (the simulator): an H100's rates at long context in
# our run (650 TFLOP/s matmuls, 460 fused attention; longtrain.plan.time_model.H100) and a
# pinned PCIe Gen5 x16 copy.
DEFAULT_FLOPS_PER_S = 6.0e14
DEFAULT_HOST_BANDWIDTH = 2.5e10


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


def _outputs_in_record(record: LayerActivations) -> KeptOutputStore:
    """The layer's attention output, kept in the (B, S, H, D) layout the layer reads next,
    so that the output projection's saved input is a view of the kept tensor, not a second copy."""
    return KeptOutputStore(_InRecord(record), layout="BSHD")


def _forward_attention(inner: AttentionCall, record: LayerActivations) -> RecordingAttention:
    """The forward's attention: computed once, its output and LSE kept whole."""
    return RecordingAttention(inner, _outputs_in_record(record), "attention",
                              refusal="memo needs attention over the whole sequence (the backprop engine)")


def _recomputation_attention(record: LayerActivations, split: int, mask) -> ReplayingAttention:
    """The recomputation's attention: the kept output of tokens ``[split, S)``."""
    return ReplayingAttention(_outputs_in_record(record), "attention", mask, start=split)


class _ShapeOnlyAttention(AttentionCall):
    """A shape-only run's attention: an output and LSE of the right shapes, laid out as
    the forward keeps them, saved as the forward's attention node saves them."""

    def __init__(self, mask):
        self.mask = mask

    def attend(self, module, q, k, v, *, scale, window, softcap, sink=None):
        batch, heads, tokens, dim = q.shape
        out = q.new_empty((batch, tokens, heads, dim)).transpose(1, 2)
        lse = q.new_empty((batch, heads, tokens), dtype=torch.float32)
        return attention_from_output(q, k, v, out, lse, None, sink=sink)


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
        args, kwargs = _with_hidden(args, kwargs, hidden, _forward_attention(call, record))
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
        step pins memory (page-locking GBs is a slow system call)."""
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
        return self.options.host_memory or self.context.host_room() or float("inf")  # the run's (EngineContext), else unbounded

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
        also page-locks the host buffers its parked tensors go to (a slow system call),
        which would make T_layer far more than the layer's compute and so overstate α.
        Runs after the layer's training forward, so its kernels are warm."""
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
    kwargs["attention_mask"] = _recomputation_attention(record, split, kwargs["attention_mask"].mask)
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
