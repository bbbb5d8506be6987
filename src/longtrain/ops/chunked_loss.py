"""LM head + cross-entropy in mini-sequences: the full logits are never materialized.

Chunk by chunk of tokens, forward computes the logits, their log-sum-exp in float32 and
the loss terms and, when a gradient will be wanted (grad mode on and the input, weight or
bias requiring one), the gradients too, while the chunk's logits exist: the loss's
gradient with respect to the logits is closed-form, (softmax − (1−ε)·onehot − ε/V) per
target token over the normalizer, times the soft-cap derivative when logits are soft-capped
(Gemma-2) and the logit scale when the head has one (Granite, Cohere). So the logits are
formed once per step, not again in backward (Liger's fused linear cross-entropy does the
same), and the peak holds one chunk's logits instead of all of them. Per chunk that is
three GEMMs in the input dtype — the logits, the input's gradient, and the weight's
gradient added into one preallocated buffer (float32 for a half-precision head,
accumulated by the GEMM itself on CUDA, and so planned by simulations) — at tensor-core speed. Backward only multiplies
the stored gradients by the loss's incoming gradient (1 for ``loss.backward()``, where the
product is exact) into new tensors, so a retained graph can run backward again. A frozen
head gets no gradient (and no buffer). No step reads a value back to the host, so the
chunks run without synchronizing.

A caller that runs the head on one sequence in several calls (FPDT: once per chunk, each
backpropagated at once with gradient 1) passes one :class:`GradientCarry` to all of
them: the weight's and bias's float32 buffers are carried from call to call, and only
the last call hands their sum to autograd, rounded once — instead of one rounded
gradient per call, summed in the weight's dtype.

Each chunk's top-1 hits and entropies go to the active
:class:`~longtrain.ops.token_stats.TokenStats`, if any (TRL's training metrics).
"""

from __future__ import annotations

import torch

from . import _autocast
from .gemm import add_product
from .loss import IGNORE_INDEX, shift_labels
from .tiles import tile_starts
from .token_stats import TokenStats, active

__all__ = ["GradientCarry", "chunked_causal_lm_loss"]


class GradientCarry:
    """The head's weight and bias gradient buffers, carried over a sequence's calls of
    :func:`chunked_causal_lm_loss`. Every call adds its gradients to them; only the one
    made with ``last`` set returns them through autograd (and starts the carry afresh).
    Valid only where each call's loss is backpropagated with gradient 1 — the earlier
    calls' share is summed before any incoming gradient is seen."""

    def __init__(self):
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.last = False


def _logits(x, weight, bias, logit_scale, softcap):
    """Logits of a chunk: the matmul in the input dtype, then float32 (float64 stays
    float64), times the logit scale, soft-capped."""
    z = x @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return z


def _logits_grad(z, lse, targets, weights, label_smoothing, logit_scale, softcap, dtype):
    """The gradient of ``Σ weights·(token loss)`` with respect to the chunk's pre-cap logits,
    formed in ``z``'s buffer (``z`` is consumed), returned in ``dtype`` — the input's, as
    autograd rounds the logits' gradient of a half-precision head — for tensor-core GEMMs."""
    # d/du of softcap·tanh(u/softcap), taken before z is overwritten below
    cap_slope = 1 - (z / softcap) ** 2 if softcap else None
    dz = z.sub_(lse[:, None]).exp_()  # softmax, in z's buffer
    dz.scatter_add_(1, targets[:, None], torch.full_like(dz[:, :1], -(1 - label_smoothing)))
    if label_smoothing:
        dz -= label_smoothing / dz.shape[1]
    dz *= weights[:, None].to(dz.dtype)
    if cap_slope is not None:
        dz *= cap_slope
        del cap_slope
    if logit_scale != 1.0:
        dz *= logit_scale
    return dz.to(dtype)


