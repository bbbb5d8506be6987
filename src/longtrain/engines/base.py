"""What every engine is handed: the settled strategy of a model, its adapter, and the loss head.

:func:`longtrain.apply` builds one :class:`EngineContext` per model — after the
strategy's conflicts were settled and its techniques installed — and
:func:`longtrain.step` hands it to the engine on every step. Engines take everything
from it; nothing is read from attributes of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..memory.chunk_store import PinnedPool
from ..models.adapters import DecoderAdapter, Head
from ..ops.chunked_loss import chunked_causal_lm_loss
from ..ops.loss import logits_loss

if TYPE_CHECKING:  # the strategy module sits above the engines; only its type is named here
    from ..strategy import Strategy


@dataclass(frozen=True)
class HeadLoss:
    """The LM head and the next-token loss, for hidden states of a whole sequence or a chunk.

    ``fused``: the chunked linear + cross-entropy op (:mod:`longtrain.ops.chunked_loss`),
    which never keeps the logits, in ``chunks`` mini-sequences (None: V/d, MsT's rule);
    it needs the head as a plain ``nn.Linear``. Otherwise the logits come from the head
    module (whatever wraps it, LoRA included) and autograd keeps them, as stock does.
    """

    head: Head
    fused: bool
    chunks: int | None = None

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor, num_label_tokens: int) -> torch.Tensor:
        """Sum of the token losses of ``hidden`` (B, S, d) against position-aligned
        ``targets`` (B, S), divided by ``num_label_tokens``."""
        head = self.head
        if not self.fused:
            return logits_loss(head.module(hidden), targets, num_label_tokens,
                               logit_scale=head.logit_scale, softcap=head.softcap)
        linear = head.linear
        return chunked_causal_lm_loss(
            hidden, linear.weight, targets, bias=linear.bias, shifted=True, num_label_tokens=num_label_tokens,
            chunks=self.chunks, logit_scale=head.logit_scale, softcap=head.softcap,
        )


@dataclass
class EngineContext:
    """A model with its strategy applied: what :func:`longtrain.step` gives the engine."""

    strategy: "Strategy"
    adapter: DecoderAdapter
    pool: PinnedPool = field(default_factory=PinnedPool)  # pinned host buffers, reused across steps
    parallel: Any = None  # how the model is split over processes (a LayerGroup under layer groups)

    @property
    def model(self) -> torch.nn.Module:
        return self.adapter.model

    @property
    def engine_options(self) -> Any:
        return self.strategy.engine_options

    def technique(self, name: str) -> Any:
        """The options of technique ``name`` when the strategy has it, else None."""
        return self.strategy.techniques.get(name)

    def head_loss(self, per_chunk: bool) -> HeadLoss:
        """The head + loss this strategy asks for. With MsT's head: the fused op in its
        mini-sequences. Otherwise, over a chunk (``per_chunk``) the fused op on the whole
        chunk where the head allows, and over a whole sequence the stock full logits."""
        head = self.adapter.head()
        mst = self.technique("mst")
        if mst is not None and mst.head:
            return HeadLoss(head, fused=True, chunks=mst.loss_chunks)
        if per_chunk and head.linear is not None:
            return HeadLoss(head, fused=True, chunks=1)
        return HeadLoss(head, fused=False)
