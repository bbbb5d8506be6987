"""The chunked attention op (FPDT's compute core) against PyTorch SDPA in float64."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from longtrain.errors import LongtrainError
from longtrain.ops.causal_attention import causal_attention
from longtrain.ops.chunked_attention import chunked_attention
from longtrain.ops.masking import SequenceMask, document_spans

TOL = 1e-10


def reference(q, k, v, window=None, segments=None, key_valid=None, softcap=None):
    """SDPA with an explicit boolean mask (explicit scores with ``softcap``); rows with no
    visible key give 0."""
    s = q.shape[2]
    pos = torch.arange(s)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask = mask & (pos[None, :] > pos[:, None] - window)
    mask = mask[None, None]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])[:, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if softcap:
        scores = torch.tanh(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 / softcap) * softcap
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).nan_to_num(0.0)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns inside the block."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _variant_mask(variant: str, s: int):
    """(segments, key_valid, window) of two rows of ``s`` tokens for a test variant."""
    window = 13 if "window" in variant else None
    segments = key_valid = None
    if "packed" in variant:
        segments = torch.zeros(2, s, dtype=torch.long)
        segments[0, 20:] = 1
        segments[1, 7:] = 1
        segments[1, 40:] = 2
    if "left-padded" in variant:  # padded rows see no key: output 0
        key_valid = torch.ones(2, s, dtype=torch.bool)
        key_valid[1, :11] = False
    return segments, key_valid, window


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("n_chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("variant", ["causal", "window", "packed", "left-padded+packed"])
def test_matches_sdpa_in_float64(heads, kv_heads, n_chunks, variant):
    s = 61  # not divisible by any chunk count above 1
    chunk = -(-s // n_chunks)
    g = torch.Generator().manual_seed(n_chunks * 10 + heads + kv_heads)
    q = torch.randn(2, heads, s, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, s, 16, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, s, 16, dtype=torch.float64, generator=g, requires_grad=True)
    segments, key_valid, window = _variant_mask(variant, s)
    mask = SequenceMask(segments, key_valid)
    out = chunked_attention(q, k, v, chunk=chunk, window=window, mask=mask)
    ref = reference(q, k, v, window, segments, key_valid)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    assert rel(out, ref) <= TOL
    assert max(rel(a, b) for a, b in zip(got, expected)) <= TOL


def test_bf16_within_tolerance():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 200, 32, generator=g, dtype=torch.float64) for _ in range(3))
    exact = reference(q, k, v)
    out = chunked_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), chunk=48)
    assert rel(out.double(), exact) <= 1e-2


def test_bad_head_counts():
    q = torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        chunked_attention(q, torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), chunk=4)


@pytest.mark.parametrize("n_chunks", [1, 3])
def test_soft_capped_attention_matches_explicit_scores_in_float64(n_chunks):
    """Gemma-2's logit soft-capping c·tanh(s/c), GQA, a window cutting across chunks."""
    s, cap, window = 45, 5.0, 11
    g = torch.Generator().manual_seed(n_chunks)
    q = torch.randn(2, 4, s, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 2, s, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, s, 8, dtype=torch.float64, generator=g, requires_grad=True)
    out = chunked_attention(q, k, v, chunk=-(-s // n_chunks), window=window, softcap=cap, scale=0.7)
    scores = torch.tanh(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.7 / cap) * cap
    pos = torch.arange(s)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    assert rel(out, ref) <= TOL
    assert max(rel(a, b) for a, b in zip(got, expected)) <= TOL


@pytest.mark.parametrize("variant", ["causal", "window", "packed", "left-padded+packed"])
def test_whole_sequence_attention_takes_the_fused_kernel_only_when_nothing_but_causality_masks(variant, monkeypatch):
    """causal_attention (what the backprop engine runs) equals the reference for every
    mask, and calls the fused kernel path exactly when the mask is plain causal."""
    import longtrain.ops.causal_attention as whole

    calls = []
    fused = whole._FusedCausal.apply
    monkeypatch.setattr(whole._FusedCausal, "apply", lambda *a: calls.append(1) or fused(*a))
    s = 70
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, s, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (4, 2, 2))
    segments = torch.zeros(2, s, dtype=torch.long) if "packed" in variant else None
    if segments is not None:
        segments[0, 33:] = 1
    key_valid = None
    if "left-padded" in variant:
        key_valid = torch.ones(2, s, dtype=torch.bool)
        key_valid[0, :5] = False
    window = 9 if variant == "window" else None
    out = causal_attention(q, k, v, mask=SequenceMask(segments, key_valid), window=window)
    ref = reference(q, k, v, window, segments, key_valid)
    grad = torch.randn_like(out)
    assert rel(out, ref) <= TOL
    got, expected = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    assert max(rel(a, b) for a, b in zip(got, expected)) <= TOL
    assert bool(calls) == (variant == "causal")


def test_block_planner_skips_earlier_documents_and_masks_only_where_it_must():
    from longtrain.ops.chunked_attention import chunk_bounds
    from longtrain.ops.masking import BlockPlanner

    s, chunk = 100, 20
    segments = torch.zeros(1, s, dtype=torch.long)
    segments[0, 50:] = 1  # a document boundary inside chunk 2 (tokens 40..59)
    valid = torch.ones(1, s, dtype=torch.bool)
    valid[0, 95:] = False  # padding in the last chunk
    planner = BlockPlanner(SequenceMask(segments, valid), chunk_bounds(s, chunk))
    cpu = torch.device("cpu")
    assert planner.plan(4, 0, None, cpu)[0]  # chunk 4 (doc 1) never sees chunk 0 (doc 0): skipped
    assert planner.plan(1, 0, None, cpu) == (False, False, None)  # inside doc 0, no padding: fused, unmasked
    assert planner.plan(1, 1, None, cpu) == (False, True, None)  # diagonal: the kernel's causal mode
    skip, causal, mask = planner.plan(3, 2, None, cpu)  # chunk 2 straddles the boundary
    assert not skip and mask is not None and not mask[0, 0, :10].any() and mask[0, 0, 10:].all()
    assert planner.plan(4, 4, None, cpu)[2] is not None  # padded keys
    assert planner.plan(3, 0, 50, cpu)[0]  # wholly outside a 50-token window


def test_cuda_kernel_argument_conventions_on_fake_cuda_tensors(monkeypatch):
    """The CUDA branch of the block kernels, run on fake CUDA tensors (no GPU needed):
    the ATen schemas accept the arguments, and the non-packed flash backward passes
    undefined cum_seq_q/k — a defined tensor, even an empty one, means variable-length
    packing to the CUDA kernel, which then demands int32 offsets (the first GPU run's crash)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longtrain.ops.attention_blocks import block_backward, block_forward

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "flash_attention" in func.__name__:
                calls.append((func.__name__, args))
            return func(*args, **(kwargs or {}))

    _pretend_gpu(monkeypatch, capability=(8, 0))  # Ampere: FlashAttention-2, no cuDNN attention
    with FakeTensorMode(), Record():
        q = torch.empty(1, 4, 64, 32, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 2, 64, 32, dtype=torch.bfloat16, device="cuda")
        for causal in (True, False):
            out, lse = block_forward(q, k, k, scale=0.2, causal=causal)
            dq, dk, dv = block_backward(out, q, k, k, out, lse, scale=0.2, causal=causal)
            assert out.device.type == "cuda" and dk.shape == k.shape and dq.shape == q.shape
    backward = [args for name, args in calls if "backward" in name]
    assert len(backward) == 2
    for args in backward:
        assert args[6] is None and args[7] is None  # cum_seq_q, cum_seq_k undefined
        assert args[5].dtype == torch.float32  # the log-sum-exp the kernel expects


def test_the_flash_backward_gets_a_dense_lse_for_each_query_block_of_a_longer_sequence(monkeypatch):
    """Whole-sequence chunked attention hands each query block its rows of the sequence's
    LSE: a strided slice when B·H > 1. FA2's CUDA backward indexes the LSE as a dense
    (B, H, S) array without checking strides — it would read other heads' rows and give
    wrong gradients silently. The CPU kernel honours strides, so the exactness tests pass
    either way; this watches what the kernel is given (the same on both branches)."""
    aten = torch.ops.aten
    kernel = aten._scaled_dot_product_flash_attention_for_cpu_backward
    lses = []

    def spy(dout, q, k, v, out, lse, *args, **kwargs):
        lses.append(lse)
        return kernel(dout, q, k, v, out, lse, *args, **kwargs)

    monkeypatch.setattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", spy)
    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    k = torch.randn(2, 2, 64, 16, requires_grad=True)
    chunked_attention(q, k, k, chunk=16).sum().backward()
    assert len(lses) == 10  # 4 query chunks: 4 + 3 + 2 + 1 blocks
    assert all(lse.is_contiguous() for lse in lses)


# ---- which fused kernel a block runs: chosen once per device, dtype, head dimension ----

def _pretend_gpu(monkeypatch, capability=(9, 0), cudnn=90500):
    """A CUDA device of ``capability`` with cuDNN ``cudnn`` as far as the kernel choice can
    tell (no GPU needed), and an empty choice cache."""
    import longtrain.ops.attention_blocks as blocks

    monkeypatch.setattr(blocks, "_chosen", {})
    monkeypatch.setattr(blocks, "_failed", set())
    monkeypatch.setattr(blocks, "_requested_kernel", None)
    monkeypatch.delenv(blocks.KERNEL_ENV, raising=False)
    asked = []
    monkeypatch.setattr(blocks, "_device_capability", lambda device: asked.append(device) or capability)
    monkeypatch.setattr(blocks, "_cudnn_version", lambda: cudnn)
    return asked


@pytest.mark.parametrize("capability,cudnn,dtype,head_dim,expected", [
    ((9, 0), 90500, torch.bfloat16, 128, "cudnn"),  # Hopper: cuDNN for half precision
    ((9, 0), 90500, torch.float16, 64, "cudnn"),
    ((10, 0), 90800, torch.bfloat16, 128, "cudnn"),  # Blackwell too
    ((9, 0), 90500, torch.bfloat16, 256, "flash"),  # head dim > 128: FA2 takes up to 256
    ((9, 0), 8906, torch.bfloat16, 128, "flash"),  # cuDNN 8: no
    ((8, 0), 90500, torch.bfloat16, 128, "flash"),  # Ampere: FA2
    ((7, 5), 90500, torch.bfloat16, 64, "math"),  # Turing: neither
    ((9, 0), 90500, torch.float32, 128, "math"),  # float32/float64 on CUDA: explicit scores
    ((9, 0), 90500, torch.float64, 128, "math"),
    ((9, 0), 90500, torch.bfloat16, 100, "math"),  # head dim not a multiple of 8
])
def test_kernel_choice_per_device_dtype_and_head_dim(monkeypatch, capability, cudnn, dtype, head_dim, expected):
    from longtrain.ops.attention_blocks import attention_kernel

    asked = _pretend_gpu(monkeypatch, capability, cudnn)
    cuda = torch.device("cuda", 0)
    assert attention_kernel(cuda, dtype, head_dim) == expected
    for _ in range(3):  # cached: the device is asked once
        attention_kernel(cuda, dtype, head_dim)
    assert len(asked) <= 2  # cudnn and flash each asked at most once, on the first choice


def test_deterministic_algorithms_keep_blocks_off_cudnn(monkeypatch):
    """cuDNN's fused attention is not deterministic: under torch.use_deterministic_algorithms
    (not warn-only) blocks take FlashAttention-2, as PyTorch's SDPA dispatch does."""
    import longtrain.ops.attention_blocks as blocks

    _pretend_gpu(monkeypatch)
    cuda = torch.device("cuda", 0)
    for strict, expected in ((True, "flash"), (False, "cudnn")):
        monkeypatch.setattr(blocks, "_chosen", {})
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda strict=strict: not strict)
        assert blocks.attention_kernel(cuda, torch.bfloat16, 128) == expected


