"""Exact accounting of live tensor storages, by category and by location.

:class:`MemoryTracker` is a ``TorchDispatchMode``: every ATen op's outputs pass through
it, each new storage is recorded with its size, and a weak reference tells us the
moment the storage is freed. This gives the exact number of bytes held by tensors at
every instant — on real CPU tensors (the "exact CPU measurement") and, unchanged, on
fake tensors (the simulator), so the two agree by construction.

Every storage carries a category — parameters, gradients, optimizer_state,
activations (allocated in forward), temporaries (allocated in backward or in the
optimizer step) — and a location: ``device`` or ``host``. Techniques that park tensors
in host memory call :func:`mark_host_resident`, so the simulator counts them as host
bytes. The peak is the device peak; the report reconstructs what was alive at that
instant from a small event log, so keeping the breakdown costs O(1) per allocation.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..thread_flag import ThreadFlag
from . import fake_replay

__all__ = [
    "CATEGORIES",
    "DEVICE",
    "HOST",
    "MemoryReport",
    "MemoryTracker",
    "host_allocations",
    "host_state_of",
    "in_backward",
    "mark_gradient",
    "mark_host_resident",
    "mark_weights",
    "mark_repeat",
    "untracked",
]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
DEVICE, HOST = "device", "host"

_ACTIVE: list["MemoryTracker"] = []
_HOST_ALLOCATION = ThreadFlag()
_UNTRACKED = ThreadFlag()
_HOST_STATE: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()  # host_state_of
_DEVICE_QUERY = torch.ops.prim.device.default  # tensor.device asked of a subclass (fake) tensor


def untracked():
    """Tensors created inside this block are not counted: a shape-only run on fake tensors
    that a step makes beside its own work (Memo learning which saved tensors carry tokens)."""
    return _UNTRACKED.raised()


def host_allocations():
    """Tensors created inside this block live in host memory (a pinned pool, say):
    active trackers count them as host bytes from the start."""
    return _HOST_ALLOCATION.raised()


def mark_repeat(kind: str) -> None:
    """Tell active trackers that one more repeat of a loop of ``kind`` begins — a chunk of
    the sequence, a block of attention history: loops whose length grows with the
    sequence. The simulator labels a step's phases with these marks to extrapolate it
    from small sizes (:mod:`longtrain.plan.simulate`); without a listener it does nothing."""
    for tracker in _ACTIVE:
        if tracker.on_repeat is not None:
            tracker.on_repeat(kind)


def mark_host_resident(tensor: torch.Tensor) -> None:
    """Declare that ``tensor`` lives in host memory (pinned or pageable), not on the device.

    Techniques call this for every tensor they offload; active trackers then count it
    as host bytes. Without a tracker it does nothing.
    """
    for tracker in _ACTIVE:
        tracker.set_location(tensor, HOST)


def host_state_of(model: torch.nn.Module) -> list:
    """The callables that give the host tensors holding part of ``model``'s parameters
    (weights streamed from host memory): a technique that moves them appends one, and
    trackers of the model (or a model containing it) count what they give as host-resident
    parameters."""
    return _HOST_STATE.setdefault(model, [])


def mark_weights(tensor: torch.Tensor) -> None:
    """Declare that ``tensor`` is a device copy of weights (streamed from host memory):
    active trackers count it under parameters. Without a tracker it does nothing."""
    for tracker in _ACTIVE:
        tracker.track(tensor, "parameters")


def mark_gradient(tensor: torch.Tensor) -> None:
    """Declare that ``tensor`` holds parameter gradients that autograd did not put in
    ``.grad`` (a float32 sum of them, say, or such a sum written back): active trackers
    count it under gradients. Without a tracker it does nothing."""
    for tracker in _ACTIVE:
        tracker.track(tensor, "gradients")


@dataclass
class TensorInfo:
    """One storage alive at the peak."""

    nbytes: int
    category: str
    location: str
    shape: tuple
    dtype: str
    origin: str  # the op (and module, when known) that allocated it


@dataclass
class MemoryReport:
    """What was alive at the device peak of the tracked window."""

    peak_device_bytes: int
    host_bytes_at_peak: int
    peak_host_bytes: int
    by_category: dict = field(default_factory=dict)  # category -> {"device": bytes, "host": bytes}
    largest: list = field(default_factory=list)  # TensorInfo, biggest first

    def device_bytes(self, category: str) -> int:
        return self.by_category.get(category, {}).get(DEVICE, 0)

    def host_bytes(self, category: str) -> int:
        return self.by_category.get(category, {}).get(HOST, 0)

    def to_dict(self) -> dict:
        data = asdict(self)
        for info in data["largest"]:
            info["shape"] = list(info["shape"])
        return data


class _Record:
    __slots__ = ("nbytes", "alloc_t", "free_t", "history", "shape", "dtype", "origin")

    def __init__(self, nbytes, t, category, location, shape, dtype, origin):
        self.nbytes = nbytes
        self.alloc_t = t
        self.free_t = None
        self.history = [(t, category, location)]  # (time, category, location) changes
        self.shape = shape
        self.dtype = dtype
        self.origin = origin

    @property
    def category(self) -> str:
        return self.history[-1][1]

    @property
    def location(self) -> str:
        return self.history[-1][2]

    def state_at(self, t: int) -> tuple[str, str]:
        state = self.history[0]
        for entry in self.history:
            if entry[0] > t:
                break
            state = entry
        return state[1], state[2]


def in_backward() -> bool:
    """Whether autograd's backward is running on this thread (a checkpoint's recomputation too)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _tracked_resize(storage, size):
    out = _ORIGINAL_RESIZE(storage, size)
    for tracker in list(_ACTIVE):
        tracker._on_storage_resize(storage)
    return out


