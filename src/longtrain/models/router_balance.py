"""A mixture of experts' load-balancing loss, exact under every engine and technique.

Hugging Face adds ``coef · aux`` to the loss where the config sets ``output_router_logits``
(Switch Transformer's loss, summed over every router of the model)::

    aux = E · Σ_e (C_e / R) · (P_e / R)

with E experts, C_e the top-k assignments of real tokens to expert e, P_e the sum of
their router probabilities p = softmax(router logits), and R the real tokens times the
routers (padding excluded by the attention mask). Chunks, tiles and recomputation see a
few tokens at a time, but aux is not a sum over tokens. Its gradient is, once the counts
are known: C is piecewise constant in the logits, so for a real token's logits z at one
router ``∂aux/∂z = p ⊙ (w − p·w)`` with ``w = E · C / R²``.

So every engine runs in two phases (:class:`RouterBalance`): its forward pass counts C, P
and R at every router call (:meth:`RouterBalance.counting`; a recomputation in the
backward pass counts nothing), and at the end of it the counts are final (summed over
the ranks of a sequence-parallel group); in the backward pass each router call's
gradient gains that term (:class:`_BalanceGradient`), tied to the routing weights the
experts use so that autograd reaches it wherever the call's tokens are backpropagated.
The step's loss gains ``coef · aux``. Which rows are real tokens comes from the layer's
attention call (:mod:`longtrain.ops.token_rows`).

Shapes: router logits (N, E) for a call's N tokens flattened; counts, sums (E,).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn import functional as F

from ..errors import LongtrainError
from ..ops import token_rows
from .attention import AttentionCall

__all__ = ["BalanceLedger", "RouterBalance", "install_router_balance"]


class BalanceLedger:
    """One micro-batch's routing statistics, counted in its forward pass, in float32 as
    Hugging Face's ``load_balancing_loss_func`` sums them."""

    def __init__(self, experts: int, top_k: int, coef: float):
        self.experts, self.top_k, self.coef = experts, top_k, coef
        self.counts: torch.Tensor | None = None  # (E,) top-k assignments of real tokens
        self.probs: torch.Tensor | None = None  # (E,) summed router probabilities of real tokens
        self.rows: torch.Tensor | float = 0.0  # real tokens × routers
        self.counting = True  # the forward pass; a recomputation counts nothing
        self.weights: torch.Tensor | None = None  # (E,) coef · E · C / R², once the counts are final
        self.scale = 1.0  # what the engine weights the tokens now backpropagated by (SpaCO's k/t)

    def count(self, logits: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Add one router call: ``logits`` (N, E), ``rows`` (N,) 1 for real tokens (None: all)."""
        probs = F.softmax(logits.detach(), dim=-1)
        _, chosen = torch.topk(probs, self.top_k, dim=-1)
        weight = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device) if rows is None else rows.to(torch.float32)
        counts = torch.zeros(self.experts, dtype=torch.float32, device=logits.device).scatter_add_(
            0, chosen.reshape(-1), weight.repeat_interleave(self.top_k, output_size=weight.numel() * self.top_k))
        summed = (probs.float() * weight.unsqueeze(-1)).sum(0)
        self.counts = counts if self.counts is None else self.counts + counts
        self.probs = summed if self.probs is None else self.probs + summed
        self.rows = self.rows + weight.sum()

    def close(self, sequence_parallel=None) -> None:
        """The forward pass is over: the counts are final (summed over a sequence-parallel
        group's ranks, which each counted their own tokens)."""
        self.counting = False
        if self.counts is None:
            return
        if sequence_parallel is not None:  # each sum in its own dtype (counts and rows are whole numbers)
            rows = torch.as_tensor(self.rows, dtype=self.counts.dtype, device=self.counts.device).reshape(1)
            counted = sequence_parallel.sum_over_ranks(torch.cat([self.counts, rows]))
            self.counts, self.rows = counted[:-1], counted[-1]
            self.probs = sequence_parallel.sum_over_ranks(self.probs)
        # Rounded as Hugging Face's autograd rounds it, in the probability sums' dtype (float32
        # unless they are float64) and its order: coef · E, times C / R (in the counts' float32), over R.
        dtype = self.probs.dtype
        coef = torch.tensor(self.coef, dtype=dtype, device=self.probs.device)
        self.weights = coef * self.experts * (self.counts / self.rows).to(dtype) / torch.as_tensor(self.rows).to(dtype)

    def aux_loss(self) -> torch.Tensor | None:
        """``aux`` as Hugging Face computes it (None: no router ran)."""
        if self.counts is None:
            return None
        per_expert = self.counts / self.rows
        return torch.sum(per_expert * (self.probs / self.rows)) * self.experts


class _BalanceGradient(torch.autograd.Function):
    """The routing weights, unchanged; in backward the router logits also receive the
    balancing loss's gradient for these tokens (module docstring)."""

    @staticmethod
    def forward(ctx, ledger: BalanceLedger, rows, logits, routing_weights):
        ctx.ledger, ctx.rows = ledger, rows
        ctx.save_for_backward(logits)
        return routing_weights.clone()

    @staticmethod
    def backward(ctx, grad_weights):
        (logits,) = ctx.saved_tensors
        ledger = ctx.ledger
        if ledger.weights is None:
            raise LongtrainError("the router balancing loss was backpropagated before its forward pass ended; "
                                 "engines count routes in RouterBalance.counting()")
        probs = F.softmax(logits.detach(), dim=-1)
        w = (ledger.weights * ledger.scale).to(probs.dtype)
        grad = probs * (w - (probs * w).sum(-1, keepdim=True))
        if ctx.rows is not None:
            grad = grad * ctx.rows.to(grad.dtype).unsqueeze(-1)
        return None, None, grad.to(logits.dtype), grad_weights


class RouterBalance:
    """A model's routers and, during a step that adds the balancing loss, its ledger.
    Whether a step adds it is read from the config at each step (as the stock forward
    reads ``output_router_logits``)."""

    def __init__(self, config, experts: int, top_k: int):
        self.config, self.experts, self.top_k = config, experts, top_k
        self.ledger: BalanceLedger | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.weight = 1.0  # the step's weight of coef · aux (longtrain.step's aux_loss_weight)

    @property
    def coef(self) -> float:
        """The loss's weight in this step (0: the config adds none)."""
        if not getattr(self.config, "output_router_logits", False):
            return 0.0
        return float(getattr(self.config, "router_aux_loss_coef", 0.0) or 0.0)

    @contextlib.contextmanager
    def counting(self, sequence_parallel=None):
        """Around an engine's forward pass: routes are counted, and final after it."""
        coef = self.coef * self.weight
        self.ledger = BalanceLedger(self.experts, self.top_k, coef) if coef else None
        self.last_aux_loss = None
        yield
        if self.ledger is not None:
            self.ledger.close(sequence_parallel)

    @contextlib.contextmanager
    def scaled(self, factor: float):
        """Tokens backpropagated in the block are weighted ``factor`` (SpaCO's chunks)."""
        ledger = self.ledger
        if ledger is None:
            yield
            return
        before, ledger.scale = ledger.scale, factor
        try:
            yield
        finally:
            ledger.scale = before

    def abandon(self) -> None:
        """A step failed: its counts are dropped, so that no later forward counts into them
        nor backward adds their gradient."""
        self.ledger = None

    def finish(self, loss: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """The step's loss with ``coef · aux · share`` added (``share``: this rank's part
        of a sequence-parallel group's loss, which the group's ranks sum); the ledger's
        step is over."""
        ledger, self.ledger = self.ledger, None
        aux = None if ledger is None else ledger.aux_loss()
        if aux is None:
            return loss
        self.last_aux_loss = aux.detach()
        return loss + (ledger.coef * share * aux).to(loss.dtype)

    def route(self, original, *args, **kwargs):
        """A router's forward: counted, and tied to the balancing gradient (module docstring)."""
        out = original(*args, **kwargs)
        ledger = self.ledger
        if ledger is None:
            return out
        logits, routing_weights, *rest = out
        context = token_rows.current()
        if context is None:
            raise LongtrainError("a router ran outside a layer called by longtrain's engines; its tokens are unknown")
        rows = context.rows(logits.shape[0], logits.device)
        if ledger.counting:
            ledger.count(logits, rows)
        if torch.is_grad_enabled() and logits.requires_grad:
            routing_weights = _BalanceGradient.apply(ledger, rows, logits, routing_weights)
        return (logits, routing_weights, *rest)


def _layer_with_rows(original, *args, **kwargs):
    """A decoder layer's forward with its tokens' rows declared (from its attention call)."""
    call = kwargs.get("attention_mask")
    with token_rows.layer_rows(call.rows if isinstance(call, AttentionCall) else None):
        return original(*args, **kwargs)


def install_router_balance(adapter) -> RouterBalance | None:
    """Patch ``adapter``'s routers and their layers (before any technique wraps a layer, so
    that recomputations pass through too); None where the model has no routers. A config
    that asks for the balancing loss of routers this cannot find, or whose experts it
    cannot tell, is refused in one line (the loss would be dropped)."""
    routers = adapter.routers()
    if not routers:
        _refuse_if_asked(adapter.config, "its routers are not recorded where Hugging Face records router_logits")
        return None
    # The experts and how many a token takes, as the model's loss reads them: the description's,
    # or the router's own where the adapter describes no experts (a family tried with the
    # Llama-layout adapter).
    feed_forward = next((f for f in adapter.description.feed_forward if f.experts), None)
    router = routers[0][1]
    experts = feed_forward.experts if feed_forward else getattr(router, "num_experts", None)
    top_k = feed_forward.active if feed_forward else getattr(router, "top_k", None)
    if not experts or not top_k:
        _refuse_if_asked(adapter.config, "neither the model's description nor its router gives the experts and top-k")
        return None
    balance = RouterBalance(adapter.config, experts, top_k)
    for layer, router in routers:
        router.forward = functools.partial(balance.route, router.forward)
        layer.forward = functools.partial(_layer_with_rows, layer.forward)
    return balance


def _refuse_if_asked(config, why: str) -> None:
    """Where the config asks for the balancing loss longtrain cannot add: one line."""
    if getattr(config, "output_router_logits", False) and float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0):
        raise LongtrainError(f"this {config.model_type} model asks for its routers' load-balancing loss "
                             f"(output_router_logits=True), which longtrain cannot add: {why}; set "
                             "output_router_logits=False, or train it without longtrain")
