"""Random numbers under recomputation: a recomputed region draws what its forward drew.

Dropout (peft's ``lora_dropout`` above all) draws its masks from the global generators.
A recomputation that draws new ones backpropagates another loss than the one the step
reports. Two mechanisms keep them equal:

- **Whole regions** — a tile of the MLP, a chunk of FPDT or SeCO, a checkpointed layer
  (``torch.utils.checkpoint`` does this itself) — run the same ops on the same shapes
  again. The generator states are captured before the forward (:func:`capture`,
  :class:`RegionStates` keyed by region) and set around the recomputation
  (:func:`restoring`), which leaves the caller's generators as they were.
- **A token subset** — Memo's recomputation of tokens ``[split, S)`` of a layer — draws
  fewer numbers than the forward. The forward records every seeded op (an aten op tagged
  ``nondeterministic_seeded``: bernoulli, dropout, rand, ...) with the generator states
  before it (:func:`recording`, into :class:`SeededOps`). The subset's replay
  (:func:`replaying`) runs each seeded op again at the forward's shape from those
  states, its inputs placed at their tokens' positions, and keeps its own tokens: every
  draw of the forward comes back, sliced. Ops are matched in order within a scope: the
  layer's, or one tile of a tiled MLP (:func:`tile_scopes`), whose tiles the replay
  visits in part. A replay that draws otherwise than its forward stops with one line.

On fake tensors (the simulator) nothing is drawn that matters: nothing is captured.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import LongtrainError

__all__ = [
    "RegionStates",
    "ReplayedRows",
    "SeededOps",
    "TileScopes",
    "active_dropout",
    "capture",
    "recording",
    "replayed_rows",
    "replaying",
    "restoring",
    "same_states",
    "tile_scopes",
]


@dataclass(frozen=True)
class GeneratorStates:
    """The CPU generator's state and, for an accelerator, that device's."""

    cpu: torch.Tensor
    device: torch.device | None = None
    device_state: torch.Tensor | None = None


def _accelerator(device: torch.device | None) -> torch.device | None:
    if device is None or device.type in ("cpu", "meta"):
        return None
    return device


def capture(reference: torch.Tensor | torch.device | None = None) -> GeneratorStates | None:
    """The generator states now: the CPU's and that of ``reference``'s device (a tensor or
    a device); None for a fake or meta ``reference`` (nothing to replay)."""
    device = reference
    if isinstance(reference, torch.Tensor):
        if is_fake(reference) or reference.is_meta:
            return None
        device = reference.device
    accelerator = _accelerator(device)
    if accelerator is None:
        return GeneratorStates(torch.get_rng_state())
    module = torch.get_device_module(accelerator.type)
    return GeneratorStates(torch.get_rng_state(), accelerator, module.get_rng_state(accelerator))


@contextlib.contextmanager
def restoring(states: GeneratorStates | None):
    """Run the block with the generators set to ``states``; they are put back after it.
    Nothing happens for None."""
    if states is None:
        yield
        return
    devices = [] if states.device is None else [states.device]
    device_type = "cuda" if states.device is None else states.device.type
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        torch.set_rng_state(states.cpu)
        if states.device is not None:
            torch.get_device_module(states.device.type).set_rng_state(states.device_state, states.device)
        yield


def same_states(a: GeneratorStates | None, b: GeneratorStates | None) -> bool:
    """Whether nothing was drawn between two captures."""
    if a is None or b is None:
        return a is b
    # Compared as host bytes (the states are CPU tensors): no op a dispatch mode would take for a device read.
    return a.cpu.numpy().tobytes() == b.cpu.numpy().tobytes() and (
        a.device_state is None or a.device_state.numpy().tobytes() == b.device_state.numpy().tobytes())


def active_dropout(module: nn.Module) -> float:
    """The largest probability of the dropout modules in ``module`` that draw masks now
    (in training mode): LoRA's ``lora_dropout``, say; 0 where none does."""
    return max((m.p for m in module.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training),
               default=0.0)


class RegionStates:
    """Generator states by region (an engine's (layer, chunk), say): :meth:`record` before
    a region's forward, :meth:`replay` around each of its recomputations."""

    def __init__(self):
        self._states: dict = {}

    def record(self, key, reference: torch.Tensor | torch.device | None) -> None:
        self._states[key] = capture(reference)

    def replay(self, key):
        return restoring(self._states[key])  # (a region never recorded is a schedule's mistake, not a fresh draw)

    def clear(self) -> None:
        self._states.clear()


# ---- a token subset: seeded ops recorded, replayed at the forward's shape -------------------

