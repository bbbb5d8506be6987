"""An attention output as an autograd node of q, k and v whose backward is given: what
kept outputs (checkpointing, Memo, FPDT's ``keep_output``) and attention with sinks
(:mod:`.attention_sinks`) hand to autograd.

Shapes: q (B, H, S, D), k, v (B, H_kv, S, D), out (B, H, S, D), lse (B, H, S), sink (H,).
"""

from __future__ import annotations

from typing import Callable

import torch

from .attention_sinks import sink_gradient

__all__ = ["attention_from_output"]


class _KnownOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, out, lse, backward, sink):
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.attention_backward = backward
        return out  # a view of the kept output: no copy

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.attention_backward is None:
            raise RuntimeError("this attention output was a stand-in for recomputation and has no backward")
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = ctx.attention_backward(grad_out, q, k, v, out, lse)
        dsink = sink_gradient(grad_out, out, lse, sink) if ctx.needs_input_grad[6] else None
        return dq, dk, dv, None, None, None, dsink


def attention_from_output(q, k, v, out, lse, backward: Callable | None, sink: torch.Tensor | None = None):
    """``out``, as the attention of q, k, v whose output and LSE it is: autograd sees an
    attention node (saving q, k, v, out and LSE) whose backward is
    ``backward(grad_out, q, k, v, out, lse) -> (dq, dk, dv)``. With ``backward=None`` it
    is a stand-in that only replays the forward (a recomputation that never runs backward).
    ``sink``: the (H,) sink logits ``out`` and ``lse`` include (:mod:`.attention_sinks`),
    whose gradient the node also gives."""
    return _KnownOutput.apply(q, k, v, out, lse, backward, sink)
