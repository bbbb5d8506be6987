"""Page-locked host buffers of exactly the size asked for.

PyTorch's pinned allocator (``pin_memory=True``) rounds every allocation up to the next
power of two and keeps freed blocks cached for the rest of the process. A budget that
counts the bytes asked for then understates what is pinned by up to 2×: Llama-3-8B's
embedding, 2.0 GiB as float32 master weights, pins 4 GiB; a 100K-token layer input of
781 MiB pins 1 GiB; Memo's α-sized buffers any amount up to twice theirs. Pinned pages
cannot be swapped out, so the gap is where a run meets the kernel's out-of-memory
killer, with no message (a likely part of Memo's kill at 128K tokens on the H100).

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

from .tracker import mark_host_resident

_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault


def _cudart():
    """The CUDA runtime bindings (a seam: tests stand in a fake on machines without CUDA)."""
    return torch.cuda.cudart()


def _synchronize() -> None:
    torch.cuda.synchronize()


def host_empty(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements, page-locked (exactly its bytes) when ``pin``."""
    if not pin or numel == 0:
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes)  # anonymous, zero-filled, page-aligned
    tensor = torch.frombuffer(region, dtype=dtype, count=numel)  # the storage holds the mapping
    address = tensor.data_ptr()
    cudart = _cudart()
    status = cudart.cudaHostRegister(address, nbytes, _REGISTER_DEFAULT)
    if int(status) != 0:  # e.g. a locked-memory limit: PyTorch's allocator may still get pages
        del tensor
        region.close()
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True)
    # Unlock when the mapping goes, i.e. after every tensor on it: the storage keeps the
    # mapping alive. A copy may still be reading or writing the pages (a pool dropped
    # mid-step), so the device finishes its queued work first; pools free their buffers
    # rarely (when cleared), so the wait costs nothing in a step. Not at exit: the
    # process's memory goes back whole, and the CUDA runtime may be torn down already.
    finalizer = weakref.finalize(region, _unregister, cudart, address)
    finalizer.atexit = False
    mark_host_resident(tensor)  # trackers see no allocating op for this storage
    return tensor


def _unregister(cudart, address: int) -> None:
    try:
        _synchronize()
        cudart.cudaHostUnregister(address)
    except Exception:  # the CUDA context is gone (interpreter shutdown): nothing is left to unlock
        pass