def seeded(func) -> bool:
    """Whether an aten op draws from a generator."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


@dataclass
class _Draw:
    func: object
    shapes: list  # per leaf of (args, kwargs): a tensor's shape, else the value
    strides: list  # per leaf: a tensor's strides, else None (a kernel's draws may follow its layout)
    states: GeneratorStates | None


@dataclass
class SeededOps:
    """The seeded ops of one forward region, in order, by scope (None: the region's own;
    (call, tile): one tile of a tiled MLP)."""

    draws: dict = field(default_factory=dict)
    _replayed: dict = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.draws

    def add(self, scope, draw: _Draw) -> None:
        self.draws.setdefault(scope, []).append(draw)

    def next(self, scope, func) -> _Draw | None:
        """The forward's next draw in ``scope`` if ``func`` made it (and it is taken), else None."""
        position = self._replayed.get(scope, 0)
        draws = self.draws.get(scope, [])
        if position >= len(draws) or draws[position].func is not func:
            return None
        self._replayed[scope] = position + 1
        return draws[position]

    def rewind(self) -> None:
        self._replayed.clear()


@dataclass(frozen=True)
class ReplayedRows:
    """The rows a replay recomputes of a forward over ``batch`` × ``tokens``: tokens
    ``[split, tokens)`` of each row, in the flattened (batch·tokens) numbering."""

    batch: int
    tokens: int
    split: int
    device: torch.device | None = None  # where position tensors are made

    @property
    def forward_count(self) -> int:
        return self.batch * self.tokens

    @property
    def count(self) -> int:
        return self.batch * (self.tokens - self.split)

    def later(self, device: torch.device | None = None) -> torch.Tensor:
        """The replayed tokens' positions in a row."""
        return torch.arange(self.split, self.tokens, device=device)

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        """Each replayed row's position among the forward's rows (ascending); made on
        ``device`` (no copy from the host)."""
        return (torch.arange(self.batch, device=device).unsqueeze(1) * self.tokens + self.later(device)).reshape(-1)

    def before(self, position: int) -> int:
        """How many replayed rows lie before the forward's row ``position`` (host arithmetic)."""
        row, token = divmod(min(position, self.forward_count), self.tokens)
        return row * (self.tokens - self.split) + min(max(token - self.split, 0), self.tokens - self.split)


class _Watch:
    """The active recording or replay on this thread, and its tiled-call count."""

    def __init__(self, ops: SeededOps, select: Callable[[int, torch.device], torch.Tensor | None] | None = None,
                 rows: ReplayedRows | None = None):
        self.ops, self.select, self.rows = ops, select, rows
        self.tiled_calls = 0
        self.scope = None
        self.scope_select: Callable[[int, torch.device], torch.Tensor | None] | None = None


_local = threading.local()


def _watching() -> _Watch | None:
    return getattr(_local, "watch", None)


def _leaf_device(leaves) -> torch.device | None:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
        if isinstance(leaf, torch.device):
            return leaf
    return None


def _signature(leaves) -> list:
    return [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]


class _SeededOpsMode(TorchDispatchMode):
    """Lets every op through but the seeded ones, which :meth:`seeded_op` runs."""

    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not seeded(func):
            return func(*args, **kwargs)
        return self.seeded_op(func, args, kwargs)

    def seeded_op(self, func, args, kwargs):
        raise NotImplementedError


def _drawing(func, args, kwargs) -> tuple[object, GeneratorStates | None, bool]:
    """``func`` run: its output, the states before it, and whether it drew (a seeded op
    may draw nothing, as attention with dropout_p = 0)."""
    device = _leaf_device(tree_flatten((args, kwargs))[0])
    states = capture(device)
    out = func(*args, **kwargs)
    return out, states, not same_states(states, capture(device))


