"""What plans and simulations ask of the chunked engines (:mod:`longtrain.costs`): SeCO
and SpaCO here, FPDT's own in :mod:`.fpdt_costs`."""

from __future__ import annotations

from ..costs import EngineCosts, StepWork

__all__ = ["ChunkedCosts", "SeCOCosts", "SpaCOCosts"]


class ChunkedCosts(EngineCosts):
    """An engine that runs the sequence in chunks of ``options.chunk`` tokens and recomputes
    every layer's forward in backward, chunk by chunk (as checkpointing does)."""

    attention_rate = "block_attention"  # the MachineRates field its attention kernels run at
    extends_along_tokens = False  # along its chunks instead (chunk())

    def serves(self, adapter_class, options) -> bool:
        return adapter_class.has_attention  # chunked attention

    def chunk(self, options) -> int | None:
        return options.chunk

    def describe(self, work: StepWork, options) -> None:
        work.chunk = options.chunk
        work.recomputes_layers = True
        work.mlp_forward_charged = True  # the recomputed chunk's MLP output is read by the next layer
        work.attention_rate = getattr(work.rates, self.attention_rate)


class SeCOCosts(ChunkedCosts):
    """SeCO: chunk-major, each block merging and accumulating a K/V gradient; a chunk's
    logits are formed in its no-grad pass and again in its recomputation."""

    attention_rate = "chunkwise_attention"

    def add_work(self, work: StepWork, options) -> None:
        work.matmul += work.head_fwd


class SpaCOCosts(SeCOCosts):
    """SpaCO: as SeCO; its simulations backpropagate the last ``budget`` chunks, so small
    simulations hold two more."""

    def fewest_chunks(self, options) -> int:
        return options.budget + 2