def test_cpu_blocks_run_the_cpu_flash_kernel_for_every_dtype(monkeypatch):
    from longtrain.ops.attention_blocks import attention_kernel

    _pretend_gpu(monkeypatch)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        assert attention_kernel(torch.device("cpu"), dtype, 64) == "flash"


def test_kernel_override_by_environment_and_function(monkeypatch):
    import longtrain.ops.attention_blocks as blocks

    _pretend_gpu(monkeypatch, capability=(9, 0))
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv(blocks.KERNEL_ENV, "flash")
    assert blocks.attention_kernel(cuda, torch.bfloat16, 128) == "flash"
    monkeypatch.setenv(blocks.KERNEL_ENV, "math")
    assert blocks.attention_kernel(cuda, torch.bfloat16, 128) == "math"
    assert blocks.attention_kernel(torch.device("cpu"), torch.float64, 8) == "math"
    monkeypatch.setenv(blocks.KERNEL_ENV, "auto")
    assert blocks.attention_kernel(cuda, torch.bfloat16, 128) == "cudnn"
    blocks.set_attention_kernel("flash")  # the function wins over the environment
    try:
        assert blocks.attention_kernel(cuda, torch.bfloat16, 128) == "flash"
    finally:
        blocks.set_attention_kernel(None)
    monkeypatch.setenv(blocks.KERNEL_ENV, "cudnn")  # asked where it cannot run: a warning, then the best there is
    with pytest.warns(UserWarning, match="cannot run float32 blocks"):
        assert blocks.attention_kernel(cuda, torch.float32, 128) == "math"
    monkeypatch.setenv(blocks.KERNEL_ENV, "triton")
    with pytest.raises(LongtrainError, match="LONGTRAIN_ATTENTION_KERNEL: the attention kernel must be one of auto, cudnn, flash, math"):
        blocks.attention_kernel(cuda, torch.bfloat16, 128)


