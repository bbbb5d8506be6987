"""What plans and simulations ask of ``mst``: :class:`MsTCosts` (the tiled MLP's extra
forward, the chunked head)."""

from __future__ import annotations

from ...costs import StepWork, TechniqueCosts
from .options import MsTOptions


class MsTCosts(TechniqueCosts):
    """MsT: the tiled MLP's backward runs its forward once more (where nothing else recomputes
    it) at a measured efficiency; the chunked head's weight gradient at its own rate. Same
    memory or less for every strategy, so a plan adds it to every candidate."""

    in_every_candidate = True

    def describe(self, work: StepWork, options: MsTOptions) -> None:
        work.tiled_mlp, work.chunked_head = options.mlp, options.head

    def add_work(self, work: StepWork, options: MsTOptions) -> None:
        if work.tiled_mlp and not work.mlp_forward_charged:
            work.matmul += work.mlp_fwd
