"""Mini-sequence (tiled) MLP: only one chunk's intermediates are alive, forward and backward.

An MLP acts on each token independently, so its output can be computed chunk by chunk
of tokens. :func:`tiled_mlp` saves only the MLP's input; its backward recomputes one
chunk at a time with autograd and returns the weight gradients summed over chunks, so
autograd accumulates them exactly once into ``.grad`` — LoRA adapters, gradient
accumulation and sharded parameters work as with the plain module, and no
post-accumulate-grad hook fires once per chunk.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import _autocast


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk_tokens, x, *params):
        ctx.fn, ctx.chunk_tokens, ctx.params = fn, chunk_tokens, params
        ctx.autocast = _autocast.capture(x.device)
        ctx.save_for_backward(x)  # the only tensor kept for backward
        flat = x.reshape(-1, x.shape[-1])
        out = None
        with torch.no_grad():
            for start in range(0, flat.shape[0], chunk_tokens):
                y = fn(flat[start : start + chunk_tokens])
                if out is None:
                    out = y.new_empty((flat.shape[0], y.shape[-1]))
                out[start : start + y.shape[0]] = y
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        want_x = ctx.needs_input_grad[2]
        wanted = [p for p, needed in zip(ctx.params, ctx.needs_input_grad[3:]) if needed]
        grad_x = torch.empty_like(flat) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        for start in range(0, flat.shape[0], ctx.chunk_tokens):
            piece = flat[start : start + ctx.chunk_tokens].detach().requires_grad_(want_x)
            with torch.enable_grad(), _autocast.restore(ctx.autocast):
                y = ctx.fn(piece)
            inputs = ([piece] if want_x else []) + wanted
            grads = list(torch.autograd.grad(y, inputs, grad_flat[start : start + piece.shape[0]], allow_unused=True))
            if want_x:
                grad_x[start : start + piece.shape[0]] = grads.pop(0)
            for i, g in enumerate(grads):
                if g is not None:
                    sums[i] = g if sums[i] is None else sums[i].add_(g)
        it = iter(sums)
        param_grads = [next(it) if needed else None for needed in ctx.needs_input_grad[3:]]
        return (None, None, grad_x.view_as(x) if want_x else None, *param_grads)


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor], chunk_tokens: int) -> torch.Tensor:
    """Apply the token-wise function ``fn`` to ``x`` (..., d) in chunks of ``chunk_tokens`` tokens.

    ``params`` are the tensors ``fn`` uses that may need gradients (e.g. the MLP's
    trainable parameters); their gradients are returned to autograd summed over chunks.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    n_tokens = x.numel() // x.shape[-1]
    if n_tokens <= chunk_tokens or not torch.is_grad_enabled():
        return fn(x)  # one chunk (or no backward): nothing to save by tiling
    return _TiledMLP.apply(fn, chunk_tokens, x, *params)
