"""What every engine is handed: the settled strategy of a model, its adapter, and the loss head.

:func:`longtrain.apply` builds one :class:`EngineContext` per model — after the
strategy's conflicts were settled and its techniques installed — and
:func:`longtrain.step` hands it to the engine on every step. Engines take everything
from it; nothing is read from attributes of the model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..memory.chunk_store import PinnedPool
from ..memory.units import pinned_host_budget
from ..models.adapters import DecoderAdapter, Head
from ..ops.chunked_loss import GradientCarry, chunked_causal_lm_loss
from ..ops.loss import logits_loss

if TYPE_CHECKING:  # the strategy module sits above the engines; only its type is named here
    from ..strategy import Strategy

__all__ = ["EngineContext", "HeadLossCall", "LMHeadModule"]


class LMHeadModule(nn.Module):
    """The LM head and the next-token loss as one module.

    A module, so that sharded data parallelism (FSDP2) gathers the head's weights around
    each call and reduces their gradients after it, like any layer — the fused loss reads
    the weight matrix directly, which only a call of the module that holds it makes
    whole. It is not registered in the model: the head stays where the model has it.
    """

    def __init__(self, head: Head):
        super().__init__()
        self.head = head.module
        self.logit_scale, self.softcap = head.logit_scale, head.softcap
        self.plain_linear = head.linear is not None  # decided before any wrapper (FSDP) changes its class

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor, num_label_tokens: int, fused: bool,
                chunks: int | None, carry: GradientCarry | None = None) -> torch.Tensor:
        if not fused:
            return logits_loss(self.head(hidden), targets, num_label_tokens, logit_scale=self.logit_scale, softcap=self.softcap)
        return chunked_causal_lm_loss(
            hidden, self.head.weight, targets, bias=self.head.bias, shifted=True, num_label_tokens=num_label_tokens,
            chunks=chunks, logit_scale=self.logit_scale, softcap=self.softcap, carry=carry,
        )


@dataclass(frozen=True)
class HeadLossCall:
    """How one call of :class:`LMHeadModule` runs: the head + loss for hidden states of a whole sequence or a chunk.

    ``fused``: the chunked linear + cross-entropy op (:mod:`longtrain.ops.chunked_loss`),
    which never keeps the logits, in ``chunks`` mini-sequences (None: V/d, MsT's rule);
    it needs the head as a plain ``nn.Linear``. Otherwise the logits come from the head
    module (whatever wraps it, LoRA included) and autograd keeps them, as stock does.
    """

    module: LMHeadModule
    fused: bool
    chunks: int | None = None

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor, num_label_tokens: int,
                 carry: GradientCarry | None = None) -> torch.Tensor:
        """Sum of the token losses of ``hidden`` (B, S, d) against position-aligned
        ``targets`` (B, S), divided by ``num_label_tokens``. ``carry`` (fused only): the
        head's gradients summed over calls (:class:`~longtrain.ops.chunked_loss.GradientCarry`)."""
        return self.module(hidden, targets, num_label_tokens, self.fused, self.chunks, carry)


@dataclass
class EngineContext:
    """A model with its strategy applied: what :func:`longtrain.step` gives the engine."""

    strategy: "Strategy"
    adapter: DecoderAdapter
    pool: PinnedPool = field(default_factory=PinnedPool)  # pinned host buffers, reused across steps
    parallel: Any = None  # how the model is split over processes (a LayerGroup under layer groups)
    sequence_parallel: Any = None  # the SequenceParallel group under Ulysses (engines/sequence_parallel.py)
    lm_head_module: LMHeadModule | None = None  # built from the adapter's head on first use
    notes: dict = field(default_factory=dict)  # settings techniques measured or chose (memo's alpha), for reports
    # Bytes of host memory the run may pin: the default budget of every technique and engine
    # that parks tensors there (Memo, kept attention, chunk stores). A real run's is this
    # machine's (half its physical memory); a simulation's is the simulated machine's
    # (--host-memory), None where none was named: unbounded.
    host_memory: int | None = field(default_factory=pinned_host_budget)
    # Bytes a technique holds in host memory for the whole run (streamed weights): out of
    # host_memory before anything parks there (host_room()).
    host_held: int = 0
    # A mixture of experts' routers, counted for the load-balancing loss where the config
    # adds it (models/router_balance.py); None: the model has no routers.
    router_balance: Any = None
    # The frozen layer weights streamed from host memory (techniques/stream), None without.
    weight_stream: Any = None

    def __post_init__(self):
        if self.lm_head_module is None:
            self.lm_head_module = LMHeadModule(self.adapter.head())

    def host_room(self) -> int | None:
        """What :attr:`host_memory` leaves beside :attr:`host_held`: the default budget of
        whatever parks in host memory (None: unbounded)."""
        return None if self.host_memory is None else max(0, self.host_memory - self.host_held)

    @property
    def model(self) -> torch.nn.Module:
        return self.adapter.model

    @property
    def engine_options(self) -> Any:
        return self.strategy.engine_options

    def shard(self, seq, chunk: int | None = None):
        """This rank's :class:`~longtrain.engines.batch.Shard` of ``seq`` (all of it
        without sequence parallelism); the normalizer covers every data-parallel group."""
        from .batch import shard_sequence

        sp = self.sequence_parallel
        if sp is not None:
            seq.num_label_tokens = sp.global_label_count(seq.num_label_tokens, seq.count_given, seq.input_ids.device)
        return shard_sequence(seq, sp, chunk)

    def attention(self, inner):
        """``inner`` behind the sequence-parallel all-to-alls, or as it is."""
        return inner if self.sequence_parallel is None else self.sequence_parallel.attention(inner)

    def forward_pass(self):
        """Around an engine's forward pass (the first over the step's tokens; recomputations
        in its backward pass come after): a mixture of experts counts its routes here for
        the load-balancing loss, whose gradient the backward pass then adds exactly."""
        if self.router_balance is None:
            return contextlib.nullcontext()
        return self.router_balance.counting(self.sequence_parallel)

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss as every rank reports it (summed over sequence and data
        parallel ranks), detached, with the routers' load-balancing loss where it is on."""
        loss = loss.detach()
        if self.router_balance is not None:
            share = 1.0 if self.sequence_parallel is None else 1.0 / self.sequence_parallel.degree
            loss = self.router_balance.finish(loss, share)
        return loss if self.sequence_parallel is None else self.sequence_parallel.reduce_loss(loss)

    def rotary_tables(self, shard, probe: torch.Tensor):
        """Rotary tables of this rank's tokens, computed over the whole sequence (dynamic-NTK
        and longrope tables depend on its length) and taken at this rank's positions."""
        tables = self.adapter.position_embeddings(probe, shard.rotary_positions)
        return tree_map(lambda t: shard.local(t) if isinstance(t, torch.Tensor) else t, tables)

    def technique(self, name: str) -> Any:
        """The options of technique ``name`` when the strategy has it, else None."""
        return self.strategy.techniques.get(name)

    def head_loss(self, per_chunk: bool) -> HeadLossCall:
        """The head + loss this strategy asks for. With MsT's head: the fused op in its
        mini-sequences. Otherwise, over a chunk (``per_chunk``) the fused op on the whole
        chunk where the head allows, and over a whole sequence the stock full logits."""
        mst = self.technique("mst")
        if mst is not None and mst.head:
            return HeadLossCall(self.lm_head_module, fused=True, chunks=mst.loss_chunks)
        if per_chunk and self.lm_head_module.plain_linear:
            return HeadLossCall(self.lm_head_module, fused=True, chunks=1)
        return HeadLossCall(self.lm_head_module, fused=False)