def _recorded_attention_calls(fn):
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func.__name__:
                calls.append((func.__name__, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Record():
        result = fn()
    return calls, result


def test_cudnn_kernel_argument_conventions_on_fake_cuda_tensors(monkeypatch):
    """The cuDNN branch on fake CUDA tensors (its ATen schema, no GPU): grouped K/V go in
    as they are and dK/dV come back grouped; the LSE comes back (B, H, S) in float32 and
    goes to the backward in the forward's own shape, contiguous; max_q/max_k are the
    block's lengths (the kernel reads them as its sequence lengths); no bias, no packing,
    unread philox seed/offset; every tensor contiguous (cuDNN caches plans by q/k/v
    layout only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longtrain.ops.attention_blocks import block_backward, block_forward, cudnn_lse_is_4d

    _pretend_gpu(monkeypatch, capability=(9, 0))
    lse_4d = cudnn_lse_is_4d()  # read from the op's meta kernel once (not recorded below)
    with FakeTensorMode():
        # (fake CUDA tensors on a CPU-only build cannot be copied: contiguous inputs here)
        q = torch.empty(1, 4, 48, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 2, 80, 64, dtype=torch.bfloat16, device="cuda")

        def run():
            out, lse = block_forward(q, k, k, scale=0.125, causal=False)
            grads = block_backward(out, q, k, k, out, lse, scale=0.125, causal=False)
            return out, lse, grads

        calls, (out, lse, (dq, dk, dv)) = _recorded_attention_calls(run)
    names = [name for name, _, _ in calls]
    assert names == ["_scaled_dot_product_cudnn_attention.default", "_scaled_dot_product_cudnn_attention_backward.default"]
    _, fargs, fkw = calls[0]
    assert fargs[1].shape[1] == 2 and fargs[3] is None and fargs[4] is True  # grouped K/V, no bias, LSE wanted
    assert all(t.is_contiguous() for t in fargs[:3]) and fkw["scale"] == 0.125
    assert lse.shape == (1, 4, 48) and lse.dtype == torch.float32 and out.shape == q.shape
    _, bargs, bkw = calls[1]
    grad_out, bq, bk, bv, bout, blse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout, causal = bargs
    assert blse.shape == ((1, 4, 48, 1) if lse_4d else (1, 4, 48)) and blse.is_contiguous()
    assert blse.dtype == torch.float32 and seed.dtype == offset.dtype == torch.int64
    assert bias is None and cum_q is None and cum_k is None and (max_q, max_k) == (48, 80)
    assert dropout == 0.0 and causal is False and bkw["scale"] == 0.125
    assert all(t.is_contiguous() for t in (grad_out, bq, bk, bv, bout))
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape  # grouped: no expand, no reduce


def test_a_kernel_that_fails_at_run_time_hands_over_to_the_next(monkeypatch):
    """A cuDNN refusal (a shape its library does not take) drops cuDNN for that device,
    dtype and head dimension with a warning; FlashAttention-2 does the block and the
    ones after it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import longtrain.ops.attention_blocks as blocks

    _pretend_gpu(monkeypatch, capability=(9, 0))

    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    monkeypatch.setattr(blocks, "_cudnn_forward", refuse)
    with FakeTensorMode():
        q = torch.empty(1, 4, 64, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.warns(UserWarning, match="'cudnn' failed .* using 'flash' from now on"):
            calls, _ = _recorded_attention_calls(lambda: blocks.block_forward(q, q, q, scale=0.125, causal=True))
        assert [name for name, _, _ in calls] == ["_scaled_dot_product_flash_attention.default"]
        assert blocks.attention_kernel(q.device, torch.bfloat16, 64) == "flash"
        with pytest.raises(torch.OutOfMemoryError):  # running out of memory is not a refusal
            monkeypatch.setattr(blocks, "_flash_forward", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
            blocks.block_forward(q, q, q, scale=0.125, causal=True)


def test_without_a_fused_kernel_kept_output_attention_never_forms_whole_sequence_scores():
    """Memo's attention (forward once, backward from the kept output) where no fused kernel
    runs — float32 on CUDA; forced here — works in blocks of explicit scores of at most
    1024² per head, never one s×s block (128 GiB at 32K tokens and 32 heads), and gives
    what the fused kernel gives."""
    from longtrain.ops.attention_blocks import set_attention_kernel
    from longtrain.ops.causal_attention import MASKED_BLOCK, causal_attention_backward, causal_attention_forward

    torch.manual_seed(0)
    b, h, s, d = 1, 4, 3 * MASKED_BLOCK + 100, 16
    q, dout = torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    k, v = torch.randn(b, 2, s, d), torch.randn(b, 2, s, d)
    want = causal_attention_forward(q, k, v)
    want_grads = causal_attention_backward(dout, q, k, v, *want)
    set_attention_kernel("math")
    try:
        with LargestTensor() as largest:
            out, lse = causal_attention_forward(q, k, v)
            grads = causal_attention_backward(dout, q, k, v, out, lse)
    finally:
        set_attention_kernel(None)
    assert largest.numel <= b * h * MASKED_BLOCK ** 2
    torch.testing.assert_close(out, want[0], rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-4)


def test_float32_sdpa_off_the_cpu_repeats_grouped_heads(monkeypatch):
    """Off the CPU only SDPA's memory-efficient kernel takes float32, and not with grouped
    K/V heads (enable_gqa would fall to the math kernel's s×s scores): K/V are repeated."""
    from longtrain.ops import sdpa

    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, q.shape[1], k.shape[1], kwargs.get("enable_gqa")))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.empty(1, 8, 64, 16, device="meta", dtype=dtype)
        kv = torch.empty(1, 2, 64, 16, device="meta", dtype=dtype)
        assert sdpa.sdpa_gqa(q, kv, kv, is_causal=True).shape == q.shape
    assert seen == [(torch.float32, 8, 8, False), (torch.bfloat16, 8, 2, True)]


def _documents(variant: str, s: int):
    """(segments, key_valid) of two rows: packed documents, left and right padding."""
    segments = torch.zeros(2, s, dtype=torch.long)
    key_valid = torch.ones(2, s, dtype=torch.bool)
    if "packed" in variant:
        segments[0, 23:] = 1
        segments[0, 50:] = 2
        segments[1, 31:] = 1
    if "left-padded" in variant:
        key_valid[1, :9] = False
    if "right-padded" in variant:  # padding queries still see their document's valid keys
        key_valid[0, s - 6:] = False
        key_valid[1, s - 11:] = False
    if "padded-inside" in variant:  # padding in the middle of a document: not one run of keys
        key_valid[0, 10:13] = False
    return segments, key_valid


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("variant", ["packed", "left-padded", "right-padded", "packed+left-padded+right-padded",
                                     "packed+padded-inside"])
def test_documents_take_one_fused_call_each_and_equal_sdpa_in_float64(variant, kv_heads):
    """Packed documents and left/right padding: each document is one fused causal call (and
    one unmasked call for the padding queries after its last key) whose results are written,
    never merged — exact against SDPA with the explicit mask; padding inside a document
    falls back to masked blocks, exact too."""
    from conftest import AttentionKernelCalls

    from longtrain.ops.causal_attention import attention_plan
    from longtrain.ops.masking import BlockPlanner, DocumentSpans

    s = 77
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, 4, s, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, s, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    segments, key_valid = _documents(variant, s)
    mask = SequenceMask(segments, key_valid)
    plan = attention_plan(q, mask, None, None)
    inside = "inside" in variant
    assert isinstance(plan, BlockPlanner if inside else DocumentSpans)
    with AttentionKernelCalls() as kernels:
        out = causal_attention(q, k, v, mask=mask)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
    ref = reference(q, k, v, None, segments, key_valid)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    assert rel(out, ref) <= TOL
    assert max(rel(a, b) for a, b in zip(got, expected)) <= TOL
    if not inside:
        calls = sum(1 + (end > last) for _, _, last, end in plan.spans)
        forward, backward = "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"
        assert kernels.calls == {forward: calls, backward: calls}  # no explicit scores, no merges


def test_document_spans_read_the_mask_once_and_know_when_not_to_apply():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longtrain.ops.causal_attention import attention_plan
    from longtrain.ops.masking import BlockPlanner, DocumentSpans, document_spans

    s = 40
    segments, key_valid = _documents("packed+left-padded+right-padded", s)
    spans = document_spans(SequenceMask(segments, key_valid), limit=8)
    # Row 0: documents 0:23 and 23:40 with its last 6 keys padding (the third starts past
    # the end); row 1: 9 keys of left padding, then documents 0:31 and 31:40 padded from 29.
    assert spans.spans == ((0, 0, 23, 23), (0, 23, 34, 40), (1, 9, 29, 31))
    assert spans.reach == max(end - first for _, first, _, end in spans.spans)
    assert document_spans(SequenceMask(segments, key_valid), limit=2) is None  # too many documents: blocks
    q = torch.zeros(2, 2, s, 8)
    mask = SequenceMask(segments, key_valid)
    assert isinstance(attention_plan(q, mask, spans.reach, None), DocumentSpans)  # the window hides nothing
    assert isinstance(attention_plan(q, mask, spans.reach - 1, None), BlockPlanner)  # it cuts a document
    assert isinstance(attention_plan(q, mask, None, 30.0), BlockPlanner)  # soft-capping: explicit scores
    with FakeTensorMode():  # the simulator cannot read a mask: the layout that holds the most memory
        fake = SequenceMask(torch.zeros(2, s, dtype=torch.long), torch.ones(2, s, dtype=torch.bool))
        assert document_spans(fake, limit=8).spans == ((0, 0, s, s), (1, 0, s, s))


@pytest.mark.parametrize("cuts", [0, 8])
@pytest.mark.parametrize("variant", ["packed", "left-padded+packed", "window", "soft-capped window"])
def test_large_masked_blocks_run_as_tiles_whose_scores_are_bounded(variant, cuts, monkeypatch):
    """A masked block longer than TILE tokens runs as TILE-token tiles (here 6 in 25-token
    chunks, as 1,024 in 8K chunks), cut where documents and padding start too (``cuts``: 0,
    never): exact in float64, and no tensor of the step is larger than a tile's scores or
    the sequence's own tensors."""
    monkeypatch.setattr("longtrain.ops.masking.TILE", 6)
    monkeypatch.setattr("longtrain.ops.masking.TILE_CUTS", cuts)

    s, chunk = 75, 25
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, s, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, s, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    segments, key_valid, window = _variant_mask(variant, s)
    softcap = 4.0 if "soft-capped" in variant else None
    with LargestTensor() as largest:
        out = chunked_attention(q, k, v, chunk=chunk, window=window, mask=SequenceMask(segments, key_valid),
                                softcap=softcap)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
    ref = reference(q, k, v, window, segments, key_valid, softcap)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    assert rel(out, ref) <= TOL
    assert max(rel(a, b) for a, b in zip(got, expected)) <= TOL
    assert largest.numel <= max(q.numel(), 2 * 4 * 6 * 6)  # a tile's scores (B·H·6²) at most, never 25²


@pytest.mark.parametrize("case", ["documents", "padding inside a document", "soft-capped"])
def test_a_step_reads_the_documents_of_its_mask_once_whatever_the_plan(case, monkeypatch):
    """The per-step attention call reads the documents once for all layers, also when
    they do not apply (padding inside a document: masked blocks), and not at all where
    they cannot (soft-capping): each read is a device-to-host copy."""
    import longtrain.ops.causal_attention as whole
    from longtrain.models.attention import WholeSequenceAttention

    reads = []
    monkeypatch.setattr(whole, "document_spans", lambda *a, **k: reads.append(1) or document_spans(*a, **k))
    s = 50
    segments, key_valid = _documents("packed+padded-inside" if case == "padding inside a document" else "packed", s)
    call = WholeSequenceAttention(SequenceMask(segments, key_valid))
    q, k, v = torch.randn(2, 4, s, 8), torch.randn(2, 2, s, 8), torch.randn(2, 2, s, 8)
    for _ in range(3):  # three layers
        call.attend(None, q, k, v, scale=None, window=None, softcap=30.0 if case == "soft-capped" else None)
    assert len(reads) == (0 if case == "soft-capped" else 1)


def test_a_large_masked_block_never_builds_its_whole_mask(monkeypatch):
    """Tiling decides the block without its (Cq, Ck) mask: only tile-sized masks are built."""
    from longtrain.ops.chunked_attention import chunk_bounds
    from longtrain.ops.masking import BlockPlanner

    monkeypatch.setattr("longtrain.ops.masking.TILE", 8)
    built = []
    dense = BlockPlanner._dense
    monkeypatch.setattr(BlockPlanner, "_dense", lambda self, qa, qb, ka, kb, *a: built.append((qb - qa, kb - ka))
                        or dense(self, qa, qb, ka, kb, *a))
    s = 64
    segments = torch.zeros(1, s, dtype=torch.long)
    segments[0, 37:] = 1
    planner = BlockPlanner(SequenceMask(segments, None), chunk_bounds(s, 32))
    tiles = planner.tiles(1, 1, None, torch.device("cpu"))
    # Tiles of 8 over 32:64, cut at the document start 37 too: each lies in one document,
    # so none needs a mask — the other document's tiles are skipped, the rest fused.
    assert [q for q, k, _, mask in tiles] == [(32, 37), (37, 40), (40, 48), (40, 48), (48, 56), (48, 56), (48, 56),
                                              (56, 64), (56, 64), (56, 64), (56, 64)]
    assert all(mask is None for *_, mask in tiles) and not built
    monkeypatch.setattr("longtrain.ops.masking.TILE_CUTS", 0)  # too many documents to cut at: masked tiles
    tiles = BlockPlanner(SequenceMask(segments, None), chunk_bounds(s, 32)).tiles(1, 1, None, torch.device("cpu"))
    assert [(q, k) for q, k, _, mask in tiles if mask is not None] == [((a, a + 8), (32, 40)) for a in (32, 40, 48, 56)]
    assert built and max(max(shape) for shape in built) <= 8
    assert built and max(max(shape) for shape in built) <= 8


def test_a_single_key_block_avoids_cudnn(monkeypatch):
    """cuDNN refuses a key length of 1 (PyTorch's SDPA never sends it one): such a block —
    a one-token document, a last chunk of one token — takes FA2, and only that block."""
    from longtrain.ops import attention_blocks as blocks

    monkeypatch.setattr(blocks, "attention_kernel", lambda *a: "cudnn")
    monkeypatch.setattr(blocks, "kernel_supported", lambda kernel, *a: kernel in ("cudnn", "flash"))
    q = torch.empty(1, 4, 3, 64, device="meta", dtype=torch.bfloat16)
    one, two = (torch.empty(1, 2, n, 64, device="meta", dtype=torch.bfloat16) for n in (1, 2))
    assert blocks.block_kernel(q, one, None, None) == "flash"
    assert blocks.block_kernel(q, two, None, None) == "cudnn"
