"""Hugging Face Mamba-2 (``Mamba2ForCausalLM``, its pure-PyTorch path) under longtrain, in float64.

The stock model's torch path computes the scan in chunks of ``chunk_size`` (SSD: exp of
segment sums within a chunk, a recurrence over the chunks' states); the adjoint engine
runs the plain recurrence. The tiny preset's chunks are 8 tokens, so every length here
spans several chunks and ends inside one. As in tests/test_mamba.py, the exactness
tests run under ``float64_throughout`` (the torch path's float32 casts keep float64
tensors float64, for the stock model and longtrain alike); one test without it checks
that longtrain applies the stock casts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import grads, max_rel_error
from ssm_helpers import (
    adjoint_grads,
    check_equals_stock,
    check_exact_adjoint,
    check_lora_equals_stock,
    padded,
    rel,
    ssm,
    stock,
)

import longtrain as lt
from longtrain.errors import LongtrainError
from longtrain.ops.loss import causal_lm_loss


def mamba2(layers: int = 2, dtype=torch.float64, seed: int = 0, **overrides):
    return ssm("tiny-mamba2", layers, dtype, seed, ("conv1d.bias", ".D", "mixer.norm.weight"), **overrides)


@pytest.mark.parametrize("strategy", ["none", "checkpoint", "mst", "checkpoint,mst"])
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_mamba2_through_its_adapter_equals_stock(float64_throughout, strategy, left):
    reference = mamba2()
    check_equals_stock(reference, padded(23, left=left), lt.Strategy.parse(strategy))


@pytest.mark.parametrize(
    "length,left,block,recompute,config,chunk",
    [(37, False, 5, True, {}, None),
     (31, True, 4, True, {"n_groups": 1}, 9),
     (30, True, 8, False, {"n_groups": 1}, None),
     (29, True, 2, True, {"conv_kernel": 5}, 3),
     (26, False, None, True, {"n_groups": 1, "time_step_limit": (0.005, 0.05)}, None)],
    ids=["T37-right-block5-G2", "T31-left-block4-chunk9-G1", "T30-left-block8-kept-G1", "T29-left-block2<window4-chunk3<window4-G2",
         "T26-G1-dt-clamped-budgeted"],
)
def test_exact_adjoint_equals_stock_autograd(float64_throughout, length, left, block, recompute, config, chunk):
    """Whole, and with the scan in chunks, as for Mamba."""
    check_exact_adjoint(mamba2(2, **config), length, left, chunk, block=block, vjp_memory="256KiB", recompute=recompute)


def truncated_reference_loss(model, batch, window: int):
    """Mamba-2 written out token by token (independently of longtrain's code and of the
    model's chunked scan), each layer's state h^t, for the gradient, rebuilt from the
    stopped state h^{t−window} over the last ``window`` steps."""
    base, mask = model.backbone, batch["attention_mask"][..., None].double()
    z = base.embeddings(batch["input_ids"])
    rows, length = z.shape[:2]
    for block in base.layers:
        m = block.mixer
        heads, groups, inner = m.num_heads, m.n_groups, m.intermediate_size
        gate, xbc, dt = m.in_proj(block.norm(z) * mask).split([inner, m.conv_dim, heads], dim=-1)
        kernel = m.conv1d.weight.shape[-1]
        xp = F.pad(xbc, (0, 0, kernel - 1, 0))
        xbc = F.silu(sum(xp[:, k: k + length] * m.conv1d.weight[:, 0, k] for k in range(kernel)) + m.conv1d.bias) * mask
        x, b_in, c = xbc.split([inner, groups * m.ssm_state_size, groups * m.ssm_state_size], dim=-1)
        x = x.reshape(rows, length, heads, m.head_dim)
        b_in, c = (v.reshape(rows, length, groups, 1, -1).repeat_interleave(heads // groups, dim=2) for v in (b_in, c))
        dt = torch.clamp(F.softplus(dt + m.dt_bias), *m.time_step_limit)
        a = torch.exp(-torch.exp(m.A_log) * dt)[..., None, None]
        b = (dt[..., None] * x)[..., None] * b_in
        with torch.no_grad():
            h, full = torch.zeros_like(b[:, 0]), []
            for t in range(length):
                h = a[:, t] * h + b[:, t]
                full.append(h)
        ys = []
        for t in range(length):
            start = t - window + 1
            h = full[start - 1] if start >= 1 else torch.zeros_like(b[:, 0])
            for i in range(max(start, 0), t + 1):
                h = a[:, i] * h + b[:, i]
            ys.append((h * c[:, t]).sum(-1))
        y = ((torch.stack(ys, 1) + x * m.D[:, None]).reshape(rows, length, inner) * F.silu(gate))
        y = y.reshape(rows, length, groups, inner // groups)
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + m.norm.variance_epsilon)).reshape(rows, length, inner)
        z = z + m.out_proj(m.norm.weight * y)
    logits = model.lm_head(base.norm_f(z))
    return causal_lm_loss(logits, batch["labels"], int((batch["labels"][:, 1:] != -100).sum()))


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunk4"])
@pytest.mark.parametrize("window", [1, 3, 9])
def test_truncated_adjoint_equals_truncated_window_reference(float64_throughout, window, chunk):
    """In chunks of 4, a chunk's states run T̄ − 1 tokens past its end (past the next
    chunk's end too, with T̄ = 9)."""
    reference = mamba2()
    ours = copy.deepcopy(reference)
    batch = padded(23, left=True)
    truncated_reference_loss(reference, batch, window).backward()
    expected = grads(reference)
    _, got, stats = adjoint_grads(ours, batch, truncate=window, block=3, chunk=chunk)
    assert max_rel_error(got, expected) <= 1e-10
    assert stats.adjoint_terms == 2 * (window * 23 - window * (window - 1) // 2)


def test_truncated_reference_with_a_full_window_is_the_stock_model(float64_throughout):
    """The reference written out above is Mamba-2: with a window as long as the sequence
    it equals the stock model (so the truncated comparison tests the right model)."""
    reference = mamba2(n_groups=2, time_step_limit=(0.005, 0.05))
    ours = copy.deepcopy(reference)
    batch = padded(17, left=True)
    _, expected = stock(reference, batch)
    truncated_reference_loss(ours, batch, 17).backward()
    assert max_rel_error(grads(ours), expected) <= 1e-10


def test_longtrain_applies_the_stock_float32_casts():
    """Without float64_throughout the stock torch path rounds to float32 in places;
    longtrain calls the same modules (backprop) and mirrors its casts (adjoint)."""
    reference = mamba2()
    batch = padded(21, left=True)
    loss_ref, expected = stock(reference, batch)
    for strategy in (lt.Strategy(), lt.Strategy(engine="adjoint")):
        ours = copy.deepcopy(reference)
        ours.zero_grad(set_to_none=True)
        lt.apply(ours, strategy)
        loss = lt.step(ours, batch)
        assert rel(loss, loss_ref) <= 1e-6  # the stock loss is float32 (its logits are)
        assert max_rel_error(grads(ours), expected) <= 1e-5


@pytest.mark.parametrize("engine", ["fpdt", "seco", "spaco"])
def test_chunked_attention_engines_refuse_mamba2(engine):
    with pytest.raises(LongtrainError, match=f"the {engine} engine chunks attention; mamba2 models have none"):
        lt.apply(mamba2(), lt.Strategy(engine=engine))


def test_packed_documents_are_refused():
    packed = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    for strategy in (lt.Strategy(), lt.Strategy(engine="adjoint")):
        model = mamba2()
        lt.apply(model, strategy)
        with pytest.raises(LongtrainError, match="does not reset its state at document boundaries"):
            lt.step(model, packed)


def test_bfloat16_runs_close_to_float32():
    """Half precision: the residual stream turns float32 (residual_in_fp32) and the head
    stays bfloat16, as in the stock model."""
    reference = mamba2(dtype=torch.float32)
    batch = padded(29)
    _, expected = stock(reference, batch)
    for strategy in (lt.Strategy(mst=True), lt.Strategy(engine="adjoint", engine_options={"block": 8})):
        ours = copy.deepcopy(reference).to(torch.bfloat16)
        lt.apply(ours, strategy)
        lt.step(ours, batch)
        got = grads(ours)
        assert all(g.dtype == torch.bfloat16 for g in got.values())
        assert max_rel_error({k: v.float() for k, v in got.items()}, expected) <= 0.05


@pytest.mark.parametrize("strategy", ["none", "checkpoint,mst", "adjoint"])
def test_lora_on_mamba2_equals_stock(float64_throughout, strategy):
    """LoRA on in_proj; out_proj is read as a weight by the model's CUDA kernel, so it gets none."""
    check_lora_equals_stock(mamba2(), padded(27, left=True), strategy, unadapted=("out_proj",))
