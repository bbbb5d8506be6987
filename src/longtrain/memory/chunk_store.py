"""Where sequence chunks live between uses: on the device, or in host memory.

A :class:`ChunkStore` holds named tensors (a layer's K/V for one chunk, a checkpointed
layer input, a gradient accumulator). With ``offload=False`` it just keeps them on the
device. With ``offload=True`` it parks them in host memory and brings them back on
request:

- host buffers come from a :class:`PinnedPool` that allocates page-locked memory once
  and reuses it (pinning per tensor costs milliseconds each), exactly the bytes asked
  for (:mod:`longtrain.memory.pinned`: PyTorch's pinned allocator rounds to powers of two);
- on CUDA, device→host and host→device copies run on two side streams, ordered against
  the compute stream by events, so :meth:`ChunkStore.prefetch` starts a copy that
  overlaps the current computation and nothing synchronizes the host; fetched copies are
  allocated on the compute stream, so the allocator keeps one pool for them;
- on CPU the same calls run synchronously; under a
  :class:`~longtrain.memory.tracker.MemoryTracker` (exact measurement or the simulator)
  parked tensors count as host bytes and fetched copies as device bytes, which is what
  a GPU run would hold.

Host use is counted and bounded by ``host_budget``: exceeding it is a
:class:`~longtrain.errors.LongtrainError`, raised as soon as the store is asked to hold
more (the chunked pipeline checks its whole need before a step starts).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable

import torch

from ..errors import LongtrainError
from .pinned import host_empty
from .tracker import host_allocations
from .units import format_bytes

__all__ = ["ChunkStore", "PinnedPool"]


class PinnedPool:
    """Reusable host buffers, page-locked when CUDA is present.

    Buffers are keyed by (element count, dtype). A released buffer may still be the
    source of an in-flight host→device copy; its ``event`` is handed to the next user,
    whose copy stream waits on it before writing.
    """

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: dict[tuple, list[tuple[torch.Tensor, object]]] = defaultdict(list)
        self.allocated_bytes = 0

    def acquire(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        """A host tensor of ``shape``/``dtype`` and the event to wait on before writing it."""
        numel = 1
        for n in shape:
            numel *= n
        free = self._free[(numel, dtype)]
        if free:
            flat, event = free.pop()
            return flat.view(shape), event
        with host_allocations():
            flat = host_empty(numel, dtype, pin=self.pin)
        self.allocated_bytes += flat.nbytes
        return flat.view(shape), None

    def reserve(self, shape: torch.Size, dtype: torch.dtype) -> None:
        """Allocate a free buffer now for a later :meth:`acquire` of ``shape``/``dtype``
        (page-locking GBs is a slow system call: better in a step that measures nothing)."""
        with host_allocations():
            flat = host_empty(torch.Size(shape).numel(), dtype, pin=self.pin)
        self.allocated_bytes += flat.nbytes
        self._free[(flat.numel(), dtype)].append((flat, None))

    def release(self, tensor: torch.Tensor, event=None) -> None:
        self._free[(tensor.numel(), tensor.dtype)].append((tensor.view(-1), event))

    def clear(self) -> None:
        """Return every free buffer to the system."""
        self._free.clear()
        self.allocated_bytes = 0


@dataclass
class _Entry:
    host: torch.Tensor | None = None  # parked copy (offload) ...
    device: torch.Tensor | None = None  # ... or the device tensor (no offload / prefetched)
    written: object = None  # event: the host copy is complete
    fetched: object = None  # event: the prefetched device copy is complete
    fetched_on: object = None  # the stream the prefetched copy was allocated on (its memory's pool)


class ChunkStore:
    """Named tensors kept on ``device`` or parked in host memory (see the module docstring)."""

    def __init__(self, device: torch.device | str, *, offload: bool, host_budget: int | None = None,
                 pool: PinnedPool | None = None):
        self.device = torch.device(device)
        self.offload = offload
        self.host_budget = host_budget
        self._pool = pool if pool is not None else PinnedPool()
        self._entries: dict[Hashable, _Entry] = {}
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._to_host = torch.cuda.Stream(self.device)
            self._to_device = torch.cuda.Stream(self.device)

    # ---- writing -------------------------------------------------------------------
    def put(self, key: Hashable, tensor: torch.Tensor, *, offload: bool | None = None) -> None:
        """Keep ``tensor`` under ``key`` (replacing what was there). With offload, the
        caller may drop its reference at once: the copy is ordered after its producer."""
        self.discard(key)
        if not (self.offload if offload is None else offload):
            self._entries[key] = _Entry(device=tensor)
            return
        self._reserve(tensor.nbytes, key)
        host, wait_for = self._pool.acquire(tensor.shape, tensor.dtype)
        entry = _Entry(host=host)
        if self._cuda:
            self._to_host.wait_stream(torch.cuda.current_stream(self.device))
            if wait_for is not None:
                self._to_host.wait_event(wait_for)
            with torch.cuda.stream(self._to_host):
                host.copy_(tensor, non_blocking=True)
                entry.written = torch.cuda.Event()
                entry.written.record(self._to_host)
            tensor.record_stream(self._to_host)  # keep its memory until the copy is done
        else:
            host.copy_(tensor)
        self._entries[key] = entry

    def add_(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Accumulate ``tensor`` into ``key`` (store it if absent, and then the store owns
        it: later additions go into it in place). Used for gradients."""
        entry = self._entries.get(key)
        if entry is None:
            self.put(key, tensor)
        elif entry.host is None:
            entry.device.add_(tensor)
        else:  # parked: the fetched copy is the store's to add into and park again
            self.put(key, self.get(key).add_(tensor))

    # ---- reading -------------------------------------------------------------------
    def prefetch(self, key: Hashable) -> None:
        """Start bringing ``key`` to the device; a later :meth:`get` waits only for it."""
        entry = self._entries.get(key)
        if entry is None or entry.device is not None:
            return
        if self._cuda:
            # Allocated on the compute stream, whose kernels use and free it: the caching
            # allocator keeps a pool per stream, and copies allocating on their own stream
            # give it segments the compute stream cannot reuse (the likely cause of reserved
            # 1.17-1.29x allocated with offload on the H100). The memory may have been freed by a
            # kernel still queued there, so the copy waits for what is queued so far; the
            # prefetch is issued a chunk (a layer) ahead, which the copy still overlaps.
            compute = entry.fetched_on = torch.cuda.current_stream(self.device)
            entry.device = torch.empty_like(entry.host, device=self.device)
            self._to_device.wait_stream(compute)
            if entry.written is not None:
                self._to_device.wait_event(entry.written)
            with torch.cuda.stream(self._to_device):
                entry.device.copy_(entry.host, non_blocking=True)
                entry.fetched = torch.cuda.Event()
                entry.fetched.record(self._to_device)
        else:
            entry.device = entry.host.clone()  # a device-resident copy, as on a GPU

    def get(self, key: Hashable) -> torch.Tensor:
        """The tensor under ``key``, on the device (the store keeps its own copy)."""
        entry = self._entry(key)
        if entry.host is None:
            return entry.device
        self.prefetch(key)
        device_copy, entry.device = entry.device, None
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(entry.fetched)
            device_copy.record_stream(torch.cuda.current_stream(self.device))
        return device_copy

    def pop(self, key: Hashable) -> torch.Tensor:
        """:meth:`get` and forget ``key``."""
        tensor = self.get(key)
        self.discard(key)
        return tensor

    def discard(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is None or entry.host is None:
            return
        if self._cuda and entry.device is not None:
            # Fetched and never read: the stream it was allocated on, where its memory returns,
            # must not reuse it before the copy into it ends (no record_stream: that would hold
            # every fetched copy until the copies queued after it end too).
            entry.fetched_on.wait_event(entry.fetched)
            entry.device = None
        self.host_bytes -= entry.host.nbytes
        event = None
        if self._cuda:
            # The buffer may still feed an in-flight copy to the device, or (parked and never
            # fetched: the last chunk's K/V) still be written by its copy from the device; the
            # next user — perhaps another step's store, on other streams — waits for both.
            if entry.written is not None:
                self._to_device.wait_event(entry.written)
            event = torch.cuda.Event()
            event.record(self._to_device)
        self._pool.release(entry.host, event)

    def clear(self) -> None:
        for key in list(self._entries):
            self.discard(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # ---- accounting ----------------------------------------------------------------
    def _entry(self, key):
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"chunk store has no entry {key!r}") from None

    def _reserve(self, nbytes: int, key) -> None:
        if self.host_budget is not None and self.host_bytes + nbytes > self.host_budget:
            raise LongtrainError(
                f"host memory budget exceeded: parking {key!r} needs {format_bytes(self.host_bytes + nbytes)} "
                f"of host memory, the budget is {format_bytes(self.host_budget)}; raise the host budget, "
                "shorten the sequence, or offload less"
            )
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
