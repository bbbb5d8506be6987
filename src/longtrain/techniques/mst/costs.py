"""What plans and simulations ask of ``mst``: :class:`MsTCosts` (the tiled MLP's extra
forward, the chunked head)."""

from __future__ import annotations

from ...costs import StepWork, TechniqueCosts
from ...models.adapters import describe_model
from .options import MsTOptions


class MsTCosts(TechniqueCosts):
    """MsT: the tiled MLP's backward runs its forward once more (where nothing else recomputes
    it) at a measured efficiency; the chunked head's weight gradient at its own rate. Same
    memory or less for every strategy, so a plan adds it to every candidate."""

    in_every_candidate = True

    def serves(self, adapter_class, options: MsTOptions) -> bool:
        return options.mlp or adapter_class.has_attention  # untiled: decoders' MLPs (an SSM has none)

    def variants_on_default_engine(self) -> tuple:
        return (MsTOptions(mlp=False),)  # the head chunked, the MLP whole: no extra MLP forward

    def held_at_once(self, config, tokens: int, options: MsTOptions, item: int, batch: int) -> int:
        if options.mlp:
            return 0
        # An untiled MLP's backward over every token a layer runs at once: its gate and up
        # outputs and their product (what down_proj's weight gradient reads), all saved.
        shape = describe_model(config)
        width = max(((block.active if block.is_moe else 1) * block.width + block.shared_width
                     for block in shape.feed_forward), default=0)
        return 3 * batch * tokens * width * item

    def describe(self, work: StepWork, options: MsTOptions) -> None:
        work.tiled_mlp, work.chunked_head = options.mlp, options.head

    def add_work(self, work: StepWork, options: MsTOptions) -> None:
        if work.tiled_mlp and not work.mlp_forward_charged:
            work.add_mlp_forwards(1)
