"""What plans and simulations ask of the backprop engine: plain autograd over the whole
sequence, which :class:`~longtrain.costs.EngineCosts`' defaults describe."""

from __future__ import annotations

from ...costs import EngineCosts

__all__ = ["BackpropCosts"]


class BackpropCosts(EngineCosts):
    """Plain autograd: the defaults."""
