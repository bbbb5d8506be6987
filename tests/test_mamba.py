"""Hugging Face Mamba (``MambaForCausalLM``, its pure-PyTorch path) under longtrain, in float64.

The model's torch path upcasts to float32 in places (its RMSNorm, A, D, B, x, the
residual with ``residual_in_fp32``, the logits). In a float64 model those casts would
round to float32 and no two computations could agree to 1e-10, so the exactness tests
run under conftest's :func:`float64_throughout`, which keeps float64 tensors float64 through
``.float()`` and ``.to(torch.float32)`` for both the stock model and longtrain. One
test without it checks that longtrain applies the same casts as the stock model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import backward_on_another_thread, grads, max_rel_error
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
from longtrain.engines.adjoint import adjoint_step
from longtrain.errors import LongtrainError
from longtrain.memory.chunk_store import ChunkStore
from longtrain.ops.loss import causal_lm_loss
from longtrain.strategy import engine_context


def mamba(layers: int = 3, dtype=torch.float64, seed: int = 0, **overrides):
    return ssm("tiny-mamba", layers, dtype, seed, ("conv1d.bias", ".D"), **overrides)


@pytest.mark.parametrize("strategy", ["none", "checkpoint", "mst", "checkpoint,mst"])
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_mamba_through_its_adapter_equals_stock(float64_throughout, strategy, left):
    reference = mamba()
    check_equals_stock(reference, padded(23, left=left), lt.Strategy.parse(strategy))


def test_mamba_chunked_head_without_tiled_mlp_equals_stock(float64_throughout):
    check_equals_stock(mamba(2), padded(19), lt.Strategy(mst={"mlp": False}))


@pytest.mark.parametrize(
    "layers,length,left,block,recompute,kernel,chunk",
    [(3, 37, False, 5, True, 4, None), (2, 37, True, 5, True, 4, 8), (2, 30, True, 8, False, 4, None),
     (2, 29, True, 3, True, 5, 2), (2, 26, False, None, True, 2, None)],
    ids=["L3-T37-right-block5", "L2-T37-left-block5-chunk8", "L2-T30-left-block8-kept", "L2-T29-left-block3<window4-chunk2<window4",
         "L2-T26-K2-budgeted"],
)
def test_exact_adjoint_equals_stock_autograd(float64_throughout, layers, length, left, block, recompute, kernel, chunk):
    """Whole, and with the scan in chunks (the state entering each kept from the forward,
    the adjoint state carried from each chunk to the one before)."""
    check_exact_adjoint(mamba(layers, conv_kernel=kernel), length, left, chunk, block=block, vjp_memory="64KiB", recompute=recompute)


def truncated_reference_loss(model, batch, window: int):
    """Mamba written out token by token (independently of longtrain's code), each layer's
    state h^t, for the gradient, rebuilt from the stopped state h^{t−window} over the
    last ``window`` steps."""
    base, mask = model.backbone, batch["attention_mask"][..., None].double()
    z = base.embeddings(batch["input_ids"])
    length = z.shape[1]
    for block in base.layers:
        m = block.mixer
        u = block.norm(z) * mask
        x, gate = m.in_proj(u).chunk(2, dim=-1)
        kernel = m.conv1d.weight.shape[-1]
        xp = F.pad(x, (0, 0, kernel - 1, 0))
        x = sum(xp[:, k: k + length] * m.conv1d.weight[:, 0, k] for k in range(kernel)) + m.conv1d.bias
        x = F.silu(x) * mask
        step, b_in, c = torch.split(m.x_proj(x), [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
        dt = F.softplus(step @ m.dt_proj.weight.T + m.dt_proj.bias)
        a = torch.exp(-torch.exp(m.A_log) * dt[..., None])
        b = dt[..., None] * b_in[:, :, None, :] * x[..., None]
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
            ys.append((h * c[:, t, None, :]).sum(-1))
        y = (torch.stack(ys, 1) + x * m.D) * F.silu(gate)
        z = z + m.out_proj(y)
    logits = model.lm_head(base.norm_f(z))
    return causal_lm_loss(logits, batch["labels"], int((batch["labels"][:, 1:] != -100).sum()))


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunk4"])
@pytest.mark.parametrize("window", [1, 3, 9])
def test_truncated_adjoint_equals_truncated_window_reference(float64_throughout, window, chunk):
    """In chunks of 4, a chunk's states run T̄ − 1 tokens past its end (past the next
    chunk's end too, with T̄ = 9)."""
    reference = mamba(2)
    ours = copy.deepcopy(reference)
    batch = padded(23, left=True)
    truncated_reference_loss(reference, batch, window).backward()
    expected = grads(reference)
    _, got, stats = adjoint_grads(ours, batch, truncate=window, block=3, chunk=chunk)
    assert max_rel_error(got, expected) <= 1e-10
    assert stats.adjoint_terms == 2 * (window * 23 - window * (window - 1) // 2)


def test_truncated_reference_with_a_full_window_is_the_stock_model(float64_throughout):
    """The reference written out above is Mamba: with a window as long as the sequence it
    equals the stock model (so the truncated comparison tests the right model)."""
    reference = mamba(2)
    ours = copy.deepcopy(reference)
    batch = padded(17, left=True)
    _, expected = stock(reference, batch)
    truncated_reference_loss(ours, batch, 17).backward()
    assert max_rel_error(grads(ours), expected) <= 1e-10


def test_longtrain_applies_the_stock_float32_casts():
    """Without float64_throughout the stock torch path rounds to float32 in places;
    longtrain calls the same modules (backprop) and mirrors its casts (adjoint)."""
    reference = mamba(2)
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
def test_chunked_attention_engines_refuse_mamba(engine):
    with pytest.raises(LongtrainError, match=f"the {engine} engine chunks attention; mamba models have none"):
        lt.apply(mamba(2), lt.Strategy(engine=engine))


def test_packed_documents_are_refused():
    packed = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    for strategy in (lt.Strategy(), lt.Strategy(engine="adjoint")):
        model = mamba(2)
        lt.apply(model, strategy)
        with pytest.raises(LongtrainError, match="does not reset its state at document boundaries"):
            lt.step(model, packed)


def test_bfloat16_runs_close_to_float32():
    """Half precision: the residual stream turns float32 (residual_in_fp32) and the head
    stays bfloat16, as in the stock model."""
    reference = mamba(2, dtype=torch.float32)
    batch = padded(29)
    _, expected = stock(reference, batch)
    for strategy in (lt.Strategy(mst=True), lt.Strategy(engine="adjoint", engine_options={"block": 8})):
        ours = copy.deepcopy(reference).to(torch.bfloat16)
        lt.apply(ours, strategy)
        lt.step(ours, batch)
        got = grads(ours)
        assert all(g.dtype == torch.bfloat16 for g in got.values())
        assert max_rel_error({k: v.float() for k, v in got.items()}, expected) <= 0.05  # measured 0.018 (adjoint)


@pytest.mark.parametrize("strategy", ["none", "checkpoint,mst", "adjoint"])
def test_lora_on_mamba_equals_stock(float64_throughout, strategy):
    """LoRA on in_proj, the one linear layer the mixer calls in every path; dt_proj, x_proj and
    out_proj are read as weights by the model or its fused CUDA kernel, so they get none."""
    check_lora_equals_stock(mamba(2), padded(27, left=True), strategy, unadapted=("dt_proj", "x_proj", "out_proj"))


def test_train_a_saved_mamba_with_the_adjoint_engine_and_reload_it(tmp_path):
    """``longtrain train --model MAMBA_DIR --engine adjoint``: a saved Hugging Face Mamba
    trains, and its final/ folder loads back with from_pretrained holding the trained weights."""
    from transformers import AutoModelForCausalLM

    from longtrain.cli import main

    initial = mamba(2, dtype=torch.float32, vocab_size=320)  # holds the byte tokenizer's ids
    initial.save_pretrained(tmp_path / "mamba")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["state space models scan long sequences"] * 120))
    code = main(["train", "--model", str(tmp_path / "mamba"), "--engine", "adjoint", "--seq-len", "512", "--steps", "2",
                 "--data", str(text), "--tokenizer", "bytes", "--no-progress", "--out", str(tmp_path / "run")])
    assert code == 0
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert type(trained).__name__ == "MambaForCausalLM"
    before, after = initial.state_dict(), trained.state_dict()
    assert after.keys() == before.keys()
    assert any(not torch.equal(after[k], before[k].to(after[k].dtype)) for k in before)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["simulated_stock_peak_bytes"] > summary["measured_peak_bytes"]  # stock, along its token blocks


