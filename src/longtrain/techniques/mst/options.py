"""``mst``'s options: which parts run in mini-sequences (the MLPs, the LM head and loss) and
how many tokens or chunks each takes (validated when built)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import validate


@dataclass
class MsTOptions:
    """Knobs of the mini-sequence technique."""

    mlp_chunk: int | None = None  # tokens per MLP chunk; default: the hidden size (half a chunked engine's chunk)
    loss_chunks: int | None = None  # LM-head mini-sequences; default: vocab / hidden
    mlp: bool = True  # tile the MLPs
    head: bool = True  # chunk the LM head + loss

    def __post_init__(self):
        validate.positive_int("mst", "mlp_chunk", self.mlp_chunk, allow_none=True)
        validate.positive_int("mst", "loss_chunks", self.loss_chunks, allow_none=True)
        validate.flag("mst", "mlp", self.mlp)
        validate.flag("mst", "head", self.head)
