"""The CUDA tier: every engine and technique on a CUDA device against a float64 reference.

Skipped where no GPU is present (CI runs on CPU); ``python benchmarks/gpu_suite.py``
runs it on a GPU machine. What CPU tests cannot show, these check on the device:
streams and events of the chunk store, pinned host buffers, the CUDA flash kernels'
argument conventions, backward (and checkpoint recomputation) on autograd's device
thread. Per model and strategy: two steps (the second reuses the store's streams and the
pinned pool, which must not grow); float32 within 1e-5 of float64, bfloat16 no worse than
1.5 × the error of stock Hugging Face in bfloat16 on the same device.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import grads, padded_batch, stock_and_ours

import longtrain as lt
from longtrain.models.loading import build_from_config, default_dtype
from longtrain.models.presets import preset_config
from longtrain.strategy import applied_context

pytestmark = pytest.mark.cuda

FP32_TOL = 1e-5
BF16_FACTOR = 1.5

# Chunks of 256 and 300 tokens over rows of 1000 and 950 tokens: no chunk divides a row.
CUDA_STRATEGIES = {
    "backprop": lambda: lt.Strategy(),
    "checkpoint": lambda: lt.Strategy(checkpoint=True),
    "mst": lambda: lt.Strategy(mst=lt.MsTOptions(loss_chunks=4)),
    "checkpoint+mst": lambda: lt.Strategy(checkpoint=True, mst=True),  # attention kept in pinned host memory
    "checkpoint(recompute attention)": lambda: lt.Strategy(checkpoint={"keep_attention": False}),
    "checkpoint(top layer whole)+mst": lambda: lt.Strategy(checkpoint={"except_last": 1}, mst=True),
    "checkpoint(inputs parked)+mst": lambda: lt.Strategy(checkpoint={"offload_inputs": True}, mst=True),
    "checkpoint(inputs parked, host full)": lambda: lt.Strategy(checkpoint={"offload_inputs": True, "host_memory": 1}),
    "fpdt": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 256}),
    "fpdt+offload(prefetch 1)": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 300, "offload": True}),
    "fpdt+offload(prefetch 2)+mst": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 256, "offload": True, "prefetch": 2},
                                                        mst=True),
    "fpdt+offload,kv-kept": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 300, "offload": True, "recompute_kv": False}),
    "fpdt+inputs parked (K/V on the device)": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 300, "offload_inputs": True,
                                                                                             "keep_output": 1}),
    "seco": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 256}),
    "seco+offload+checkpoint+mst": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 300, "offload": True, "prefetch": 2},
                                                       checkpoint=True, mst=True),
    "spaco(every chunk)": lambda: lt.Strategy(engine="spaco", engine_options={"chunk": 256, "budget": 8}),
    "fpdt+offload,output-kept": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 300, "offload": True,
                                                                                   "keep_output": True}),
    "fpdt+offload,segments": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 300, "offload": True,
                                                                                "segment": 2}),
    "memo(α=0)": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=0.0, keep_last=0)),
    "memo(α=0.3)+mst": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=0.3, keep_last=1), mst=True),
    "memo(α=1)": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=1.0, keep_last=0)),
    "memo(auto)": lambda: lt.Strategy(memo=lt.MemoOptions(host_memory="8GiB")),
}
PRESETS = ["tiny-llama", "tiny-gemma2"]


def cuda_config(preset: str):
    """The tiny preset widened to head dimension 64, which every CUDA flash kernel takes."""
    config = preset_config(preset)
    config.hidden_size, config.intermediate_size = 256, 512
    config.head_dim = 64
    if getattr(config, "query_pre_attn_scalar", None):
        config.query_pre_attn_scalar = 64
    config.use_cache = False
    return config


def _batch(device=None):
    # Padding stays shorter than Gemma-2's 64-token window (stock Gemma-2 gives NaN where a
    # window holds only padding).
    batch = padded_batch(320, lengths=(1000, 950))
    return {k: v.to(device) for k, v in batch.items()} if device else batch


@functools.lru_cache(maxsize=None)
def reference(preset: str):
    """Stock Hugging Face in float64 on the CPU: the weights, the loss and the gradients."""
    stock, _ = stock_and_ours(cuda_config(preset))
    batch = _batch()
    loss = _stock_loss(stock, batch)
    loss.backward()
    return stock.state_dict(), float(loss.detach()), grads(stock)


def _stock_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), batch["labels"][:, 1:].flatten(), ignore_index=-100)


def _global_error(got: dict, exact: dict) -> float:
    """‖got − exact‖ / ‖exact‖ over all gradients together."""
    num = sum(float((got[k].double().cpu() - exact[k]).norm() ** 2) for k in exact)
    return (num / sum(float(exact[k].norm() ** 2) for k in exact)) ** 0.5


def _ours_on_cuda(preset: str, dtype: torch.dtype, strategy):
    weights, _, _ = reference(preset)
    model = build_from_config(cuda_config(preset), dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
    return lt.apply(model.cuda().train(), strategy)


def _two_steps(model, batch) -> list[tuple[float, dict]]:
    """Two steps on the same batch; each step's loss and gradients (the pool must not grow)."""
    results, pooled = [], []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = lt.step(model, batch)
        torch.cuda.synchronize()
        results.append((float(loss), grads(model)))
        pooled.append(applied_context(model).pool.allocated_bytes)
    assert pooled[1] == pooled[0], f"the pinned pool grew from {pooled[0]} to {pooled[1]} bytes: buffers were re-pinned"
    return results


