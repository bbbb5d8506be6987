"""The CUDA caching allocator's setting for long-context steps: expandable segments.

A chunked step allocates tensors of a few chunk-sized shapes whose lifetimes interleave
(a chunk's K/V, a prefetched copy, a gradient accumulator), and host offload frees
device copies on side streams. With PyTorch's default allocator those frees leave
fixed-size segments half used, so the reserved peak of chunked attention with offload
lies well above the allocated one (docs/chunked_attention.md), and the reserved peak is
what runs out. Expandable segments grow one mapping per stream
instead, which keeps the reservation near the allocation (PyTorch's CUDA notes,
"Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF").

The allocator reads its setting once, at the first CUDA allocation, from
``PYTORCH_ALLOC_CONF`` or (older PyTorch) ``PYTORCH_CUDA_ALLOC_CONF``; the command line
sets it before that (:func:`prefer_expandable_segments`). A user's own setting in either
variable is kept as it is. Library users who want it set the variable themselves before
their first CUDA tensor.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping

__all__ = ["ALLOC_CONF_VARIABLES", "allocator_setting", "prefer_expandable_segments"]

ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def user_allocator_setting(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """The allocator setting the user gave in the environment, or None."""
    return next((environ[name] for name in ALLOC_CONF_VARIABLES if environ.get(name)), None)


def prefer_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Ask for expandable segments unless the user configured the allocator or CUDA has
    already allocated (then the setting is read already). True when it was set here."""
    if user_allocator_setting(environ) is not None or _cuda_initialized():
        return False
    # The older name: read by every PyTorch longtrain supports (2.6 on), the newer by 2.9 on.
    environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    return True


def allocator_setting(environ: MutableMapping[str, str] = os.environ) -> str:
    """What the allocator was asked for, for a run's summary ("default" when nothing)."""
    return user_allocator_setting(environ) or "default"


def _cuda_initialized() -> bool:
    if "torch" not in sys.modules:  # not imported: nothing can have allocated
        return False
    import torch

    return torch.cuda.is_initialized()