def _patch_storage_resize() -> None:
    # Storage resizes bypass the dispatcher; FSDP2 frees its gathered parameters with one.
    torch.UntypedStorage.resize_ = _tracked_resize


def _unpatch_storage_resize() -> None:
    torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE


class MemoryTracker(TorchDispatchMode):
    """Track every live tensor storage while active (``with MemoryTracker(model, opt):``).

    ``model`` and ``optimizer`` are optional; when given, their parameters, buffers,
    gradients and optimizer state are registered on entry and re-categorized as they
    appear (gradients when autograd accumulates them, state after each optimizer step).
    Call :meth:`reset_peak` at the start of each measured step and :meth:`report` at
    its end.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self._lock = threading.RLock()
        self._live: dict[int, _Record] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._records: list[_Record] = []
        self._clock = 0
        self._current = {DEVICE: 0, HOST: 0}
        self._peak = 0
        self._peak_t = 0
        self._window_start = 0
        self._peak_host = 0
        self._phase = None  # the current label of set_phase()
        self.on_repeat = None  # called by mark_repeat(kind) (the simulator's phase labels)
        self._phases: dict = {}  # label -> [device peak, its time, host peak] since the last reset
        self._in_optimizer_step = False
        self._handles: list = []
        self._module_names: dict[int, str] = {}
        self._module_stack: list[str] = []

    # ---- public ----------------------------------------------------------------------
    @property
    def current_bytes(self) -> int:
        return self._current[DEVICE]

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        """Start a new measurement window at the current live set."""
        with self._lock:
            self._records = [r for r in self._records if r.free_t is None]
            self._peak = self._current[DEVICE]
            self._peak_host = self._current[HOST]
            self._peak_t = self._clock
            self._window_start = self._clock
            self._phases = {}
            self._note_phase()

    def trace(self):
        """The device lifetimes of the storages allocated since the last :meth:`reset_peak`,
        as :class:`~longtrain.memory.placement.Block` s for the memory planner (time in the
        tracker's event clock; storages still alive end after the last event)."""
        from .placement import Block

        with self._lock:
            end = self._clock + 1
            blocks = []
            for rec in self._records:
                if rec.alloc_t <= self._window_start:
                    continue  # allocated before the window (parameters, optimizer state): not the step's
                start = None
                for t, _category, location in rec.history:
                    if location == DEVICE and start is None:
                        start = t
                    elif location != DEVICE and start is not None:
                        blocks.append(Block(rec.nbytes, start, t, rec.origin))
                        start = None
                if start is not None:
                    blocks.append(Block(rec.nbytes, start, rec.free_t or end, rec.origin))
            return blocks

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Record ``tensor``'s storage (if new); optionally set its category."""
        record = self._record_for(tensor, category or self._phase_category())
        if record is not None and category is not None and record.category != category:
            self._change(record, category=category)

    def set_location(self, tensor: torch.Tensor, location: str) -> None:
        record = self._record_for(tensor, self._phase_category())
        if record is not None and record.location != location:
            self._change(record, location=location)

    def set_phase(self, label) -> None:
        """Label what runs from now on, until the next label (any hashable): :meth:`phase_peaks`
        keeps the device and host peaks of each label. The simulator labels the places of
        a step's repeating structure (which layer, which chunk) to extrapolate from them."""
        with self._lock:
            self._phase = label
            self._note_phase()

    def phase_peaks(self) -> dict:
        """``{label: (device peak, its time, host peak)}`` since the last reset, for the labels
        of :meth:`set_phase`; a label's peaks include what was alive when it was set. The
        time is the tracker's event clock: :meth:`report` ``(at=time)`` breaks it down."""
        with self._lock:
            return {label: tuple(entry) for label, entry in self._phases.items()}

    def report(self, top: int = 8, at: int | None = None) -> MemoryReport:
        """Breakdown of what was alive at the device peak since the last reset — or at time
        ``at`` of the tracker's event clock (a phase's peak, :meth:`phase_peaks`), whose
        live device bytes are then the report's ``peak_device_bytes``."""
        with self._lock:
            t = self._peak_t if at is None else at
            by_category = {c: {DEVICE: 0, HOST: 0} for c in CATEGORIES}
            alive = []
            for rec in self._records:
                if rec.alloc_t <= t and (rec.free_t is None or rec.free_t > t):
                    category, location = rec.state_at(t)
                    by_category[category][location] += rec.nbytes
                    alive.append((rec, category, location))
            alive.sort(key=lambda item: -item[0].nbytes)
            largest = [
                TensorInfo(r.nbytes, c, loc, r.shape, r.dtype, r.origin) for r, c, loc in alive[:top]
            ]
            host_at_peak = sum(v[HOST] for v in by_category.values())
            device = self._peak if at is None else sum(v[DEVICE] for v in by_category.values())
            return MemoryReport(device, host_at_peak, max(self._peak_host, host_at_peak), by_category, largest)

    # ---- context ---------------------------------------------------------------------
    def __enter__(self):
        super().__enter__()
        if not _ACTIVE:
            _patch_storage_resize()
        _ACTIVE.append(self)
        self._register_existing()
        self.reset_peak()
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _ACTIVE.remove(self)
        if not _ACTIVE:
            _unpatch_storage_resize()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY and type(args[0]) is FakeTensor:
            return args[0].fake_device  # most dispatches of a simulation: answered here, nothing allocated
        out = fake_replay.dispatch(func, args, kwargs or {})
        if _UNTRACKED.on:
            return out
        category = self._phase_category()
        for item in (out,) if type(out) is FakeTensor else tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._record_for(item, category, func)
        return out

    # ---- internals -------------------------------------------------------------------
    def _phase_category(self) -> str:
        if self._in_optimizer_step or in_backward():
            return "temporaries"
        return "activations"

    def _record_for(self, tensor: torch.Tensor, category: str, func=None) -> _Record | None:
        """``tensor``'s storage recorded (as allocated by ``func``, if new): its record."""
        if type(tensor) is FakeTensor:
            if tensor.fake_device.type == "meta":  # a fake meta tensor: no storage either
                return None
        else:
            if hasattr(tensor, "to_local"):  # a sharded (FSDP) tensor: this rank holds its shard
                tensor = tensor.to_local()
            if tensor.is_meta:  # no storage (e.g. another rank's layers under layer groups)
                return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, ... : not tracked
            return None
        with self._lock:
            record = self._live.get(id(storage))
            if record is not None:
                nbytes = storage.nbytes()
                if nbytes != record.nbytes:  # resized in place (out= ops, resize_)
                    self._current[record.location] += nbytes - record.nbytes
                    record.nbytes = nbytes
                    self._update_peaks()
                return record
            return self._new_record(storage, category, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                    self._origin(func))

    def _origin(self, func) -> str:
        """What allocates now: the op (``func``, or "" if not an op), in the innermost module known."""
        if func is None:
            return ""
        module = self._module_stack[-1] if self._module_stack else ""
        return f"{func.__name__}" + (f" in {module}" if module else "")

    def _new_record(self, storage, category: str, shape: tuple, dtype: str, origin: str) -> _Record | None:
        key, nbytes = id(storage), storage.nbytes()
        if nbytes == 0:
            return None
        self._clock += 1
        location = HOST if _HOST_ALLOCATION.on else DEVICE
        record = _Record(nbytes, self._clock, category, location, shape, dtype, origin)
        self._live[key] = record
        self._records.append(record)
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._on_free(key))
        self._current[location] += nbytes
        self._update_peaks()
        return record

    def _on_storage_resize(self, storage) -> None:
        """A storage resized outside any tensor op (FSDP frees and re-fills its gathered
        parameters this way): the old size is freed, the new one allocated."""
        with self._lock:
            old = self._live.get(id(storage))
            if old is not None and old.nbytes == storage.nbytes():
                return
            if old is not None:
                self._on_free(id(storage))
            category = old.category if old is not None else "parameters"
            shape = old.shape if old is not None else (storage.nbytes(),)
            self._new_record(storage, category, shape, old.dtype if old is not None else "uint8", "storage resize")

    def _on_free(self, key: int) -> None:
        with self._lock:
            record = self._live.pop(key, None)
            self._refs.pop(key, None)
            if record is None:
                return
            self._clock += 1
            record.free_t = self._clock
            self._current[record.location] -= record.nbytes

    def _change(self, record: _Record, category: str | None = None, location: str | None = None) -> None:
        with self._lock:
            self._clock += 1
            new_location = location or record.location
            if new_location != record.location:
                self._current[record.location] -= record.nbytes
                self._current[new_location] += record.nbytes
            record.history.append((self._clock, category or record.category, new_location))
            self._update_peaks()

    def _update_peaks(self) -> None:
        if self._current[DEVICE] > self._peak:
            self._peak = self._current[DEVICE]
            self._peak_t = self._clock
        self._peak_host = max(self._peak_host, self._current[HOST])
        if self._phase is not None:
            self._note_phase()

    def _note_phase(self) -> None:
        if self._phase is None:
            return
        device, host = self._current[DEVICE], self._current[HOST]
        entry = self._phases.get(self._phase)
        if entry is None:
            self._phases[self._phase] = [device, self._clock, host]
            return
        if device > entry[0]:
            entry[0], entry[1] = device, self._clock
        if host > entry[2]:
            entry[2] = host

    def _register_existing(self) -> None:
        if self.model is not None:
            self._module_names = {id(m): name for name, m in self.model.named_modules()}
            for p in self.model.parameters():
                self.track(p, "parameters")
                if p.grad is not None:
                    self.track(p.grad, "gradients")
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
            for b in self.model.buffers():
                self.track(b, "parameters")
            for module in self.model.modules():
                for host_tensors in _HOST_STATE.get(module, ()):
                    for tensor in host_tensors():
                        self.track(tensor, "parameters")
                        self.set_location(tensor, HOST)
            self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module))
            self._handles.append(torch.nn.modules.module.register_module_forward_hook(self._leave_module, always_call=True))
        if self.optimizer is not None:
            self._register_optimizer_state()
            for tensor in getattr(self.optimizer, "host_tensors", list)():  # an optimizer that keeps state on the host
                self.track(tensor, "optimizer_state")
                self.set_location(tensor, HOST)
            for tensor in getattr(self.optimizer, "device_state_tensors", list)():  # state made with it (float32 masters)
                self.track(tensor, "optimizer_state")
            self._handles.append(self.optimizer.register_step_pre_hook(self._before_step))
            self._handles.append(self.optimizer.register_step_post_hook(self._after_step))

    def _register_optimizer_state(self) -> None:
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.track(value, "optimizer_state")

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.track(param.grad, "gradients")

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._in_optimizer_step = True

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._in_optimizer_step = False
        self._register_optimizer_state()

    def _enter_module(self, module, args) -> None:
        name = self._module_names.get(id(module))
        if name is not None:
            self._module_stack.append(name or "model")

    def _leave_module(self, module, args, output) -> None:
        # always_call: also runs when a forward stops early (checkpoint recomputation
        # ends by raising once it has what backward needs), keeping the stack balanced.
        if id(module) in self._module_names and self._module_stack:
            self._module_stack.pop()
