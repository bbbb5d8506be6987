"""Page-locked host buffers of exactly the size asked for.

PyTorch's pinned allocator (``pin_memory=True``) rounds every allocation up to the next
power of two and keeps freed blocks cached for the rest of the process. A budget that
counts the bytes asked for then understates what is pinned by up to 2×: Llama-3-8B's
embedding, 2.0 GiB as float32 master weights, pins 4 GiB; a 100K-token layer input of
781 MiB pins 1 GiB; Memo's α-sized buffers any amount up to twice theirs. Pinned pages
cannot be swapped out, so the gap is where a run meets the kernel's out-of-memory
killer, with no message.

:func:`host_empty` pins its own: anonymous memory mapped by the kernel (page-aligned,
exactly the requested pages), page-locked with ``cudaHostRegister``, unlocked when the
last tensor viewing it is gone. Copies to and from it are asynchronous like those of
PyTorch's pinned memory (the driver knows the pages are locked). The pools that reuse
these buffers (:class:`~longtrain.memory.chunk_store.PinnedPool`) keep them for their
own lifetime, so registering costs once, as it does with PyTorch's cache.
"""

from __future__ import annotations

import mmap
import weakref

import torch
from torch._guards import detect_fake_mode

from .tracker import mark_host_resident

__all__ = ["host_empty"]

_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault


def _cudart():
    """The CUDA runtime bindings (a seam: tests stand in a fake on machines without CUDA)."""
    return torch.cuda.cudart()


def _synchronize() -> None:
    torch.cuda.synchronize()


def _clear_last_error() -> None:
    """Take a failed runtime call's error off this thread. The runtime keeps the last error
    of any call until it is read, and PyTorch reads it after each kernel launch — so the
    next kernel in this thread would fail with the registration's error as its own. A
    one-element kernel's launch check reads it here instead (and raises it, ignored)."""
    try:
        torch.zeros(1, device="cuda")
    except Exception:  # the error read (or no CUDA at all): nothing more to do
        pass


def host_empty(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements, page-locked (exactly its bytes) when ``pin``
    — not in a simulation (fake tensors): nothing is allocated there, so nothing is locked."""
    if pin and detect_fake_mode() is not None:
        pin = False
    if not pin or numel == 0:
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes)  # anonymous, zero-filled, page-aligned
    # The tensor's storage holds the view, the view's finalizer the mapping: the pages stay
    # mapped until they are unlocked (a finalizer on the mapping itself would run after munmap).
    view = memoryview(region)
    tensor = torch.frombuffer(view, dtype=dtype, count=numel)
    address = tensor.data_ptr()
    cudart = _cudart()
    status = cudart.cudaHostRegister(address, nbytes, _REGISTER_DEFAULT)
    if int(status) != 0:  # e.g. a locked-memory limit: PyTorch's allocator may still get pages
        _clear_last_error()
        del tensor
        view.release()
        region.close()
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True)
    # Unlock when the last tensor on the pages goes. A copy may still be reading or writing
    # them (a pool dropped mid-step), so the device finishes its queued work first; pools
    # free their buffers rarely (when cleared), so the wait costs nothing in a step. Not at
    # exit: the process's memory goes back whole, and the CUDA runtime may be torn down already.
    finalizer = weakref.finalize(view, _unregister, cudart, address, region)
    finalizer.atexit = False
    mark_host_resident(tensor)  # trackers see no allocating op for this storage
    return tensor


def _unregister(cudart, address: int, region: mmap.mmap) -> None:
    """Unlock the pages at ``address``. ``region``, their mapping, is held by the finalizer
    until this returns: unmapped only after the unlock."""
    try:
        _synchronize()
        if int(cudart.cudaHostUnregister(address)) != 0:
            _clear_last_error()
    except Exception:  # the CUDA context is gone (interpreter shutdown): nothing is left to unlock
        pass
