"""One block of attention (a query chunk against a key/value chunk): the kernel interface.

Chunked attention is built from blocks. A block's forward returns its output
normalized by its own log-sum-exp (LSE) and that LSE, so callers merge blocks with an
online softmax. A block's backward takes the *global* output and LSE of its query rows
(after every block was merged), which makes the block's gradients exact contributions
to the global ones — no gradient ever flows through an LSE output.

Unmasked and diagonal-causal blocks without logit soft-capping run a fused kernel,
the fastest exact one for the device, dtype and head dimension (:func:`attention_kernel`,
chosen once and cached):

- **cudnn**: ``aten::_scaled_dot_product_cudnn_attention[_backward]``, cuDNN's fused
  attention (faster than the FA2 kernels on Hopper: docs/speed.md).
  Hopper and later (sm90+), fp16/bf16, head dimension a multiple of 8 up to 128.
  Takes grouped K/V heads as they are and returns dK/dV grouped; returns the LSE as
  (B, H, S, 1) float32; its backward accepts an outside output and LSE.
- **flash**: FlashAttention-2 (``aten::_scaled_dot_product_flash_attention[_backward]``)
  on CUDA (sm80+, fp16/bf16, head dimension up to 256), or PyTorch's CPU flash kernel
  (``..._for_cpu``, every floating dtype). Grouped K/V heads are repeated for the block
  only (a chunk-sized copy) and their gradients summed back.
- **math**: explicit scores (float32 accumulation, float64 for float64), always
  available; the only path for arbitrary masks (padding, sliding window, packed
  documents) and soft-capping, and on CUDA for float32/float64. It holds one block's
  scores, so chunk sizes bound it.

``LONGTRAIN_ATTENTION_KERNEL=cudnn|flash|math`` (or :func:`set_attention_kernel`)
forces a kernel where it can run, for benchmarks; ``auto`` (the default) picks the
first of cudnn, flash, math that the device supports. A kernel that fails at run time
(a shape its library refuses) is dropped for that device, dtype and head dimension with
a warning, and the next one takes over: kernels can be mixed freely between forward and
backward, since every backward works from the global output and LSE.

Masks are boolean, ``True`` where a query may attend; ``causal=True`` means the block
is on the diagonal (equal query and key positions), where top-left and bottom-right
alignment coincide.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch

from ..errors import LongtrainError

__all__ = [
    "KERNEL_ENV",
    "attention_kernel",
    "block_backward",
    "block_forward",
    "block_kernel",
    "cudnn_lse_is_4d",
    "cudnn_takes",
    "kernel_supported",
    "lse_dtype",
    "merge_",
    "set_attention_kernel",
]

_LSE_DTYPES = {torch.float64: torch.float64}
_HALF = (torch.float16, torch.bfloat16)
KERNELS = ("cudnn", "flash", "math")
KERNEL_ENV = "LONGTRAIN_ATTENTION_KERNEL"

_requested_kernel: str | None = None  # set_attention_kernel(); None: the environment variable decides
_chosen: dict[tuple, str] = {}  # (device type, index, dtype, head dim, request) -> kernel
_failed: set[tuple] = set()  # (kernel, device type, index, dtype, head dim) that raised at run time


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-sum-exp accumulators are float32, or float64 for float64 inputs."""
    return _LSE_DTYPES.get(dtype, torch.float32)


# ---- which kernel --------------------------------------------------------------------------

def set_attention_kernel(kernel: str | None) -> None:
    """Force the fused-block kernel (``"cudnn"``, ``"flash"``, ``"math"``) for this process,
    or hand the choice back (``None`` / ``"auto"``: the environment variable, else the
    fastest available). Meant for benchmarks and tests."""
    global _requested_kernel
    _requested_kernel = _check_kernel_name(kernel, "set_attention_kernel")


def _check_kernel_name(kernel: str | None, where: str) -> str | None:
    if kernel in (None, "", "auto"):
        return None
    if kernel not in KERNELS:
        raise LongtrainError(f"{where}: the attention kernel must be one of auto, {', '.join(KERNELS)}; got {kernel!r}")
    return kernel


