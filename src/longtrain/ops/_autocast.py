"""Recomputation in backward must see the autocast state the forward saw (as
torch.utils.checkpoint does), or it would recompute a different function."""

from __future__ import annotations

import contextlib

import torch


def capture(device: torch.device) -> tuple[str, bool, torch.dtype]:
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def restore(state: tuple[str, bool, torch.dtype]):
    kind, enabled, dtype = state
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=kind, dtype=dtype)


def off(device: torch.device):
    """Autocast switched off for ``device`` where it is on: work that must run in its
    operands' own dtypes, as autograd's backward (outside autocast) would run it."""
    kind = device.type
    if kind not in ("cpu", "cuda") or not torch.is_autocast_enabled(kind):
        return contextlib.nullcontext()
    return torch.autocast(device_type=kind, enabled=False)