@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-mamba2"])
def test_the_time_model_counts_the_mixers_projections(preset):
    """FLOPs (and so MFU and predicted step time) count every linear layer of the mixer."""
    from longtrain.models.adapters import describe_model
    from longtrain.models.loading import build_from_config
    from longtrain.models.presets import preset_config

    config = preset_config(preset)
    model = build_from_config(config, torch.float32)
    linear = sum(m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    assert describe_model(config).matmul_parameters() == linear


def test_the_time_model_charges_the_stock_scans_python_steps():
    """Engines that run Mamba's own step pay a Python step per token, layer and pass (forward,
    two backward, each recomputation); the adjoint engine and Mamba-2's chunked scan do not."""
    from longtrain.models.presets import preset_config
    from longtrain.plan.time_model import H100, step_time

    config = preset_config("mamba-130m")
    parts = step_time(config, 4096, lt.Strategy.parse("checkpoint,mst")).parts
    assert parts["token_steps"] == pytest.approx(4 * 4096 * config.num_hidden_layers * H100.token_step)
    assert "token_steps" not in step_time(config, 4096, lt.Strategy(engine="adjoint")).parts
    assert "token_steps" not in step_time(preset_config("mamba2-2.7b"), 4096, lt.Strategy.parse("checkpoint,mst")).parts


@pytest.mark.parametrize("preset,randomized", [("tiny-mamba", ("conv1d.bias", ".D")),
                                               ("tiny-mamba2", ("conv1d.bias", ".D", "mixer.norm.weight"))],
                         ids=["mamba", "mamba2"])
def test_adjoint_with_inputs_parked_in_host_memory_equals_stock(float64_throughout, preset, randomized, monkeypatch):
    """``adjoint:offload_inputs`` (Mamba and Mamba-2): every layer's kept input but the top
    one waits in host memory and comes back for its backward, its copy started before the
    layer above runs its backward. Exact. Where the run's host memory holds less, the step
    stops in one line before any backward."""
    from longtrain.engines.adjoint import schedule as adjoint
    from longtrain.models.adapters import adapter_for

    reference = ssm(preset, 3, torch.float64, 0, randomized)
    batch = padded(26, left=True)
    loss_ref, expected = stock(reference, batch)
    events = []
    for name in ("put", "pop", "prefetch"):
        def logged(store, key, *args, _real=getattr(ChunkStore, name), _name=name, **kwargs):
            if (_name, key) not in events:  # (pop's own prefetch of what is already coming is not logged)
                events.append((_name, key))
            return _real(store, key, *args, **kwargs)
        monkeypatch.setattr(ChunkStore, name, logged)
    ours = copy.deepcopy(reference)
    index = {id(block): i for i, block in enumerate(adapter_for(ours).layers)}
    backward_layer = adjoint.backward_layer
    monkeypatch.setattr(adjoint, "backward_layer", lambda layer, *a, **k: events.append(("backward", index[id(layer.layer)]))
                        or backward_layer(layer, *a, **k))
    context = engine_context(ours, lt.Strategy(engine="adjoint", engine_options={"offload_inputs": True, "block": 5}))
    with backward_on_another_thread():
        loss = adjoint_step(context, batch)
    assert rel(loss, loss_ref) <= 1e-12
    assert max_rel_error(grads(ours), expected) <= 1e-10
    assert events == [("put", 0), ("put", 1), ("prefetch", 1), ("backward", 2), ("pop", 1), ("prefetch", 0),
                      ("backward", 1), ("pop", 0), ("backward", 0)]
    assert len(context.pool._free[(batch["input_ids"].numel() * reference.config.hidden_size, torch.float64)]) == 2
    one_input = batch["input_ids"].numel() * reference.config.hidden_size * 8
    context = engine_context(copy.deepcopy(reference), lt.Strategy(engine="adjoint", engine_options={"offload_inputs": True}))
    context.host_memory = one_input
    events.clear()
    with pytest.raises(LongtrainError, match="host memory budget exceeded"):
        adjoint_step(context, batch)
    assert ("backward", 2) not in events
    assert sum(map(len, context.pool._free.values())) == 1  # the input parked before it, back in the pool


def test_parked_inputs_leave_the_device():
    """The exact tracker on a 12-layer Mamba (state small beside the stream, so the inputs
    count): parking moves exactly the parked inputs to host memory — all 12 under
    checkpointing, all but the top one under the adjoint engine — and lowers the device peak."""
    from longtrain.models.loading import build_from_config
    from longtrain.models.presets import preset_config
    from longtrain.plan.simulate import run_training_steps

    config = preset_config("tiny-mamba", num_hidden_layers=12, vocab_size=64, state_size=2, expand=1)
    one_input = 2 * 96 * config.hidden_size * 4
    peaks = {}
    for spec in ("adjoint", "adjoint:offload_inputs", "checkpoint,mst", "checkpoint:offload_inputs,mst"):
        report, _ = run_training_steps(lambda: build_from_config(copy.deepcopy(config), torch.float32), seq_len=96,
                                       batch_size=2, strategy=lt.Strategy.parse(spec), optimizer="none", iterations=1,
                                       fake=False)
        peaks[spec] = report.peak_device_bytes, report.peak_host_bytes
    assert peaks["adjoint"][1] == peaks["checkpoint,mst"][1] == 0
    assert peaks["adjoint:offload_inputs"][1] == 11 * one_input
    assert peaks["checkpoint:offload_inputs,mst"][1] == 12 * one_input
    assert peaks["adjoint:offload_inputs"][0] < peaks["adjoint"][0]
    assert peaks["checkpoint:offload_inputs,mst"][0] < peaks["checkpoint,mst"][0]


def test_a_chunked_scan_bounds_the_states():
    """The exact tracker on a Mamba whose state is large beside the stream (I·N = 32× the
    hidden size): scanning in chunks of 32 tokens instead of the whole 512 lowers the peak
    by most of a layer's decays, states and adjoint states; the simulation on fake tensors
    agrees with the tracked run to the byte."""
    from longtrain.models.loading import build_from_config
    from longtrain.models.presets import preset_config
    from longtrain.plan.simulate import run_training_steps

    config = preset_config("tiny-mamba", num_hidden_layers=2, vocab_size=64, hidden_size=32, state_size=16, expand=2)
    state = 512 * 64 * 16 * 4  # one (T, I, N) float32 array
    peaks = {}
    for spec in ("adjoint", "adjoint:chunk=32"):
        for fake in (False, True):
            report, _ = run_training_steps(lambda: build_from_config(copy.deepcopy(config), torch.float32), seq_len=512,
                                           batch_size=1, strategy=lt.Strategy.parse(spec), optimizer="none", iterations=1,
                                           fake=fake)
            peaks[spec, fake] = report.peak_device_bytes
    assert peaks["adjoint", False] == peaks["adjoint", True]
    assert peaks["adjoint:chunk=32", False] == peaks["adjoint:chunk=32", True]
    assert peaks["adjoint", False] - peaks["adjoint:chunk=32", False] > 8 * state


def test_the_final_norm_and_head_in_mini_sequences_equal_stock(float64_throughout, monkeypatch):
    """The adjoint engine runs the final norm and the head over mini-sequences of tokens
    (at least 16,384; 7 here, with the scan in chunks of 8): the loss is their sum."""
    from longtrain.engines.adjoint import schedule as adjoint

    monkeypatch.setattr(adjoint, "HEAD_TOKENS", 7)
    check_exact_adjoint(mamba(2), 30, True, 8, block=5)