def requested_kernel() -> str | None:
    """The kernel asked for (:func:`set_attention_kernel`, else ``$LONGTRAIN_ATTENTION_KERNEL``), or None."""
    if _requested_kernel is not None:
        return _requested_kernel
    return _check_kernel_name(os.environ.get(KERNEL_ENV, "").strip().lower() or None, KERNEL_ENV)


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel that fused blocks of ``dtype`` and ``head_dim`` run on ``device``:
    ``"cudnn"``, ``"flash"`` or ``"math"`` (see the module docstring). Decided once per
    device, dtype, head dimension and request, then cached."""
    request = requested_kernel()
    key = (device.type, device.index, dtype, head_dim, request)
    kernel = _chosen.get(key)
    if kernel is None:
        kernel = _chosen[key] = _choose(device, dtype, head_dim, request)
    return kernel


def _choose(device, dtype, head_dim, request) -> str:
    available = [k for k in KERNELS if kernel_supported(k, device, dtype, head_dim)]
    if request is None or request in available:
        return request or available[0]
    warnings.warn(f"attention kernel {request!r} cannot run {str(dtype).replace('torch.', '')} blocks of head "
                  f"dimension {head_dim} on {device} (see longtrain.ops.attention_blocks); using {available[0]!r}",
                  stacklevel=3)
    return available[0]


def kernel_supported(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    if kernel == "math":
        return True
    if (kernel, device.type, device.index, dtype, head_dim) in _failed:
        return False
    aten = torch.ops.aten
    if device.type == "cpu":
        return kernel == "flash" and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu") and dtype.is_floating_point
    if device.type != "cuda" or dtype not in _HALF or head_dim % 8:
        return False
    capability = _device_capability(device)
    if kernel == "flash":
        return torch.backends.cuda.flash_sdp_enabled() and capability >= (8, 0) and head_dim <= 256
    # cuDNN's fused attention is not deterministic: refused where PyTorch's SDPA dispatch refuses it.
    deterministic = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    return (hasattr(aten, "_scaled_dot_product_cudnn_attention") and torch.backends.cuda.cudnn_sdp_enabled()
            and capability >= (9, 0) and cudnn_takes(head_dim) and _cudnn_version() >= 90000 and not deterministic)


def cudnn_takes(head_dim: int) -> bool:
    """Whether cuDNN's fused attention takes blocks of this head dimension: a multiple of 8
    up to 128, as PyTorch's SDPA dispatch guards it (on the GPUs longtrain runs it on). The
    time model predicts FlashAttention-2's rate for the others."""
    return head_dim % 8 == 0 and head_dim <= 128


def _device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor); (0, 0) where no CUDA device can be asked (fake CUDA tensors on a
    machine without one): no fused kernel, explicit scores."""
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else (0, 0)


def _cudnn_version() -> int:
    return (torch.backends.cudnn.version() or 0) if torch.backends.cudnn.is_available() else 0


def _drop_failed(kernel: str, q: torch.Tensor, error: Exception) -> None:
    """Remember that ``kernel`` raised for q's device, dtype and head dimension, and re-choose."""
    device, dtype, head_dim = q.device, q.dtype, q.shape[-1]
    _failed.add((kernel, device.type, device.index, dtype, head_dim))
    for key in [k for k in _chosen if k[:4] == (device.type, device.index, dtype, head_dim)]:
        del _chosen[key]
    warnings.warn(f"attention kernel {kernel!r} failed on {device} for {str(dtype).replace('torch.', '')} blocks of "
                  f"head dimension {head_dim} ({str(error).splitlines()[0][:200]}); using "
                  f"{attention_kernel(device, dtype, head_dim)!r} from now on", stacklevel=3)


def block_kernel(q, k, mask, softcap) -> str:
    """The kernel for a block: "math" wherever a mask or a soft-cap must be applied."""
    if mask is not None or softcap or not q.dtype.is_floating_point:
        return "math"
    kernel = attention_kernel(q.device, q.dtype, q.shape[-1])
    if kernel == "cudnn" and k.shape[2] == 1:
        # cuDNN refuses a single key (PyTorch's own SDPA dispatch never sends it one,
        # pytorch#138529); a one-token document or chunk takes the next kernel for this
        # block only, without marking cuDNN failed for every later block.
        return "flash" if kernel_supported("flash", q.device, q.dtype, q.shape[-1]) else "math"
    return kernel


def _fused(fn, kernel: str, *args):
    """``fn(kernel, *args)`` (``args[0]`` shaped like q); where a CUDA kernel's library
    refuses (not for want of memory), drop that kernel and let the next one do the block.
    None once only "math" is left: the caller computes explicit scores."""
    while kernel != "math":
        try:
            return fn(kernel, *args)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:
            if args[0].device.type != "cuda":
                raise
            _drop_failed(kernel, args[0], error)
            kernel = attention_kernel(args[0].device, args[0].dtype, args[0].shape[-1])
    return None