@pytest.mark.parametrize("strategy", list(CUDA_STRATEGIES))
@pytest.mark.parametrize("preset", PRESETS)
def test_float32_on_cuda_equals_float64(preset, strategy):
    _, ref_loss, ref_grads = reference(preset)
    model = _ours_on_cuda(preset, torch.float32, CUDA_STRATEGIES[strategy]())
    for loss, got in _two_steps(model, _batch("cuda")):
        assert abs(loss - ref_loss) <= FP32_TOL * abs(ref_loss)
        assert got.keys() == ref_grads.keys()
        worst = max(float((got[k].double().cpu() - ref_grads[k]).norm() / ref_grads[k].norm()) for k in ref_grads)
        assert worst <= FP32_TOL, worst


@functools.lru_cache(maxsize=None)
def _stock_bf16_step(preset: str):
    """Stock Hugging Face in bfloat16 on the device, after one backward on the batch."""
    weights, _, _ = reference(preset)
    config = cuda_config(preset)
    attention = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    from transformers import AutoModelForCausalLM

    with default_dtype(torch.bfloat16):
        stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attention)
    stock.load_state_dict({k: v.to(torch.bfloat16) for k, v in weights.items()})
    stock = stock.cuda().train()
    _stock_loss(stock, _batch("cuda")).backward()
    return stock


def stock_bf16_error(preset: str) -> float:
    """Stock Hugging Face in bfloat16 on the same device: its gradient error."""
    return _global_error(grads(_stock_bf16_step(preset)), reference(preset)[2])


@pytest.mark.parametrize("strategy", list(CUDA_STRATEGIES))
@pytest.mark.parametrize("preset", PRESETS)
def test_bfloat16_on_cuda_is_no_worse_than_stock_bfloat16(preset, strategy):
    _, ref_loss, ref_grads = reference(preset)
    model = _ours_on_cuda(preset, torch.bfloat16, CUDA_STRATEGIES[strategy]())
    bound = BF16_FACTOR * stock_bf16_error(preset)
    for loss, got in _two_steps(model, _batch("cuda")):
        assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss)
        error = _global_error(got, ref_grads)
        assert error <= bound, (error, bound)


def _per_weight_errors(model, exact: dict) -> dict:
    """Each weight matrix's gradient error relative to its norm."""
    return {n: float((p.grad.double().cpu() - exact[n]).norm() / exact[n].norm())
            for n, p in model.named_parameters() if p.dim() > 1}


