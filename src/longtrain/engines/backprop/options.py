"""The backprop engine's options: none."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BackpropOptions"]


@dataclass
class BackpropOptions:
    """Plain autograd has no knobs."""
