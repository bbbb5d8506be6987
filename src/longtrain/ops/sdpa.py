"""Scaled dot-product attention with grouped K/V heads and flash-style memory on every device.

On CUDA this is PyTorch's SDPA with ``enable_gqa`` (flash / memory-efficient kernels).
On CPU, SDPA with ``enable_gqa`` falls back to the math kernel, which materializes the
s×s score matrix; :class:`_CpuFlashGQA` instead calls the CPU flash kernel on K/V heads
repeated only for the duration of the kernel, and saves what a GPU flash kernel saves
(q, k, v, output, log-sum-exp). This keeps CPU runs — and the simulator, which runs
CPU kernels on fake tensors — faithful to GPU memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sdpa_gqa"]

_aten = torch.ops.aten


def _repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv·n_rep, S, D): each K/V head repeated for its query heads."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _fold_heads(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """A repeated K/V gradient (B, H, S, D) -> (B, n_kv, S, D): each head's repeats summed."""
    b, h, s, d = grad.shape
    return grad if h == n_kv else grad.view(b, n_kv, h // n_kv, s, d).sum(2)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU flash kernel takes only an additive mask in the query dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class _CpuFlashGQA(torch.autograd.Function):
    # The boolean mask is saved and made additive again in backward: the additive copy
    # is 4-8x larger and only needed while a kernel runs.
    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):
        n_rep = q.shape[1] // k.shape[1]
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, _repeat_heads(k, n_rep), _repeat_heads(v, n_rep), 0.0, is_causal,
            attn_mask=_additive(mask, q.dtype), scale=scale,
        )
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale, ctx.n_rep = is_causal, scale, n_rep
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, _repeat_heads(k, ctx.n_rep), _repeat_heads(v, ctx.n_rep), out, lse,
            0.0, ctx.is_causal, attn_mask=_additive(mask, q.dtype), scale=ctx.scale,
        )
        return dq, _fold_heads(dk, k.shape[1]), _fold_heads(dv, v.shape[1]), None, None, None


def sdpa_gqa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention over (B, H, S, D) queries and (B, H_kv, S, D) keys/values, H a multiple of H_kv.

    ``attn_mask`` is boolean (True = attend) or additive, broadcastable to (B, H, S_q, S_k).
    """
    if q.device.type == "cpu" and dropout_p == 0.0 and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return _CpuFlashGQA.apply(q, k, v, attn_mask, is_causal, scale)
    if q.dtype == torch.float32 and k.shape[1] != q.shape[1]:
        # Only SDPA's memory-efficient kernel takes float32 on CUDA, and not with grouped heads
        # (enable_gqa would fall to the math kernel and its s×s scores): repeat K/V instead.
        n_rep = q.shape[1] // k.shape[1]
        k, v = _repeat_heads(k, n_rep), _repeat_heads(v, n_rep)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
