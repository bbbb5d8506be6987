"""What plans and simulations ask of the SpaCO engine (:mod:`longtrain.costs`)."""

from __future__ import annotations

from ..seco.costs import SeCOCosts

__all__ = ["SpaCOCosts"]


class SpaCOCosts(SeCOCosts):
    """SpaCO: as SeCO; its simulations backpropagate the last ``budget`` chunks, so small
    simulations hold two more."""

    def fewest_chunks(self, options) -> int:
        return options.budget + 2
