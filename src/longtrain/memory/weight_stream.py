"""Frozen weights kept in host memory and brought to the device a layer at a time.

A model whose layers do not train (LoRA's base, a mixture of experts' frozen experts)
needs its layers' weights on the device only while a layer computes: in its forward, its
recomputation and its backward. :class:`WeightStream` keeps each group's (a decoder
layer's) frozen parameters in pinned host memory and a window of groups on the device:
the one in use and the next ``ahead`` in the direction the pass runs (up the model in
forward, down in backward), the next ones copied on a side stream while this one
computes.

Where a group is on the device, its parameters' ``.data`` is the device copy; elsewhere,
the host copy — so code reading a parameter directly sees the values it always saw, and
a state dict holds the real weights. What would pin a device copy past its window is the
autograd graph: an op saves its weight (or a view of it, ``W.t()``, an expert's slice)
for backward. :meth:`WeightStream.saved_tensor_hooks` packs such a tensor as a reference
(group, parameter, view geometry) and unpacking rebuilds the view on a fresh device copy.
The hooks are pushed where each owning module runs, innermost, so they compose with the
hooks of whatever runs around them (checkpointing, offload): they hand every other tensor
to those hooks untouched. The values are the same bytes, the ops the same ops: the step
is bit for bit the unstreamed one.

Shapes: a group is a list of parameters of any shapes; a saved weight view is any
(size, stride, offset) of one of them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from .pinned import host_empty
from .token_swap import storage_id
from .tracker import mark_host_resident, mark_weights

__all__ = ["WeightStream"]


@dataclass(frozen=True)
class _WeightView:
    """What the graph keeps of a saved streamed weight (or a view of it)."""

    group: int
    index: int
    size: tuple
    stride: tuple
    offset: int


@dataclass(frozen=True)
class _Outer:
    """A tensor handed to the hooks that ran around ours, and their unpack."""

    packed: object
    unpack: object


class _Copies:
    """One group's device copies, the event their copy ends with (None: done), and the
    stream they were allocated on."""

    def __init__(self, tensors: list[torch.Tensor], ready=None, stream=None):
        self.tensors, self.ready, self.stream = tensors, ready, stream
        self.installed = False  # the group's parameters hold these as .data


class WeightStream:
    """The frozen parameters of ``groups`` in host memory, ``ahead`` + 1 groups of them on
    ``device`` at a time (see the module docstring)."""

    def __init__(self, groups: list[list[torch.nn.Parameter]], device: torch.device, *, ahead: int = 1):
        self.groups, self.device, self.ahead = groups, torch.device(device), ahead
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self.host: list[list[torch.Tensor]] = [[self._to_host(p) for p in group] for group in groups]
        self._resident: dict[int, _Copies] = {}  # group -> its device copies
        # A resident copy's storage (and a fake mode's view of it) -> (group, index, the
        # storage: held, so that its id is not reused while the entry lives).
        self._by_storage: dict[int, tuple[int, int, object]] = {}
        # Real weights (not a simulation's fake ones): a shape-only pass in a fake mode over
        # them (Memo's) gets real copies, made outside that mode.
        self._real = not any(isinstance(t, FakeTensor) for group in self.host for t in group)
        self.settled = False  # every weight back on the device for good (settle())
        self._last: int | None = None  # the group ensured last, and the way the pass runs
        self._direction = 1
        self._lock = threading.RLock()  # forward on the main thread, backward on autograd's device thread
        self._pushed = threading.local()
        self.fetches = 0  # groups copied to the device so far (for tests and reports)

    # ---- placement ---------------------------------------------------------------------
    def _to_host(self, param: torch.nn.Parameter) -> torch.Tensor:
        host = host_empty(param.numel(), param.dtype, pin=self._cuda).view(param.shape)
        host.copy_(param.data)
        mark_host_resident(host)
        param.data = host
        return host

    def host_tensors(self) -> list[torch.Tensor]:
        """Every host copy (what a memory tracker counts as host-resident parameters)."""
        return [t for group in self.host for t in group]

    def _fetch(self, group: int) -> _Copies:
        hosts = self.host[group]
        self.fetches += 1
        if not self._cuda:
            tensors = [t.clone() for t in hosts]  # a device-resident copy, as on a GPU
            for tensor in tensors:
                mark_weights(tensor)
            return _Copies(tensors)
        # Allocated on the compute stream, which uses and frees them; the copy waits for
        # the kernels queued there (the memory may have been freed by one of them).
        compute = torch.cuda.current_stream(self.device)
        tensors = [torch.empty_like(t, device=self.device) for t in hosts]
        for tensor in tensors:
            mark_weights(tensor)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            for device_copy, host in zip(tensors, hosts):
                device_copy.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return _Copies(tensors, ready, compute)

    def _drop(self, group: int) -> None:
        copies = self._resident.pop(group)
        for key in [key for key, (g, _, _) in self._by_storage.items() if g == group]:
            del self._by_storage[key]
        if copies.ready is not None:  # fetched and never used: the copy must end before its memory is reused
            copies.stream.wait_event(copies.ready)
        for param, host in zip(self.groups[group], self.host[group]):
            param.data = host

    def ensure(self, group: int) -> list[torch.Tensor]:
        """Put ``group`` on the device (its parameters' ``.data`` the device copies), drop
        the groups outside the window, and start copying the next ``ahead`` ones the way
        the pass runs: the way the group last changed — not whether autograd's backward
        runs, which a chunked engine's recomputations and backward alternate within a layer
        — turned at either end of the model, where one way has no groups."""
        if self._real and detect_fake_mode() is not None:
            with unset_fake_temporarily():
                return self.ensure(group)
        with self._lock:
            if self._last is not None and group != self._last:
                self._direction = 1 if group > self._last else -1
            elif group == 0 or group == len(self.groups) - 1:
                self._direction = 1 if group == 0 else -1
            self._last = group
            window = [group + self._direction * k for k in range(self.ahead + 1)]
            window = [g for g in window if 0 <= g < len(self.groups)]
            for other in [g for g in self._resident if g not in window]:
                self._drop(other)
            copies = self._resident.get(group)
            if copies is None:
                copies = self._resident[group] = self._fetch(group)
            if copies.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(copies.ready)
                for tensor in copies.tensors:
                    tensor.record_stream(torch.cuda.current_stream(self.device))
                copies.ready = None
            if not copies.installed:  # the parameters' .data: the device copies
                for index, (param, tensor) in enumerate(zip(self.groups[group], copies.tensors)):
                    param.data = tensor
                    self._remember(tensor, group, index)
                copies.installed = True
            for g in window[1:]:
                if g not in self._resident:
                    self._resident[g] = self._fetch(g)
            return copies.tensors

    def _remember(self, tensor: torch.Tensor, group: int, index: int) -> None:
        storage = tensor.untyped_storage()
        self._by_storage[id(storage)] = (group, index, storage)

    def clear(self) -> None:
        """Every group back to host memory only."""
        with self._lock:
            for group in list(self._resident):
                self._drop(group)

    def settle(self) -> None:
        """Every weight back on the device for good and the streaming off (before adapters
        are merged into the weights, which then no longer match the host copies)."""
        with self._lock:
            self.clear()
            for group, hosts in zip(self.groups, self.host):
                for param, host in zip(group, hosts):
                    param.data = host.to(self.device, copy=True)  # a device tensor (a copy on the CPU too)
            self.host = [[] for _ in self.groups]
            self.settled = True

    # ---- the graph's references --------------------------------------------------------
    def saved_tensor_hooks(self):
        """Hooks for the saved tensors of a module that reads a group's weights: a streamed
        weight (or a view of one) is kept as a reference; every other tensor goes to the
        hooks that were active when these were pushed (or is kept as it is)."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(tensor):
            where = self._by_storage.get(storage_id(tensor))
            if where is not None:
                return _WeightView(*where[:2], tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())
            return tensor if outer is None else _Outer(outer[0](tensor), outer[1])

        def unpack(packed):
            if isinstance(packed, _WeightView):
                base = self.ensure(packed.group)[packed.index]
                return base.as_strided(packed.size, packed.stride, packed.offset)
            if isinstance(packed, _Outer):
                return packed.unpack(packed.packed)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def entering(self, group: int) -> None:
        """A module of ``group`` starts its forward: its weights on the device, the hooks pushed."""
        if not self.settled:
            copies = self.ensure(group)
            mode = detect_fake_mode() if self._real else None
            if mode is not None:  # a shape-only pass over the real weights (Memo's): its views of them are weights too
                for index, tensor in enumerate(copies):
                    self._remember(mode.from_tensor(tensor), group, index)
        pushed = getattr(self._pushed, "stack", None)
        if pushed is None:
            pushed = self._pushed.stack = []
        enabled = not self.settled and torch._C._autograd._saved_tensors_hooks_is_enabled()
        hooks = self.saved_tensor_hooks() if enabled else None
        if hooks is not None:
            hooks.__enter__()
        pushed.append(hooks)

    def leaving(self) -> None:
        """That module's forward ended (or raised): its hooks popped."""
        hooks = self._pushed.stack.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)

