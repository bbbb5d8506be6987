"""Diagonal linear recurrences h_t = a_t ⊙ h_{t−1} + b_t over a sequence, without a
Python loop over time.

``linear_scan`` runs the recurrence by recursive doubling (Hillis–Steele): after the
step with offset s, position t holds the recurrence started s·2 positions back, so
log₂(T) vectorized steps cover the sequence. It only multiplies decays and adds, so
it is as stable as the sequential loop (no division by running products, which
underflow). Half-precision inputs are scanned in float32.

``diagonal_recurrence`` is the differentiable version used by the SSM model: its
backward is the adjoint recurrence μ_t = ∂L/∂h_t + a_{t+1} ⊙ μ_{t+1} (the same scan
run in reverse), with ∂L/∂b_t = μ_t and ∂L/∂a_t = μ_t ⊙ h_{t−1}; it saves a and h, not
the log₂(T) intermediate steps autograd would keep.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _scan_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def linear_scan(a: torch.Tensor, b: torch.Tensor, *, reverse: bool = False, dim: int = 1) -> torch.Tensor:
    """h with h_t = a_t ⊙ h_{t−1} + b_t along ``dim`` (h_0 = 0), or, with ``reverse``,
    h_t = a_t ⊙ h_{t+1} + b_t from the end. Returns ``b``'s dtype."""
    out_dtype = b.dtype
    a, b = a.to(_scan_dtype(b)), b.to(_scan_dtype(b))
    if reverse:
        a, b = a.flip(dim), b.flip(dim)
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    length, offset = a.shape[0], 1
    while offset < length:
        # Combine each position with the one ``offset`` earlier: (a, b) ∘ (a', b') = (a·a', a·b' + b).
        b = torch.cat([b[:offset], torch.addcmul(b[offset:], a[offset:], b[:-offset])])
        if offset * 2 < length:  # the last step needs no decays
            a = torch.cat([a[:offset], a[offset:] * a[:-offset]])
        offset *= 2
    h = b.movedim(0, dim)
    if reverse:
        h = h.flip(dim)
    return h.to(out_dtype)


def adjoint_states(a: torch.Tensor, grad_h: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """μ with μ_t = grad_h_t + a_{t+1} ⊙ μ_{t+1} (μ after the end is 0): the gradient of
    a loss with respect to every h_t of the recurrence h_t = a_t ⊙ h_{t−1} + b_t, when
    ``grad_h`` holds the gradient reaching each h_t directly."""
    a_next = F.pad(a.movedim(dim, -1).narrow(-1, 1, a.shape[dim] - 1), (0, 1)).movedim(-1, dim)
    return linear_scan(a_next, grad_h, reverse=True, dim=dim)


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
