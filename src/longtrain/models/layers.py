"""See through wrappers: the task model under a PEFT wrapper."""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The underlying task model (strips a PEFT wrapper)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