class _Recorder(_SeededOpsMode):
    def seeded_op(self, func, args, kwargs):
        if kwargs.get("generator") is not None:
            raise LongtrainError(f"{func} draws from a generator of its own, which a recomputation cannot replay; "
                                 "draw from the global generator or drop the op from training")
        out, states, drew = _drawing(func, args, kwargs)
        if drew:
            leaves = tree_flatten((args, kwargs))[0]
            strides = [leaf.stride() if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
            self.watch.ops.add(self.watch.scope, _Draw(func, _signature(leaves), strides, states))
        return out


class _Replayer(_SeededOpsMode):
    def seeded_op(self, func, args, kwargs):
        watch = self.watch
        draw = watch.ops.next(watch.scope, func)
        if draw is None:  # not one of the forward's draws: it must draw nothing here either
            out, _, drew = _drawing(func, args, kwargs)
            if drew:
                raise LongtrainError(
                    f"a recomputation drew random numbers ({func}) where its forward did not; it cannot be replayed "
                    "exactly: set the dropout probabilities (lora_dropout, the model's) to 0, or use a strategy that "
                    "recomputes whole layers (checkpoint)")
            return out
        select = watch.scope_select if watch.scope is not None else watch.select
        return _replay_draw(draw, func, args, kwargs, select)


def _replay_draw(draw: _Draw, func, args, kwargs, select):
    """``func`` run as its forward ran it — at the forward's shape, from its states — its
    outputs cut to this replay's tokens (module docstring)."""
    leaves, spec = tree_flatten((args, kwargs))
    full = list(leaves)
    placed: dict[tuple, tuple[int, torch.Tensor]] = {}  # forward shape -> (token axis, forward positions)
    for n, (leaf, was, stride) in enumerate(zip(leaves, draw.shapes, draw.strides)):
        now = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else leaf
        if now == was:
            continue
        if not isinstance(leaf, torch.Tensor) or len(now) != len(was):
            _mismatch(func, draw.shapes, _signature(leaves))
        axes = [a for a, (x, y) in enumerate(zip(now, was)) if x != y]
        index = select(was[axes[0]], leaf.device) if len(axes) == 1 and select is not None else None
        if index is None or len(index) != now[axes[0]]:
            _mismatch(func, draw.shapes, _signature(leaves))
        # Laid out as the forward's tensor was; the other tokens' values do not matter.
        full[n] = leaf.new_empty_strided(was, stride).index_copy_(axes[0], index, leaf)
        placed[was] = (axes[0], index)
    args, kwargs = tree_unflatten(full, spec)
    with restoring(draw.states):
        out = func(*args, **kwargs)
    if func._schema.is_mutable and args[0] is not leaves[0]:  # in place on its first argument (bernoulli_)
        axis, index = placed[tuple(args[0].shape)]
        leaves[0].copy_(args[0].index_select(axis, index))
        return leaves[0]

    def cut(t):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) not in placed:
            return t
        axis, index = placed[tuple(t.shape)]
        return t.index_select(axis, index)

    return tree_map(cut, out)


def _mismatch(func, was, now):
    raise LongtrainError(
        f"a recomputation ran {func} on {now} where its forward ran it on {was}, which is not a subset of the "
        "forward's tokens; it cannot be replayed exactly: set the dropout probabilities (lora_dropout, the model's) "
        "to 0, or use a strategy that recomputes whole layers (checkpoint)")


@contextlib.contextmanager
def recording(ops: SeededOps):
    """Record the seeded ops the block runs (a forward whose tokens may be replayed in part)."""
    watch = _Watch(ops)
    before, _local.watch = _watching(), watch
    try:
        with _Recorder(watch):
            yield
    finally:
        _local.watch = before


@contextlib.contextmanager
def replaying(ops: SeededOps, batch: int, tokens: int, split: int, device: torch.device | None = None):
    """Replay ``ops`` (a forward over ``batch`` × ``tokens``) in a recomputation of tokens
    ``[split, tokens)`` of each row: each seeded op runs at the forward's shape from its
    states, and keeps the rows of those tokens (a token axis of ``tokens`` positions, or a
    flattened one of ``batch`` · ``tokens``). ``device``: where the replay runs."""
    rows = ReplayedRows(batch, tokens, split, device)
    made: dict = {}  # (kind, device) -> positions, made once per replay on the device that asks

    def select(size: int, device: torch.device) -> torch.Tensor | None:
        kind = "flat" if size == batch * tokens else "later" if size == tokens else None
        if kind is None:
            return None
        if (kind, device) not in made:
            made[kind, device] = rows.positions(device) if kind == "flat" else rows.later(device)
        return made[kind, device]

    ops.rewind()
    watch = _Watch(ops, select, rows)
    before, _local.watch = _watching(), watch
    try:
        with contextlib.nullcontext() if ops.empty else _Replayer(watch):  # (nothing drawn: no op to watch)
            yield
    finally:
        _local.watch = before


def replayed_rows(count: int) -> ReplayedRows | None:
    """Inside :func:`replaying`, for a token-wise op over ``count`` flattened rows: which of
    the forward's rows they are; else None."""
    watch = _watching()
    if watch is None or watch.rows is None or watch.rows.count != count:
        return None
    return watch.rows


class TileScopes:
    """The scopes of one tiled call's tiles in the active recording or replay."""

    def __init__(self, watch: _Watch | None):
        self.watch = watch
        self.call = None
        if watch is not None:
            self.call = watch.tiled_calls
            watch.tiled_calls += 1

    @contextlib.contextmanager
    def scope(self, tile: int, positions: torch.Tensor | None = None):
        """Tile ``tile`` of this call; ``positions`` (replay): the rows of the forward's
        tile this replay's rows are."""
        watch = self.watch
        if watch is None:
            yield
            return
        saved = watch.scope, watch.scope_select
        watch.scope = (self.call, tile)
        watch.scope_select = None if positions is None else (lambda size, device: positions)
        try:
            yield
        finally:
            watch.scope, watch.scope_select = saved


def tile_scopes() -> TileScopes:
    """Scopes for the tiles of one tiled op (a tiled MLP's call) on this thread."""
    return TileScopes(_watching())
