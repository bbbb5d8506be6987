"""Small compatibility fixes for the range of transformers versions longtrain supports.

transformers 4.x detects "packed" batches (several documents in one row, told apart by
position ids restarting at 0) but returns its packed-sequence mask even when nothing is
packed; the caller then refuses SDPA's causal fast path and builds a dense s×s boolean
mask for every training forward pass (``use_cache=False``). transformers 5.x returns
None when the last position id shows no restart. We install that same check on older
versions. Only real tensors are inspected; fake tensors cannot be read, so the
simulator, whose batches are never packed, says so with :func:`assume_unpacked`.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

_STATE = threading.local()


@contextlib.contextmanager
def assume_unpacked():
    """Inside this block every batch holds one sequence per row (no packing)."""
    previous = getattr(_STATE, "unpacked", False)
    _STATE.unpacked = True
    try:
        yield
    finally:
        _STATE.unpacked = previous


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def install() -> None:
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - very old transformers build no such mask
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "_longtrain_checked", False):
        return

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if getattr(_STATE, "unpacked", False):
            return None
        packed = original(position_ids, *args, **kwargs)
        if isinstance(packed, torch.Tensor) and not _is_fake(packed) and not bool((packed[:, -1] != 0).any()):
            return None  # one sequence per row: no packing, keep the causal fast path
        return packed

    find_packed_sequence_indices._longtrain_checked = True
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