# ---- the fused kernels -----------------------------------------------------------------------

def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """K or V (B, Hkv, S, D) -> (B, Hkv·G, S, D), each head repeated for its G query heads."""
    # output_size: the result's head count is known, so no kernel (nor fake-tensor op) derives it
    return t if groups == 1 else t.repeat_interleave(groups, dim=1, output_size=t.shape[1] * groups)


def _reduce_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """dK or dV (B, Hkv·G, S, D) -> (B, Hkv, S, D): the G repeats' gradients summed."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


@functools.cache
def cudnn_lse_is_4d() -> bool:
    """Whether this PyTorch's cuDNN forward returns the LSE as (B, H, S, 1) — its backward
    takes the LSE in the forward's shape. Read from the op's meta kernel (no GPU needed)."""
    q = torch.empty(1, 1, 8, 8, device="meta", dtype=torch.bfloat16)
    lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, False, False)[1]
    return lse.dim() == 4


def _cudnn_forward(q, k, v, causal, scale):
    # cuDNN caches its execution plan per shape and q/k/v strides, not per output or LSE
    # layout: every tensor it sees is contiguous, so a cached plan always matches.
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False, scale=scale
    )
    return out, lse.reshape(q.shape[:3])


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    b, h, s_q, _ = q.shape
    s_k = k.shape[2]
    lse = lse.to(torch.float32).reshape((b, h, s_q, 1) if cudnn_lse_is_4d() else (b, h, s_q)).contiguous()
    # Without dropout the philox seed/offset are never read (the kernel's graph has no
    # dropout node); max_q/max_k are the block's lengths (the kernel reads them as s_q/s_kv);
    # no bias and no variable-length packing: undefined tensors (None).
    unused = torch.empty((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse, unused, unused,
        None, None, None, s_q, s_k, 0.0, causal, scale=scale,
    )


def _flash_forward(q, k, v, causal, scale):
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    aten = torch.ops.aten
    # Dense: a query block's rows of a longer sequence's LSE are a strided slice, and the CUDA
    # kernel indexes the LSE as a dense (B, H, S) array without checking its strides (it
    # would read other heads' rows). The CPU kernel honours strides; the copy is small.
    lse = lse.contiguous()
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


def _fused_forward(kernel, q, k, v, causal, scale):
    if kernel == "cudnn":  # grouped K/V as they are
        out, lse = _cudnn_forward(q, k, v, causal, scale)
    else:
        groups = q.shape[1] // k.shape[1]
        out, lse = _flash_forward(q, _expand_kv(k, groups), _expand_kv(v, groups), causal, scale)
    return out, lse.to(lse_dtype(q.dtype))


def _fused_backward(kernel, dout, q, k, v, out, lse, causal, scale):
    if kernel == "cudnn":  # dK/dV come back grouped
        return _cudnn_backward(dout, q, k, v, out, lse, causal, scale)
    groups = q.shape[1] // k.shape[1]
    lse_in = lse.to(torch.float32) if q.dtype != torch.float64 else lse
    dq, dk, dv = _flash_backward(dout, q, _expand_kv(k, groups), _expand_kv(v, groups), out, lse_in, causal, scale)
    return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)


# ---- explicit scores --------------------------------------------------------------------------

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
    fused = _fused(_fused_forward, block_kernel(q, k, mask, softcap), q, k, v, causal, scale)
    if fused is not None:
        return fused
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
    fused = _fused(_fused_backward, block_kernel(q, k, mask, softcap), dout, q, k, v, out, lse, causal, scale)
    if fused is not None:
        return fused
    groups = q.shape[1] // k.shape[1]
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


def merge_(out, lse, block_out, block_lse) -> None:
    """Online-softmax merge of a block into the running ``out`` (in the accumulator dtype)
    and ``lse``, in place. The two weights, exp(lse − new) and exp(block_lse − new), sum
    to one, so the update is one lerp: ``out += (block_out − out) · exp(block_lse − new)``."""
    new_lse = torch.logaddexp(lse, block_lse)
    # Rows that still have nothing to attend keep -inf (and weight 0, not nan).
    w_new = torch.exp(block_lse - new_lse).nan_to_num_(0.0)
    out.lerp_(block_out.to(out.dtype), w_new[..., None].to(out.dtype))
    lse.copy_(new_lse)
