"""One block of attention (a query chunk against a key/value chunk): the kernel interface.

Chunked attention is built from blocks. A block's forward returns its output
normalized by its own log-sum-exp (LSE) and that LSE, so callers merge blocks with an
online softmax. A block's backward takes the *global* output and LSE of its query rows
(after every block was merged), which makes the block's gradients exact contributions
to the global ones — no gradient ever flows through an LSE output.

Paths, picked per call:

- **flash**: PyTorch's flash-attention ATen kernels, which return the LSE and accept an
  outside output/LSE in backward (``_scaled_dot_product_flash_attention[_for_cpu]``).
  Used for unmasked and diagonal-causal blocks without logit soft-capping. Grouped K/V
  heads are repeated for the block only (a chunk-sized copy).
- **math**: explicit scores, used for arbitrary masks (padding, sliding window, packed
  documents) and soft-capping. It holds one block's scores, so chunk sizes bound it.

Masks are boolean, ``True`` where a query may attend; ``causal=True`` means the block
is on the diagonal (equal query and key positions), where top-left and bottom-right
alignment coincide.
"""

from __future__ import annotations

import math

import torch

_LSE_DTYPES = {torch.float64: torch.float64}


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-sum-exp accumulators are float32, or float64 for float64 inputs."""
    return _LSE_DTYPES.get(dtype, torch.float32)


def _flash_ops(device: torch.device):
    """(forward, backward) flash ATen ops for ``device``, or None where there are none."""
    aten = torch.ops.aten
    if device.type == "cpu" and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "cpu"
    if device.type == "cuda" and torch.backends.cuda.flash_sdp_enabled():
        return "cuda"
    return None


def _use_flash(q, mask, softcap) -> bool:
    if mask is not None or softcap or q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return False
    kind = _flash_ops(q.device)
    if kind == "cuda":  # FlashAttention-2 kernels: half precision, head dim <= 256
        return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
    return kind == "cpu"


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _flash_forward(q, k, v, causal, scale):
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    # The CUDA kernel's extra arguments describe variable-length packing and dropout,
    # neither of which blocks use. A *defined* cum_seq_q/k tensor (even an empty one)
    # means variable-length packing to the kernel, which then wants int32 offsets:
    # non-packed calls pass undefined tensors (None), as the forward returns them.
    s_q, s_k = q.shape[2], k.shape[2]
    no_dropout = torch.empty(0, device=q.device, dtype=torch.int64)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.float(), None, None, s_q, s_k, 0.0, causal, no_dropout, no_dropout, scale=scale
    )
    return dq, dk, dv


def _math_scores(q, k, scale, softcap):
    """Scores (B, Hkv, G, Cq, Ck) in the LSE dtype, and tanh for the soft-cap gradient."""
    b, h, cq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, h // hkv, cq, d)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k).to(lse_dtype(q.dtype)) * scale
    tanh = None
    if softcap:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    return scores, tanh


def _full_mask(mask, causal, cq, ck, device):
    if causal:
        diag = torch.ones(cq, ck, dtype=torch.bool, device=device).tril()
        mask = diag if mask is None else mask & diag
    if mask is not None and mask.dim() == 3:  # (B, Cq, Ck) -> broadcast over heads
        mask = mask[:, None, None]
    return mask


def block_forward(q, k, v, *, scale: float, causal: bool = False, mask=None, softcap: float | None = None):
    """Attention of q (B, H, Cq, D) over k, v (B, H_kv, Ck, D) for one block.

    Returns the block output normalized by the block's own LSE and that LSE (B, H, Cq).
    Rows with nothing to attend get output 0 and LSE -inf.
    """
    groups = q.shape[1] // k.shape[1]
    if _use_flash(q, mask, softcap):
        out, lse = _flash_forward(q, _expand_kv(k, groups), _expand_kv(v, groups), causal, scale)
        return out, lse.to(lse_dtype(q.dtype))
    b, h, cq, d = q.shape
    scores, _ = _math_scores(q, k, scale, softcap)
    full = _full_mask(mask, causal, cq, k.shape[2], q.device)
    if full is not None:
        scores = scores.masked_fill(~full, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(v.dtype), v)
    return out.reshape(b, h, cq, d), lse.reshape(b, h, cq)


def block_backward(dout, q, k, v, out, lse, *, scale: float, causal: bool = False, mask=None, softcap: float | None = None):
    """Gradients (dq, dk, dv) of one block, given the global output and LSE of its query rows.

    ``out``/``dout`` (B, H, Cq, D) and ``lse`` (B, H, Cq) are the merged values over
    every block the rows attend to, so the result is this block's exact share of the
    global gradients.
    """
    groups = q.shape[1] // k.shape[1]
    if _use_flash(q, mask, softcap):
        lse_in = lse.to(torch.float32) if q.dtype != torch.float64 else lse
        dq, dk, dv = _flash_backward(
            dout, q, _expand_kv(k, groups), _expand_kv(v, groups), out, lse_in, causal, scale
        )
        return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)
    b, h, cq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, groups, cq, d)
    do = dout.reshape(b, hkv, groups, cq, d)
    acc = lse_dtype(q.dtype)
    delta = (do.to(acc) * out.reshape(b, hkv, groups, cq, d).to(acc)).sum(-1)  # rowsum(dO ∘ O)
    scores, tanh = _math_scores(q, k, scale, softcap)
    full = _full_mask(mask, causal, cq, k.shape[2], q.device)
    if full is not None:
        scores = scores.masked_fill(~full, -math.inf)
    probs = torch.exp(scores - lse.reshape(b, hkv, groups, cq)[..., None]).nan_to_num(0.0)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", probs.to(v.dtype), do)
    dprobs = torch.einsum("bhgqd,bhkd->bhgqk", do, v).to(acc)
    dscores = probs * (dprobs - delta[..., None])
    if tanh is not None:  # d(c·tanh(s/c))/ds = 1 - tanh²
        dscores = dscores * (1 - tanh * tanh)
    dscores = (dscores * scale).to(q.dtype)
    dq = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k).reshape(b, h, cq, d)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, qg)
    return dq, dk, dv


def merge(out, lse, block_out, block_lse):
    """Online-softmax merge of a block into running (out, lse); returns the new pair."""
    new_lse = torch.logaddexp(lse, block_lse)
    # Rows that still have nothing to attend keep -inf; guard their weights against nan.
    w_old = torch.exp(lse - new_lse).nan_to_num(0.0)
    w_new = torch.exp(block_lse - new_lse).nan_to_num(0.0)
    out = out * w_old[..., None].to(out.dtype) + block_out * w_new[..., None].to(out.dtype)
    return out, new_lse
