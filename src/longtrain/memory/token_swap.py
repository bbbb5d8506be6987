"""A layer's saved activations kept token by token: some tokens swapped out, the rest recomputed.

Memo (its paper, §4.1) keeps, for each decoder layer, its input and its
attention output, and of every other tensor autograd saves for backward only the first
``split`` tokens; the other tokens are dropped and recomputed in backward. With the
attention output kept, everything else in a layer acts on each token alone (norms,
projections, rotary, MLP), so the dropped tokens are recomputed by running the layer on
those tokens only, with the kept attention output standing in for attention: attention
never runs twice.

:class:`LayerActivations` does this with autograd's saved-tensor hooks, for one call of
one layer:

- ``pack`` (forward) sees every tensor the layer saves. Parameters and tensors shared
  with the caller (rotary tables) are kept by reference; tensors kept whole (the
  attention output and its LSE, registered by :meth:`keep`) go to the store once;
  every other tensor with a token axis is split there: tokens ``[0, split)`` go to the
  store (host memory under offload), the rest are dropped.

Which saved tensors carry tokens, and along which axis, is learnt from how the layer
runs, not from coincidences of sizes: the caller gives the shapes the layer saves when
run on tokens ``[split, S)`` alone (``later_shapes``, a shape-only run on fake tensors),
and a saved tensor's token axis is the one axis whose size differs between the two runs
(S or B·S here). With ``split == 0`` every such tensor is recomputed whole and with
``split == S`` kept whole, so no axis is needed.
- ``unpack`` (backward) first *materializes* the layer: one recomputation of tokens
  ``[split, S)`` — the layer's forward replayed on them under hooks that capture what it
  saves, in the same order as the forward saved it — and each split tensor is the
  stored tokens joined with the recomputed ones. With ``split == S`` nothing is
  recomputed (every op of the layer ran once); with ``split == 0`` all token-wise work
  is recomputed, attention still not.

Everything the backward needs is held by the record the hooks return, so it runs on any
thread (CUDA runs backward on its own).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import LongtrainError
from .chunk_store import ChunkStore

__all__ = ["LayerActivations", "NotTokenWise", "storage_id", "token_axis"]

_KEYS = itertools.count()


class NotTokenWise(Exception):
    """A saved tensor whose shapes at two token counts do not differ in one token axis."""


def token_axis(shape: tuple, later_shape: tuple, batch: int, tokens: int) -> tuple[int, bool] | None:
    """Where the tokens lie in a tensor a (``batch``, ``tokens``) layer call saved as
    ``shape`` and a call on fewer tokens saved as ``later_shape``: ``(axis, flattened)``
    — ``flattened`` for (batch·tokens, ...) as matmuls save their input — or None where
    the two are equal (no token axis). :class:`NotTokenWise` where they differ otherwise."""
    shape, later_shape = tuple(shape), tuple(later_shape)
    if shape == later_shape:
        return None
    axes = [a for a, (x, y) in enumerate(zip(shape, later_shape)) if x != y]
    if len(shape) != len(later_shape) or len(axes) != 1:
        raise NotTokenWise(shape, later_shape)
    axis = axes[0]
    if batch > 1 and shape[axis] == batch * tokens:
        return axis, True
    if shape[axis] == tokens:
        return axis, False
    raise NotTokenWise(shape, later_shape)


def narrow_tokens(t: torch.Tensor, axis: int, flattened: bool, batch: int, start: int, end: int | None = None):
    """Tokens ``[start, end)`` of ``t`` along its token ``axis`` (see :func:`token_axis`);
    a flattened (batch·tokens, ...) tensor comes back as (batch, tokens, ...)."""
    if flattened:
        t, axis = t.reshape(*t.shape[:axis], batch, -1, *t.shape[axis + 1:]), axis + 1
    end = t.shape[axis] if end is None else end
    return t.narrow(axis, start, end - start)


def storage_id(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage, for real and fake tensors alike (PyTorch keeps one
    Python storage object per live storage; fake tensors have no data storage)."""
    return id(t.untyped_storage())


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype


@dataclass
class _Split:
    slot: int
    axis: int | None  # None: recomputed whole (split == 0)
    flattened: bool
    shape: torch.Size
    key: object  # store key of the kept tokens, or None when no token is kept


