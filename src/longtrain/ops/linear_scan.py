"""Diagonal linear recurrences h_t = a_t ⊙ h_{t−1} + b_t over a sequence, without a
Python loop over time.

``linear_scan`` runs the recurrence by recursive doubling (Hillis–Steele): after the
step with offset s, position t holds the recurrence started s·2 positions back, so
log₂(T) vectorized steps cover the sequence, in place on one copy of the inputs. It
only multiplies decays and adds, so it is as stable as the sequential loop (no
division by running products, which underflow). Half-precision inputs are scanned in
float32.

``diagonal_recurrence`` is the differentiable version used by the SSM model: its
backward is the adjoint recurrence μ_t = ∂L/∂h_t + a_{t+1} ⊙ μ_{t+1} (the same scan
run in reverse), with ∂L/∂b_t = μ_t and ∂L/∂a_t = μ_t ⊙ h_{t−1}; it saves a and h, not
the log₂(T) intermediate steps autograd would keep.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["adjoint_states", "diagonal_recurrence", "linear_scan"]


def _scan_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


@torch.no_grad()
def _scan_(a: torch.Tensor, b: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Recursive doubling in place on time-first tensors this module owns; returns b = h.

    Forward, after the step with offset s position t holds the recurrence started 2s
    positions back: (a_t, b_t) ← (a_t·a_{t−s}, b_t + a_t·b_{t−s}). Reverse mirrors it.
    One temporary of the sequence's size at a time.
    """
    length, offset = a.shape[0], 1
    while offset < length:
        later, earlier = (slice(offset, None), slice(None, -offset))
        target, source = (earlier, later) if reverse else (later, earlier)
        b[target] += a[target] * b[source]
        if offset * 2 < length:  # the last step needs no decays
            a[target] = a[target] * a[source]
        offset *= 2
    return b


def _owned(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A time-first copy of ``x`` in ``dtype`` that the scan may overwrite."""
    x = x.movedim(dim, 0)
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def linear_scan(a: torch.Tensor, b: torch.Tensor, *, reverse: bool = False, dim: int = 1) -> torch.Tensor:
    """h with h_t = a_t ⊙ h_{t−1} + b_t along ``dim`` (h_0 = 0), or, with ``reverse``,
    h_t = a_t ⊙ h_{t+1} + b_t from the end. Not differentiable (see
    :func:`diagonal_recurrence`). Returns ``b``'s dtype."""
    dtype = _scan_dtype(b)
    h = _scan_(_owned(a, dim, dtype), _owned(b, dim, dtype), reverse)
    return h.movedim(0, dim).to(b.dtype)


def adjoint_states(a: torch.Tensor, grad_h: torch.Tensor, dim: int = 1, overwrite: bool = False) -> torch.Tensor:
    """μ with μ_t = grad_h_t + a_{t+1} ⊙ μ_{t+1} (μ after the end is 0): the gradient of
    a loss with respect to every h_t of the recurrence h_t = a_t ⊙ h_{t−1} + b_t, when
    ``grad_h`` holds the gradient reaching each h_t directly. ``overwrite``: the caller
    gives ``grad_h`` away and μ is built in its storage (when its dtype allows)."""
    dtype = _scan_dtype(grad_h)
    a = a.movedim(dim, 0)
    a_next = torch.zeros(a.shape, dtype=dtype, device=a.device)
    a_next[:-1] = a[1:]
    mu = grad_h.movedim(dim, 0) if overwrite and grad_h.dtype == dtype else _owned(grad_h, dim, dtype)
    mu = _scan_(a_next, mu, reverse=True)
    return mu.movedim(0, dim).to(grad_h.dtype)


class _DiagonalRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        h = linear_scan(a, b)
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx, grad_h):
        a, h = ctx.saved_tensors
        mu = adjoint_states(a, grad_h)
        h_prev = F.pad(h.movedim(1, -1).narrow(-1, 0, h.shape[1] - 1), (1, 0)).movedim(-1, 1)
        grad_a = mu * h_prev if ctx.needs_input_grad[0] else None
        return grad_a, mu


def diagonal_recurrence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Differentiable h_t = a_t ⊙ h_{t−1} + b_t over dim 1 of (batch, time, state) tensors."""
    if a.shape != b.shape:
        raise ValueError(f"decays {tuple(a.shape)} and inputs {tuple(b.shape)} differ in shape")
    return _DiagonalRecurrence.apply(a, b)
