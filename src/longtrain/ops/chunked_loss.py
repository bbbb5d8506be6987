"""LM head + cross-entropy in mini-sequences: the full logits are never materialized.

Forward computes, chunk by chunk of tokens, the logits, their log-sum-exp in float32
and the loss terms, and keeps only the head input and one float per token (the LSE).
Backward recomputes each chunk's logits and forms the gradient of the loss with
respect to the logits in closed form, so the peak holds one chunk's logits instead of
all of them: (softmax − (1−ε)·onehot − ε/V) · scale, times the soft-cap derivative when
logits are soft-capped (Gemma-2) and the logit scale when the head has one (Granite,
Cohere). Gradients go to the input, the weight and the bias;
a frozen head gets none (and no buffer). No step reads a value back to the host, so
the chunks run without synchronizing. Per chunk, backward runs three GEMMs in the input
dtype — the logits again, the input's gradient, and the weight's gradient added into one
preallocated buffer (float32 for a half-precision head, accumulated by the GEMM itself
on CUDA) — so the head's backward runs at tensor-core speed.
"""

from __future__ import annotations

import warnings

import torch

from . import _autocast

from .loss import IGNORE_INDEX, shift_labels


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


_dtype_addmm_fails: set[torch.device] = set()  # devices whose addmm refused out_dtype


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` as one GEMM per call. Half-precision ``a``/``b`` into a float32
    ``acc`` (the weight gradient of a bf16 head, summed over chunks): on CUDA the GEMM
    reads bf16/fp16 and accumulates into the float32 buffer in place
    (``addmm(out_dtype=float32)``, cuBLAS at tensor-core speed); elsewhere the product is
    formed in the input dtype and added (one rounding per chunk)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.device.type == "cuda" and acc.device not in _dtype_addmm_fails:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except torch.OutOfMemoryError:  # not a missing GEMM: the step is out of memory
            raise
        except (RuntimeError, TypeError) as error:  # an older PyTorch without the out_dtype GEMM
            _dtype_addmm_fails.add(acc.device)
            warnings.warn(f"addmm with out_dtype={acc.dtype} is not available on {acc.device} ({error}); the LM "
                          "head's weight gradient is summed chunk by chunk instead", stacklevel=2)
    acc += a @ b


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, targets, normalizer, chunk_tokens, ignore_index, label_smoothing, logit_scale, softcap):
        n_tokens = x.shape[0]
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, 0)
        lse = torch.empty(n_tokens, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
        total = torch.zeros((), dtype=lse.dtype, device=x.device)
        for start in range(0, n_tokens, chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            z = _logits(x[sl], weight, bias, logit_scale, softcap)
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[sl] = chunk_lse
            target_logit = z.gather(1, safe_targets[sl, None]).squeeze(1)
            terms = chunk_lse - (1 - label_smoothing) * target_logit
            if label_smoothing:
                terms = terms - label_smoothing * z.mean(dim=-1)
            total = total + (terms * valid[sl]).sum()
            del z, terms  # drop this chunk's logits before the next chunk's exist
        ctx.save_for_backward(x, weight, bias, safe_targets, valid, lse, normalizer)
        ctx.chunk_tokens, ctx.label_smoothing, ctx.logit_scale, ctx.softcap = chunk_tokens, label_smoothing, logit_scale, softcap
        ctx.autocast = _autocast.capture(x.device)
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, bias, targets, valid, lse, normalizer = ctx.saved_tensors
        eps, softcap, logit_scale = ctx.label_smoothing, ctx.softcap, ctx.logit_scale
        want_x, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        scale = grad_loss / normalizer  # d(total/normalizer)/d(total), a 0-d tensor: no host sync
        grad_x = torch.empty_like(x) if want_x else None
        # Half-precision weights accumulate their gradient in float32, rounded once at the end.
        acc_dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if want_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc_dtype, device=weight.device) if want_b else None
        vocab = weight.shape[0]
        for start in range(0, x.shape[0], ctx.chunk_tokens):
            sl = slice(start, start + ctx.chunk_tokens)
            with _autocast.restore(ctx.autocast):
                z = _logits(x[sl], weight, bias, logit_scale, softcap)
            # d/du of softcap·tanh(u/softcap), taken before z is overwritten below
            cap_slope = 1 - (z / softcap) ** 2 if softcap else None
            dz = z.sub_(lse[sl, None]).exp_()  # softmax, in z's buffer
            dz.scatter_add_(1, targets[sl, None], torch.full_like(dz[:, :1], -(1 - eps)))
            if eps:
                dz -= eps / vocab
            dz *= (valid[sl, None] * scale).to(dz.dtype)
            if cap_slope is not None:
                dz *= cap_slope
                del cap_slope
            if logit_scale != 1.0:
                dz *= logit_scale
            if want_b:
                grad_b += dz.sum(0).to(acc_dtype)
            # Both matmuls take dz in the input dtype (the logits' gradient, rounded as
            # autograd rounds it for a half-precision head): tensor-core GEMMs, never a
            # float32 GEMM or a float32 copy of x (that ran at a twentieth of the speed).
            dz_in = dz.to(x.dtype)
            del z, dz
            if want_w:
                _add_product(grad_w, dz_in.t(), x[sl])
            if want_x:
                grad_x[sl] = dz_in @ weight
            del dz_in
        grad_w = grad_w.to(weight.dtype) if want_w else None
        grad_b = grad_b.to(bias.dtype) if want_b else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


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
) -> torch.Tensor:
    """Next-token loss of an LM head ``hidden @ weight.T + bias`` over (B, S, d) hidden states.

    ``labels`` (B, S) are unshifted (shifted here, once). The sum of token losses is
    divided by ``num_label_tokens`` (``reduction="normalized"``, the default; the count
    of non-ignored targets when it is None), returned as is (``"sum"``), or divided by
    the count of non-ignored targets (``"mean"``). The tokens are processed in ``chunks``
    mini-sequences (default V/d, the paper's rule) or in chunks of ``chunk_tokens``.
    ``shifted=True``: ``labels`` are already the targets of each position (a slice of a
    longer sequence's shifted labels, as the chunked engines pass). ``logit_scale``
    multiplies the logits (head output, bias included) before soft-capping.
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
        normalizer = torch.as_tensor(num_label_tokens, dtype=torch.float32, device=x.device)
    if x.dtype == torch.float64:
        normalizer = normalizer.double()
    return _ChunkedLinearCrossEntropy.apply(
        x, weight, bias, targets, normalizer, chunk_tokens, ignore_index, float(label_smoothing), float(logit_scale),
        float(softcap or 0.0),
    )