@dataclass
class _View:
    """A view of a tensor kept whole: rebuilt with the same geometry."""

    key: object
    geometry: tuple


class LayerActivations:
    """The saved tensors of one call of one layer (see the module docstring).

    ``split``: tokens ``[0, split)`` of split tensors are kept. ``recompute(capture)``,
    an attribute the caller sets (it usually needs the record itself, weakly), replays the
    layer on tokens ``[split, S)`` with autograd enabled under
    ``torch.autograd.graph.saved_tensors_hooks(capture, ...)``; it is called at most once,
    on the first unpack. ``external``: storages kept by reference (parameters, tables
    shared between layers). ``offload``: whether kept tensors go to host memory.
    ``later_shapes``: the shapes, slot by slot, that the layer saves on tokens
    ``[split, S)`` alone (needed for 0 < split < S; module docstring). ``describe``:
    names the layer in errors.
    """

    def __init__(self, store: ChunkStore, *, batch: int, tokens: int, split: int, offload: bool, external: set[int],
                 later_shapes: list | None = None, describe: str = "a layer"):
        self.store, self.batch, self.tokens, self.split = store, batch, tokens, split
        self.offload = offload
        self.external = external
        self.later_shapes, self.describe = later_shapes, describe
        self.recompute: Callable[[Callable], None] | None = None
        self._prefix = next(_KEYS)
        self._slots = 0
        self._seen: dict[tuple, tuple] = {}  # geometry -> (packed, tensor): a tensor saved twice is kept once
        self._whole: dict[int, tuple] = {}  # storage id -> (store key, tensor) of tensors kept whole
        self._splits: list[_Split] = []
        self._full: dict[int, torch.Tensor] | None = None  # slot -> tensor, once materialized
        self._whole_cache: dict[object, torch.Tensor] = {}
        self.previous: weakref.ref | None = None  # the layer below: prefetched when this one materializes
        self.input_storage: int | None = None  # storage id of the layer's input
        self.saved_bytes = {"whole": 0, "split": 0}  # full sizes of what was saved (Memo's S_attn, S_others)
        self.kept_sizes: list[tuple[int, torch.dtype]] = []  # (elements, dtype) of what it kept (parked or not)
        keys: list = []
        self._keys = keys
        weakref.finalize(self, _discard_all, store, keys)

    # ---- forward -------------------------------------------------------------------
    def keep(self, name: str, tensor: torch.Tensor, *, views: bool = False) -> None:
        """Keep ``tensor`` whole in the store under ``name``; with ``views``, every saved
        view of its storage is rebuilt from it instead of being split (the attention
        output and its LSE). ``tensor`` must own its storage from offset 0."""
        if views and not (tensor.is_contiguous() and tensor.storage_offset() == 0):
            raise ValueError("a tensor kept with its views must be contiguous and own its storage")
        key = (self._prefix, name)
        self._put(key, tensor)
        self._keys.append(key)
        if views:
            self._whole[storage_id(tensor)] = (key, tensor)  # held until finish_forward: its id stays unique
            self.saved_bytes["whole"] += tensor.nbytes

    def fetch(self, name: str) -> torch.Tensor:
        """A tensor kept with :meth:`keep`, on the device (fetched once per record)."""
        return self._fetch_whole((self._prefix, name))

    def finish_forward(self) -> None:
        """The layer's forward is over: forget the tensors held to recognize repeats."""
        self._seen.clear()
        self._whole.clear()

    def pack(self, t: torch.Tensor):
        slot = self._slots
        self._slots += 1
        try:
            storage = storage_id(t)
        except (RuntimeError, NotImplementedError):
            return t
        if storage in self.external:
            return t
        geometry = (storage,) + _geometry(t)
        if geometry in self._seen:  # held until finish_forward, so its id cannot be reused meanwhile
            return self._seen[geometry][0]
        if storage in self._whole:
            base = self._whole[storage][0]
            packed = _View(base, (tuple(t.shape), tuple(t.stride()), t.storage_offset()))
        else:
            axis, flattened = None, False
            if 0 < self.split < self.tokens:
                where = self._token_axis(slot, t)
                if where is None:
                    return t
                axis, flattened = where
            key = None
            if self.split > 0:
                key = self._key("split")
                kept = t if self.split == self.tokens else narrow_tokens(t, axis, flattened, self.batch, 0, self.split)
                if not self.offload and kept is not t:
                    kept = kept.contiguous()  # a view would keep the dropped tokens alive
                self._put(key, kept)
            packed = _Split(slot, axis, flattened, t.shape, key)
            self._splits.append(packed)
            if storage != self.input_storage:  # the layer input is counted apart (Memo's S_input)
                self.saved_bytes["split"] += t.numel() * t.element_size()
        self._seen[geometry] = (packed, t)
        return packed

    def _token_axis(self, slot: int, t: torch.Tensor) -> tuple[int, bool] | None:
        later = self.later_shapes[slot] if self.later_shapes is not None and slot < len(self.later_shapes) else None
        try:
            if later is None:
                raise NotTokenWise(tuple(t.shape), None)
            return token_axis(t.shape, later, self.batch, self.tokens)
        except NotTokenWise:
            raise LongtrainError(
                f"memo: {self.describe} saved a {tuple(t.shape)} tensor (slot {slot}) that is "
                f"{tuple(later) if later is not None else 'absent'} when the layer runs on {self.tokens - self.split} of "
                f"its {self.tokens} tokens; the layer is not token-wise outside attention, so memo cannot recompute "
                "part of its tokens: use memo:alpha=1 or checkpoint") from None

    # ---- backward ------------------------------------------------------------------
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if self._full is None:
            self._materialize()
        if isinstance(packed, _View):
            size, stride, offset = packed.geometry
            return self._fetch_whole(packed.key).as_strided(size, stride, offset)
        return self._full[packed.slot]

    def prefetch(self) -> None:
        """Start bringing this layer's kept tensors to the device."""
        for key in self._keys:
            self.store.prefetch(key)

    def _materialize(self) -> None:
        below = self.previous() if self.previous is not None else None
        if below is not None:
            below.prefetch()  # overlaps the copies of the next layer with this one's backward
        recomputed = self._recompute_rest() if self.split < self.tokens else {}
        full = {}
        for item in self._splits:
            parts = []
            if item.key is not None:
                parts.append(self.store.pop(item.key))
            if item.slot in recomputed:
                t = recomputed[item.slot]
                parts.append(t if item.axis is None else narrow_tokens(t, item.axis, item.flattened, self.batch, 0))
            joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=item.axis + item.flattened)
            full[item.slot] = joined.reshape(item.shape) if item.flattened else joined
        self._full = full

    def _recompute_rest(self) -> dict[int, torch.Tensor]:
        captured: list[torch.Tensor] = []
        wanted = {item.slot: item for item in self._splits}
        last = max(wanted, default=-1)

        def capture(t):
            slot = len(captured)
            # Detached, as checkpoint does: the recomputation's graph must die with it.
            captured.append(t.detach() if slot in wanted else None)
            if slot == last:  # nothing after this is needed: stop the replay here (as checkpoint does)
                raise _ReplayDone
            return None

        try:
            self.recompute(capture)
        except _ReplayDone:
            pass
        rest = self.tokens - self.split
        out = {}
        for slot, item in wanted.items():
            t = captured[slot] if slot < len(captured) else None
            expected = list(item.shape)
            if item.axis is not None:
                expected[item.axis] = self.batch * rest if item.flattened else rest
            if t is None or list(t.shape) != expected:
                got = None if t is None else tuple(t.shape)
                raise LongtrainError(
                    f"memo: the recomputation of {self.describe} saved {got} where its forward saved "
                    f"{tuple(item.shape)} (slot {slot}); the layer does not run the same way on part of its tokens: "
                    "use memo:alpha=1 or checkpoint")
            out[slot] = t
        return out

    # ---- helpers -------------------------------------------------------------------
    def _put(self, key, tensor: torch.Tensor) -> None:
        self.store.put(key, tensor, offload=self.offload)
        self.kept_sizes.append((tensor.numel(), tensor.dtype))

    def _key(self, kind: str):
        key = (self._prefix, kind, len(self._keys))
        self._keys.append(key)
        return key

    def _fetch_whole(self, key) -> torch.Tensor:
        if key not in self._whole_cache:
            self._whole_cache[key] = self.store.get(key)
        return self._whole_cache[key]


class _ReplayDone(Exception):
    """Raised inside the recomputation once the last tensor it must give is saved."""


def _discard_all(store: ChunkStore, keys: list) -> None:
    for key in keys:
        store.discard(key)