@pytest.mark.parametrize("preset", PRESETS)
def test_fpdt_in_many_chunks_keeps_every_bf16_weight_gradient_as_close_as_stocks(preset):
    """Rows of 1,000 and 950 tokens in chunks of 32 (32 chunks): FPDT's float32 sums over the chunks
    (engines/gradient_sum.py, the head's GradientCarry) keep each weight matrix's gradient
    error within 1.25x of stock Hugging Face's in bf16 on this device. The same test run
    on the CPU: 1.07x at most, and 1.33x (Llama's head) with ``float32_grad_sum=false``."""
    exact = reference(preset)[2]
    stock_errors = _per_weight_errors(_stock_bf16_step(preset), exact)
    model = _ours_on_cuda(preset, torch.bfloat16, lt.Strategy(engine="fpdt", engine_options={"chunk": 32}))
    lt.step(model, _batch("cuda"))
    ours = _per_weight_errors(model, exact)
    ratios = {n: ours[n] / stock_errors[n] for n in stock_errors}
    assert max(ratios.values()) < 1.25, ratios


# ---- Liger's kernels under longtrain's engines (where liger-kernel is installed) ----

LIGER_STRATEGIES = {
    "checkpoint+mst+liger": lambda: lt.Strategy(checkpoint=True, mst=True, liger=True),
    "fpdt+offload+mst+liger": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 300, "offload": True},
                                                  mst=True, liger=True),
    "seco+checkpoint+liger": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 256}, checkpoint=True,
                                                 liger=True),
}


@pytest.fixture
def liger_patches():
    """Liger patches the family's modeling module for the whole process (its rotary
    function, its norm and MLP classes): undone after each test, so the stock references
    of other tests stay stock."""
    pytest.importorskip("liger_kernel")
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.llama import modeling_llama

    saved = [(module, dict(vars(module))) for module in (modeling_llama, modeling_gemma2)]
    yield
    for module, attributes in saved:
        for name in set(vars(module)) - set(attributes):
            delattr(module, name)
        for name, value in attributes.items():
            if getattr(module, name) is not value:
                setattr(module, name, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", list(LIGER_STRATEGIES))
@pytest.mark.parametrize("preset", PRESETS)
def test_liger_kernels_under_each_engine_equal_float64(preset, strategy, dtype, liger_patches):
    _, ref_loss, ref_grads = reference(preset)
    bound = BF16_FACTOR * stock_bf16_error(preset)  # the stock bf16 model, built before Liger patches anything
    model = _ours_on_cuda(preset, dtype, LIGER_STRATEGIES[strategy]())
    for loss, got in _two_steps(model, _batch("cuda")):
        if dtype == torch.float32:
            assert abs(loss - ref_loss) <= FP32_TOL * abs(ref_loss)
            worst = max(float((got[k].double().cpu() - ref_grads[k]).norm() / ref_grads[k].norm()) for k in ref_grads)
            assert worst <= FP32_TOL, worst
        else:
            assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss)
            assert _global_error(got, ref_grads) <= bound


