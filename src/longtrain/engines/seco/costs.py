"""What plans and simulations ask of the SeCO engine (:mod:`longtrain.costs`)."""

from __future__ import annotations

from ...costs import StepWork
from ..chunked.costs import ChunkedCosts

__all__ = ["SeCOCosts"]


class SeCOCosts(ChunkedCosts):
    """SeCO: chunk-major, each block merging and accumulating a K/V gradient; a chunk's
    logits are formed in its no-grad pass and again in its recomputation."""

    attention_rate = "chunkwise_attention"

    def describe(self, work: StepWork, options) -> None:
        super().describe(work, options)
        work.chunk_major = True

    def add_work(self, work: StepWork, options) -> None:
        work.matmul += work.head_fwd
