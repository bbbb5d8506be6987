"""Attention sinks: a learned logit per head in every row's softmax denominator (gpt-oss).

A sink ``s_h`` is a key every query of head h sees with logit ``s_h`` and a value of
zero: it adds ``exp(s_h)`` to the normaliser and nothing to the numerator. So attention
with a sink is attention without one, rescaled once per row after every key block has
been merged::

    lse' = logaddexp(lse, s_h)        out' = out · exp(lse − lse')

and it never enters a chunk's or a block's partial result (which would count it once per
chunk). The backward pass needs no change: a flash backward given ``out'`` and ``lse'``
forms the probabilities ``exp(score − lse')`` and the row term ``rowsum(dO ∘ out')``
of attention with the sink, which are exactly its gradients for q, k and v. The sink's
own gradient is ``−Σ_rows exp(s_h − lse') · rowsum(dO ∘ out')``.

Shapes: out (B, H, S, D), lse (B, H, S), sink (H,).
"""

from __future__ import annotations

import torch

__all__ = ["add_sink", "sink_gradient"]


def _per_head(sink: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sink.to(like.dtype).reshape(1, -1, 1)


def add_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') of attention with ``sink`` from the output and LSE without it; a row
    that sees no key keeps its zero output and gets the sink's logit as its LSE."""
    with torch.no_grad():
        total = torch.logaddexp(lse, _per_head(sink, lse))
        kept = torch.exp(lse - total).unsqueeze(-1)  # in the LSE's precision, the output rounded once
        return (out.to(kept.dtype) * kept).to(out.dtype), total


def sink_gradient(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The gradient of ``sink`` (H,) from the gradient of the output ``out'`` (both with the
    sink) and ``lse'``, summed in the LSE's precision."""
    row = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (B, H, S)
    share = torch.exp(_per_head(sink, lse) - lse)  # the sink's probability in each row
    return -(share * row).sum((0, 2)).to(sink.dtype)