def _times(grad: torch.Tensor | None, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``grad · factor`` as a new tensor of ``dtype``, rounded once (a float32 weight-gradient
    buffer goes straight to a bf16 head's dtype)."""
    if grad is None:
        return None
    return torch.mul(grad, factor, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, targets, normalizer, chunk_tokens, ignore_index, label_smoothing, logit_scale, softcap,
                with_grads, carry, stats: TokenStats | None):
        n_tokens = x.shape[0]
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, 0)
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        total = torch.zeros((), dtype=acc_dtype, device=x.device)
        want_x, want_w = with_grads and ctx.needs_input_grad[0], with_grads and ctx.needs_input_grad[1]
        want_b = with_grads and bias is not None and ctx.needs_input_grad[2]
        # Half-precision weights accumulate their gradient in float32, rounded once in backward.
        grad_dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = _buffer(carry, "weight", weight.shape, grad_dtype, weight.device) if want_w else None
        grad_b = _buffer(carry, "bias", weight.shape[:1], grad_dtype, weight.device) if want_b else None
        per_token = valid / normalizer  # each target's weight in the loss: a tensor, no host sync
        for start in tile_starts(n_tokens, chunk_tokens, x):
            sl = slice(start, start + chunk_tokens)
            z = _logits(x[sl], weight, bias, logit_scale, softcap)
            lse = torch.logsumexp(z, dim=-1)
            target_logit = z.gather(1, safe_targets[sl, None]).squeeze(1)
            terms = lse - (1 - label_smoothing) * target_logit
            if label_smoothing:
                terms = terms - label_smoothing * z.mean(dim=-1)
            total = total + (terms * valid[sl]).sum()
            del terms
            if stats is not None:
                stats.add(z, lse, safe_targets[sl], valid[sl])
            if not (want_x or want_w or want_b):
                del z  # drop this chunk's logits before the next chunk's exist
                continue
            # The gradient's GEMMs run in the input dtype, as autograd's backward would run them
            # (outside autocast, which would cast a float32 head's operands down).
            with _autocast.off(x.device):
                dz = _logits_grad(z, lse, safe_targets[sl], per_token[sl], label_smoothing, logit_scale, softcap, x.dtype)
                del z  # the logits' buffer became their gradient; only its input-dtype copy is left
                if want_b:
                    grad_b += dz.sum(0).to(grad_dtype)
                if want_w:
                    add_product(grad_w, dz.t(), x[sl])
                if want_x:
                    torch.mm(dz, weight, out=grad_x[sl])
                del dz
        if carry is not None:
            if not carry.last:  # the sum goes on in the next call: nothing for autograd yet
                grad_w = grad_b = None
            else:
                carry.weight = carry.bias = None
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.dtypes = x.dtype, weight.dtype, None if bias is None else bias.dtype
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.saved_tensors
        return (*(_times(g, grad_loss, dtype) for g, dtype in zip(grads, ctx.dtypes)), *(None,) * 10)


def _buffer(carry: GradientCarry | None, name: str, shape, dtype, device) -> torch.Tensor:
    """A zeroed gradient buffer, or the one ``carry`` brings from earlier calls (kept there)."""
    buffer = None if carry is None else getattr(carry, name)
    if buffer is None:
        buffer = torch.zeros(shape, dtype=dtype, device=device)
        if carry is not None:
            setattr(carry, name, buffer)
    return buffer


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    num_label_tokens: int | torch.Tensor | None = None,
    reduction: str = "normalized",
    chunks: int | None = None,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    shifted: bool = False,
    carry: GradientCarry | None = None,
) -> torch.Tensor:
    """Next-token loss of an LM head ``hidden @ weight.T + bias`` over (B, S, d) hidden states.

    ``labels`` (B, S) are unshifted (shifted here, once). The sum of token losses is
    divided by ``num_label_tokens`` (``reduction="normalized"``, the default; the count
    of non-ignored targets when it is None), returned as is (``"sum"``), or divided by
    the count of non-ignored targets (``"mean"``). The tokens are processed in ``chunks``
    mini-sequences (default V/d, the paper's rule) or in chunks of ``chunk_tokens``.
    ``shifted=True``: ``labels`` are already the targets of each position (a slice of a
    longer sequence's shifted labels, as the chunked engines pass). ``logit_scale``
    multiplies the logits (head output, bias included) before soft-capping. ``carry``:
    the weight's and bias's gradients are summed over calls (:class:`GradientCarry`).
    """
    if reduction not in ("normalized", "sum", "mean"):
        raise ValueError(f"reduction must be 'normalized', 'sum' or 'mean', got {reduction!r}")
    x = hidden.reshape(-1, hidden.shape[-1])
    targets = (labels if shifted else shift_labels(labels)).reshape(-1).to(x.device)
    if x.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden has {x.shape[0]} tokens but labels {targets.shape[0]}")
    n_tokens = x.shape[0]
    if chunk_tokens is None:
        chunks = chunks or max(1, round(weight.shape[0] / weight.shape[1]))
        chunk_tokens = -(-n_tokens // chunks)
    chunk_tokens = max(1, min(chunk_tokens, n_tokens))
    if reduction == "sum":
        normalizer = torch.ones((), dtype=torch.float32, device=x.device)
    elif reduction == "mean" or num_label_tokens is None:
        normalizer = (targets != ignore_index).sum().float()
    else:
        # A fill, not torch.as_tensor: a host number copied to the GPU is a synchronous
        # copy (it waits for every queued kernel), once per chunk in the chunked engines.
        normalizer = (num_label_tokens.to(x.device, torch.float32) if isinstance(num_label_tokens, torch.Tensor)
                      else torch.full((), float(num_label_tokens), dtype=torch.float32, device=x.device))
    if x.dtype == torch.float64:
        normalizer = normalizer.double()
    # Gradients are formed with the logits (no second pass over them in backward) wherever
    # autograd will record this call; under no_grad (evaluation, SeCO's first pass) only the loss.
    with_grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    return _ChunkedLinearCrossEntropy.apply(
        x, weight, bias, targets, normalizer, chunk_tokens, ignore_index, float(label_smoothing), float(logit_scale),
        float(softcap or 0.0), with_grads, carry, active(),
    )