def _synchronizing_calls(strategy, layers: int) -> int:
    """CUDA calls that make the host wait for the device (PyTorch's sync debug mode warns
    at each: scalar reads, copies from pageable memory, explicit synchronizes) in the
    second step of a bf16 model with ``layers`` layers."""
    import warnings

    config = cuda_config("tiny-llama")
    config.num_hidden_layers = layers
    model = lt.apply(build_from_config(config, torch.bfloat16).cuda().train(), strategy)
    batch = _batch("cuda")
    lt.step(model, batch)  # one-time work (Memo's α, the pinned pool) stays out of the count
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            lt.step(model, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


@pytest.mark.parametrize("strategy", ["checkpoint+mst", "fpdt+offload(prefetch 2)+mst", "fpdt+offload,output-kept",
                                      "fpdt+inputs parked (K/V on the device)",
                                      "seco+offload+checkpoint+mst", "memo(α=0.3)+mst"])
def test_the_host_waits_for_the_device_a_fixed_few_times_per_step(strategy):
    """A synchronization in the chunk or layer loop serializes host and device work (the
    fitted per-chunk-and-layer overhead of the chunked engines is 6.8 ms). On the CPU,
    tests/test_fpdt.py counts the ops that would synchronize; here the device says. The
    count may not grow with the layers or, for the chunked engines, with the chunks (a
    wait in the layer loop adds one per layer: 4 layers at least two more than 2). Fewer
    with more layers is allowed: checkpoint+mst waited 5 times with 2 layers and 4 with 4
    on an H200 (2026-11-26), twice in a row."""
    two, four = (_synchronizing_calls(CUDA_STRATEGIES[strategy](), layers) for layers in (2, 4))
    assert four <= two, (two, four)
    chunked = CUDA_STRATEGIES[strategy]()
    if chunked.engine != "backprop":
        halved = lt.Strategy.parse(chunked, engine_options={"chunk": chunked.engine_options.chunk // 2})
        assert _synchronizing_calls(halved, 2) == two, (two, _synchronizing_calls(halved, 2))


def test_offload_keeps_kv_and_inputs_off_the_device():
    """Growing the sequence 4× grows the device peak (CUDA allocator) far less with
    offload than with every chunk kept on the device."""

    def growth(offload: bool) -> int:
        peaks = []
        for length in (1024, 4096):
            strategy = lt.Strategy(engine="fpdt", engine_options={"chunk": 256, "offload": offload})
            model = _ours_on_cuda("tiny-llama", torch.bfloat16, strategy)
            batch = {"input_ids": torch.randint(0, 320, (1, length), device="cuda")}
            lt.step(model, batch)  # warm-up: the pool and the kernels
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            lt.step(model, batch)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            del model
        return peaks[1] - peaks[0]

    assert growth(True) < 0.5 * growth(False)


def test_pinned_buffers_lock_exactly_their_bytes_and_copy_asynchronously():
    """longtrain's own page-locked buffers (not PyTorch's power-of-two pool): pinned as the
    driver sees them, copied both ways on a side stream, unlocked when dropped."""
    from longtrain.memory.pinned import host_empty

    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats().get("allocated_bytes.current", 0) if stats else 0
    numel = 3 * 2**20 + 5
    host = host_empty(numel, torch.bfloat16, pin=True)
    assert host.is_pinned() and host.numel() == numel
    if stats:  # nothing from PyTorch's pinned pool
        assert stats().get("allocated_bytes.current", 0) == before
    source = torch.randn(numel, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(source, non_blocking=True)
        back = torch.empty_like(source)
        back.copy_(host, non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(back, source) and torch.equal(host, source.cpu())
    del host
    again = host_empty(numel, torch.bfloat16, pin=True)  # the same pages may come back: registering must work again
    assert again.is_pinned()


def test_adjoint_on_cuda_equals_float64_autograd():
    from longtrain.ops.loss import causal_lm_loss

    config = preset_config("tiny-ssm", num_hidden_layers=3)
    torch.manual_seed(0)
    reference_model = build_from_config(copy.deepcopy(config), torch.float64).train()
    batch = _batch()
    out = reference_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    causal_lm_loss(out.logits, batch["labels"], int((batch["labels"][:, 1:] != -100).sum())).backward()
    model = build_from_config(config, torch.float32)
    model.load_state_dict({k: v.float() for k, v in reference_model.state_dict().items()})
    model = lt.apply(model.cuda().train(), lt.Strategy(engine="adjoint", engine_options={"block": 128}))
    for _, got in _two_steps(model, _batch("cuda")):
        expected = grads(reference_model)
        worst = max(float((got[k].double().cpu() - expected[k]).norm() / expected[k].norm()) for k in expected)
        assert worst <= FP32_TOL, worst


# ---- every attention kernel the device has, and the head's float32 accumulation ----

def _kernel_available(kernel: str, head_dim: int = 128) -> bool:
    from longtrain.ops.attention_blocks import kernel_supported

    return kernel_supported(kernel, torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, head_dim)


@pytest.fixture
def forced_kernel():
    from longtrain.ops.attention_blocks import set_attention_kernel

    yield set_attention_kernel
    set_attention_kernel(None)


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "math"])
def test_each_attention_kernel_gives_exact_blocks_in_bfloat16(kernel, forced_kernel):
    """A query chunk split over an earlier key chunk (full block) and its own (causal
    block), grouped K/V heads, merged by LSE and differentiated block by block from the
    global output and LSE: bf16 within bf16 error of a float64 reference, on each kernel
    (the kernel that ran is checked by name)."""
    if not _kernel_available(kernel):
        pytest.skip(f"{kernel} attention is not available on this device")
    from conftest import AttentionKernelCalls

    from longtrain.ops.attention_blocks import block_backward, block_forward, merge_

    forced_kernel(kernel)
    torch.manual_seed(0)
    c, d = 1024, 128
    q = torch.randn(1, 8, c, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 2 * c, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    scale = d ** -0.5
    with AttentionKernelCalls() as calls:
        out0, lse0 = block_forward(q, k[:, :, :c], v[:, :, :c], scale=scale, causal=False)
        out1, lse1 = block_forward(q, k[:, :, c:], v[:, :, c:], scale=scale, causal=True)
        out, lse = out0.float(), lse0.clone()
        merge_(out, lse, out1, lse1)
        out = out.to(torch.bfloat16)
        g0 = block_backward(dout, q, k[:, :, :c], v[:, :, :c], out, lse, scale=scale, causal=False)
        g1 = block_backward(dout, q, k[:, :, c:], v[:, :, c:], out, lse, scale=scale, causal=True)
    expected_name = {"cudnn": "cudnn_attention", "flash": "flash_attention", "math": None}[kernel]
    if expected_name:
        assert any(expected_name in name for name in calls.calls), calls.calls
    else:
        assert not calls.calls, calls.calls
    # float64 reference: the same query rows at positions c..2c-1 over keys 0..2c-1
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    pos_q, pos_k = torch.arange(c, 2 * c, device="cuda"), torch.arange(2 * c, device="cuda")
    mask = pos_k[None, :] <= pos_q[:, None]
    ref = F.scaled_dot_product_attention(q64, k64.repeat_interleave(4, 1), v64.repeat_interleave(4, 1), attn_mask=mask,
                                         scale=scale)
    ref.backward(dout.double())
    dq = g0[0].double() + g1[0].double()
    dk = torch.cat([g0[1], g1[1]], dim=2).double()
    dv = torch.cat([g0[2], g1[2]], dim=2).double()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    assert rel(out.double(), ref.detach()) < 1e-2
    for got, want in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert rel(got, want) < 2e-2


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_whole_sequence_chunked_attention_with_several_heads_and_rows_on_each_kernel(kernel, forced_kernel):
    """chunked_attention over 4 chunks, batch 2, 8 query / 2 K/V heads: each query block's
    backward gets its rows of the sequence's LSE (FA2's kernel reads it as dense: a strided
    slice gave other heads' rows). bf16 within bf16 error of float64 SDPA."""
    if not _kernel_available(kernel):
        pytest.skip(f"{kernel} attention is not available on this device")
    from longtrain.ops.chunked_attention import chunked_attention

    forced_kernel(kernel)
    torch.manual_seed(0)
    q = torch.randn(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    chunked_attention(q, k, v, chunk=512).backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q64, k64.repeat_interleave(4, 1), v64.repeat_interleave(4, 1),
                                   is_causal=True).backward(dout.double())
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("length", [1000, 1201])
def test_chunks_of_lengths_no_power_of_two_divides_stay_exact_on_each_kernel(kernel, length, forced_kernel):
    """Blocks of 300 tokens and a short last one (100; 1 at 1,201: a single key, which cuDNN
    refuses and the next kernel takes): PyTorch's SDPA dispatch sends cuDNN 9 such lengths as
    it is, and so do the blocks. bf16 within bf16 error of float64 SDPA; cuDNN's run checked
    by name."""
    if not _kernel_available(kernel):
        pytest.skip(f"{kernel} attention is not available on this device")
    from conftest import AttentionKernelCalls

    from longtrain.ops.chunked_attention import chunked_attention

    forced_kernel(kernel)
    torch.manual_seed(0)
    q = torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, length, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    with AttentionKernelCalls() as calls:
        chunked_attention(q, k, v, chunk=300).backward(dout)
    assert any({"cudnn": "cudnn_attention", "flash": "flash_attention"}[kernel] in name for name in calls.calls)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q64, k64.repeat_interleave(4, 1), v64.repeat_interleave(4, 1),
                                   is_causal=True).backward(dout.double())
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_packed_and_padded_documents_take_one_fused_call_each_on_each_kernel(kernel, forced_kernel):
    """Whole-sequence attention over packed documents with left and right padding: one
    fused call per document (lengths no kernel tile divides, a query block after the last
    key, grouped heads, batch 2), bf16 within bf16 error of float64 SDPA with the mask."""
    if not _kernel_available(kernel):
        pytest.skip(f"{kernel} attention is not available on this device")
    from longtrain.ops.causal_attention import attention_plan, causal_attention
    from longtrain.ops.masking import DocumentSpans, SequenceMask

    forced_kernel(kernel)
    torch.manual_seed(0)
    s = 3001
    segments = torch.zeros(2, s, dtype=torch.long, device="cuda")
    segments[0, 1100:] = 1
    segments[1, 2000:] = 1
    key_valid = torch.ones(2, s, dtype=torch.bool, device="cuda")
    key_valid[0, -77:] = False  # right padding: queries after the last key see the whole document
    key_valid[1, :130] = False  # left padding: those queries see nothing
    mask = SequenceMask(segments, key_valid)
    q = torch.randn(2, 8, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    assert isinstance(attention_plan(q, mask, None, None), DocumentSpans)
    dout = torch.randn_like(q)
    causal_attention(q, k, v, mask=mask).backward(dout)
    pos = torch.arange(s, device="cuda")
    allowed = ((pos[None, :] <= pos[:, None])[None] & (segments[:, :, None] == segments[:, None, :])
               & key_valid[:, None, :])[:, None]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q64, k64.repeat_interleave(4, 1), v64.repeat_interleave(4, 1),
                                   attn_mask=allowed).nan_to_num(0.0).backward(dout.double())
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 2e-2


def test_auto_kernel_on_this_device_is_the_fastest_it_has():
    from longtrain.ops.attention_blocks import attention_kernel

    device = torch.device("cuda", torch.cuda.current_device())
    major, _ = torch.cuda.get_device_capability(device)
    chosen = attention_kernel(device, torch.bfloat16, 128)
    if _kernel_available("cudnn"):
        assert chosen == "cudnn" and major >= 9
    elif _kernel_available("flash"):
        assert chosen == "flash"
    assert attention_kernel(device, torch.float32, 128) == "math"


def test_bf16_head_weight_gradient_accumulates_in_float32_on_cuda():
    """The chunked head's weight gradient: one bf16 GEMM per chunk accumulating into a
    float32 buffer (addmm with out_dtype), not a fallback; close to float64."""
    import warnings

    from longtrain.ops import gemm
    from longtrain.ops.chunked_loss import chunked_causal_lm_loss

    torch.manual_seed(0)
    x = torch.randn(1, 4096, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.05 * torch.randn(2048, 256, device="cuda")).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 2048, (1, 4096), device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback warns
        chunked_causal_lm_loss(x, w, labels, chunks=8).backward()
    assert not gemm.addmm_fallback_devices()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    chunked_causal_lm_loss(x64, w64, labels, chunks=8).backward()
    assert float((w.grad.double() - w64.grad).norm() / w64.grad.norm()) < 1e-2


def test_bf16_tiled_mlp_weight_gradients_accumulate_in_float32_on_cuda():
    """The tiled MLP's linears: each tile's weight gradient is one bf16 GEMM accumulating
    into the float32 sum (addmm with out_dtype), not a fallback; the error against float64
    is at most stock bf16's (one GEMM over every token, one rounding)."""
    import copy
    import warnings

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from longtrain.ops import gemm
    from longtrain.ops.tiled_mlp import tiled_mlp

    torch.manual_seed(0)
    exact = LlamaMLP(LlamaConfig(hidden_size=256, intermediate_size=896)).to("cuda", torch.float64)
    x = torch.randn(8192, 256, device="cuda", dtype=torch.float64)
    grad_out = torch.randn_like(x)
    expected = torch.autograd.grad(exact(x), list(exact.parameters()), grad_out)
    half = copy.deepcopy(exact).bfloat16()
    params = list(half.parameters())
    stock = torch.autograd.grad(half(x.bfloat16()), params, grad_out.bfloat16())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback warns
        tiled = torch.autograd.grad(tiled_mlp(half, x.bfloat16(), params, 512, module=half), params, grad_out.bfloat16())
    assert not gemm.addmm_fallback_devices()
    for ours, theirs, want in zip(tiled, stock, expected):
        assert ours.dtype == torch.bfloat16
        assert float((ours.double() - want).norm() / want.norm()) <= 1.1 * float((theirs.double() - want).norm() / want.norm())


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("strategy", ["checkpoint+mst", "fpdt+offload,output-kept"])
def test_bfloat16_strategies_on_each_kernel(kernel, strategy, forced_kernel):
    """Whole steps on each fused kernel (auto picks one; this forces the other too)."""
    if not _kernel_available(kernel, head_dim=64):
        pytest.skip(f"{kernel} attention is not available on this device")
    forced_kernel(kernel)
    _, ref_loss, ref_grads = reference("tiny-llama")
    model = _ours_on_cuda("tiny-llama", torch.bfloat16, CUDA_STRATEGIES[strategy]())
    bound = BF16_FACTOR * stock_bf16_error("tiny-llama")
    for loss, got in _two_steps(model, _batch("cuda")):
        assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss)
        assert _global_error(got, ref_grads) <= bound


# ---- the families added with the model description: Gemma-3, mixtures of experts (gpt-oss's sinks too), Mamba ----

FAMILY_STRATEGIES = ["backprop", "checkpoint+mst", "checkpoint(inputs parked)+mst", "fpdt+offload(prefetch 2)+mst",
                     "fpdt+offload,output-kept", "seco+offload+checkpoint+mst", "spaco(every chunk)", "memo(α=1)"]
FAMILY_PRESETS = ["tiny-gemma3", "tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss"]


def family_cuda_config(preset: str):
    """The preset at head dimension 64; Gemma-3's window (64) longer than the padding (50)."""
    config = cuda_config(preset)
    if getattr(config, "sliding_window", None):
        config.sliding_window = 64
    return config


@functools.lru_cache(maxsize=None)
def family_reference(preset: str):
    """Stock Hugging Face in float64 on the CPU, experts run one by one."""
    from longtrain.families.check import _build_pair

    stock, _ = _build_pair(family_cuda_config(preset))
    batch = _batch()
    loss = _stock_loss(stock, batch)
    loss.backward()
    return stock.state_dict(), float(loss.detach()), grads(stock)


@pytest.mark.parametrize("strategy", FAMILY_STRATEGIES)
@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_new_families_in_float32_on_cuda_equal_float64(preset, strategy):
    """On the device the experts run in their default (grouped) kernels, the CPU reference one by one."""
    weights, ref_loss, ref_grads = family_reference(preset)
    model = build_from_config(family_cuda_config(preset), torch.float32)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    model = lt.apply(model.cuda().train(), CUDA_STRATEGIES[strategy]())
    for loss, got in _two_steps(model, _batch("cuda")):
        assert abs(loss - ref_loss) <= FP32_TOL * abs(ref_loss)
        assert got.keys() == ref_grads.keys()
        worst = max(float((got[k].double().cpu() - ref_grads[k]).norm() / ref_grads[k].norm()) for k in ref_grads)
        assert worst <= FP32_TOL, worst


MAMBA_STRATEGIES = {"backprop": lambda: lt.Strategy(), "checkpoint,mst": lambda: lt.Strategy(checkpoint=True, mst=True),
                    "checkpoint:offload_inputs,mst": lambda: lt.Strategy.parse("checkpoint:offload_inputs,mst"),
                    "adjoint": lambda: lt.Strategy(engine="adjoint", engine_options={"block": 64}),
                    "adjoint(kept)": lambda: lt.Strategy(engine="adjoint", engine_options={"block": 100, "recompute": False}),
                    "adjoint:offload_inputs": lambda: lt.Strategy(engine="adjoint", engine_options={"block": 64,
                                                                                                    "offload_inputs": True}),
                    "adjoint:chunk": lambda: lt.Strategy(engine="adjoint", engine_options={"block": 16, "chunk": 48})}


@functools.lru_cache(maxsize=None)
def mamba_reference(preset: str):
    config = preset_config(preset, num_hidden_layers=3)
    torch.manual_seed(0)
    model = build_from_config(config, torch.float64).train()
    batch = padded_batch(320, lengths=(300, 270))
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    out.loss.backward()
    return config, model.state_dict(), float(out.loss), grads(model), batch


@pytest.mark.parametrize("strategy", list(MAMBA_STRATEGIES))
@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-mamba2"])
def test_mamba_in_float32_on_cuda_equals_float64(preset, strategy):
    """Hugging Face Mamba's and Mamba-2's PyTorch paths on the device, backward on autograd's device thread."""
    config, weights, ref_loss, ref_grads, batch = mamba_reference(preset)
    model = build_from_config(copy.deepcopy(config), torch.float32)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    model = lt.apply(model.cuda().train(), MAMBA_STRATEGIES[strategy]())
    for loss, got in _two_steps(model, {k: v.cuda() for k, v in batch.items()}):
        assert abs(loss - ref_loss) <= FP32_TOL * abs(ref_loss)
        worst = max(float((got[k].double().cpu() - ref_grads[k]).norm() / ref_grads[k].norm()) for k in ref_grads)
        assert worst <= FP32_TOL, worst


@pytest.mark.parametrize("strategy", ["checkpoint,mst", "fpdt:chunk=256:offload,mst"])
def test_streamed_frozen_weights_on_cuda_are_bit_for_bit_the_step_without(strategy):
    """Side-stream copies, the compute stream waiting on them, backward on autograd's
    device thread: the same bytes as the unstreamed step, and only a window of layers'
    weights on the device."""
    from longtrain.models.loading import add_lora

    config = preset_config("tiny-qwen3-moe")
    config.num_hidden_layers = 6
    _, model = stock_and_ours(config, dtype=torch.bfloat16)
    model = add_lora(model, rank=4).cuda()
    streamed = copy.deepcopy(model)
    lt.apply(model, strategy)
    lt.apply(streamed, strategy + ",stream")
    batch = {k: v.cuda() for k, v in padded_batch(config.vocab_size, lengths=(700, 555)).items()}
    losses = []
    for m in (model, streamed):
        torch.manual_seed(0)
        losses.append(lt.step(m, batch))
    torch.cuda.synchronize()
    assert torch.equal(losses[0], losses[1])
    plain, ours = grads(model), grads(streamed)
    assert all(torch.equal(plain[name], ours[name]) for name in plain)
    stream = applied_context(streamed).weight_stream
    on_device = [p for group in stream.groups for p in group if p.device.type == "cuda"]
    assert sum(p.nbytes for p in on_device) <= 2 * sum(t.nbytes for t in stream.host[0])


def test_master_adamw_fused_on_cuda_is_float32_adamw_rounded_into_the_weights(monkeypatch):
    """The fused CUDA path of MasterAdamW, over several buckets: float32 AdamW (fused) on
    float32 copies fed the same gradients, rounded into the bfloat16 weights."""
    import longtrain.optimizers as optimizers

    monkeypatch.setattr(optimizers, "BUCKET_BYTES", 256 * 256 * 4)
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
    references = [torch.nn.Parameter(w.detach().float().clone()) for w in weights]
    ours = optimizers.make_optimizer("adamw", weights, lr=1e-3, weight_decay=0.1)
    stock = torch.optim.AdamW(references, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    for _ in range(3):
        for w, r in zip(weights, references):
            g = torch.randn(w.shape, device="cuda").to(w.dtype)
            w.grad, r.grad = g, g.float()
        ours.step()
        stock.step()
        ours.zero_grad()
        stock.zero_grad()
    for w, r, m in zip(weights, references, ours.masters):
        assert torch.equal(m, r.detach()) and torch.equal(w.detach(), r.detach().to(torch.bfloat16))
