"""Adjoint sharding (engines/adjoint.py) on the SSM-ResNet model, in float64.

The exact engine must equal autograd through the model's sequential reference (a
Python loop over time, differentiated step by step); the truncated engine must equal
autograd through an independently written truncated-window model; the scan must
equal the loop."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import grads, max_rel_error, third_padded_batch

import longtrain as lt
from longtrain.engines.adjoint import AdjointOptions, AdjointStats, adjoint_step, truncated_adjoint_states
from longtrain.errors import LongtrainError
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.ops.linear_scan import adjoint_states, diagonal_recurrence, linear_scan
from longtrain.ops.loss import causal_lm_loss
from longtrain.strategy import engine_context


def ssm_pair(layers: int = 3, dtype=torch.float64, seed: int = 0, **overrides):
    """The sequential reference model and the parallel-scan model, same weights."""
    config = preset_config("tiny-ssm", num_hidden_layers=layers, **overrides)
    torch.manual_seed(seed)
    ours = build_from_config(copy.deepcopy(config), dtype)
    config.scan_implementation = "sequential"
    reference = build_from_config(config, dtype)
    reference.load_state_dict(ours.state_dict())
    return reference.train(), ours.train()


def padded(length: int, left: bool = False, seed: int = 1):
    return third_padded_batch(320, length, left, seed)


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).detach().norm() / y.detach().norm().clamp_min(1e-300))


def label_count(batch) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def autograd_grads(model, batch):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    loss = causal_lm_loss(out.logits, batch["labels"], label_count(batch))
    loss.backward()
    return loss.detach(), grads(model)


def adjoint_context(model, **options):
    """For stepping one model with several option sets."""
    return engine_context(model, lt.Strategy(engine="adjoint", engine_options=options))


def adjoint_grads(model, batch, **options):
    stats = AdjointStats()
    loss = adjoint_step(adjoint_context(model, **options), batch, stats=stats)
    return loss, grads(model), stats


def test_scan_equals_loop_and_its_gradient_is_the_adjoint_recurrence():
    torch.manual_seed(0)
    for length in (1, 2, 5, 64, 100):
        a = torch.rand(2, length, 3, dtype=torch.float64, requires_grad=True)
        b = torch.randn(2, length, 3, dtype=torch.float64, requires_grad=True)
        h, loop = torch.zeros(2, 3, dtype=torch.float64), []
        for t in range(length):
            h = a[:, t] * h + b[:, t]
            loop.append(h)
        loop = torch.stack(loop, 1)
        assert rel(linear_scan(a, b), loop) <= 1e-13
        weights = torch.randn_like(loop)
        ref = torch.autograd.grad((loop * weights).sum(), (a, b))
        ours = torch.autograd.grad((diagonal_recurrence(a, b) * weights).sum(), (a, b))
        assert max(rel(x, y) for x, y in zip(ours, ref)) <= 1e-12
        assert rel(adjoint_states(a.detach(), weights), ref[1]) <= 1e-12


def test_scan_accumulates_half_precision_in_float32():
    a = torch.full((1, 4096, 2), 0.99)
    b = torch.full((1, 4096, 2), 1e-3)
    a, b = a.bfloat16(), b.bfloat16()
    full = linear_scan(a.float(), b.float())
    half = linear_scan(a, b)
    assert half.dtype == torch.bfloat16
    assert rel(half.float(), full) <= 1e-2


@pytest.mark.parametrize("left", [False, True], ids=["right-padding", "left-padding"])
def test_parallel_scan_model_equals_sequential_reference(left):
    reference, ours = ssm_pair()
    batch = padded(29, left=left)
    loss_ref, grads_ref = autograd_grads(reference, batch)
    loss, grads_ours = autograd_grads(ours, batch)
    assert abs(loss - loss_ref) <= 1e-12 * abs(loss_ref)
    assert max_rel_error(grads_ours, grads_ref) <= 1e-10


@pytest.mark.parametrize(
    "layers,length,left,block,recompute",
    [(3, 37, False, 5, True), (4, 50, True, 16, True), (3, 23, False, None, True), (3, 37, True, 5, False)],
    ids=["K3-T37-right-block5", "K4-T50-left-block16", "K3-T23-budgeted", "K3-T37-left-kept-states"],
)
def test_exact_adjoint_equals_autograd(layers, length, left, block, recompute):
    reference, ours = ssm_pair(layers)
    batch = padded(length, left=left)
    loss_ref, grads_ref = autograd_grads(reference, batch)
    loss, grads_ours, stats = adjoint_grads(ours, batch, block=block, vjp_memory="16KiB", recompute=recompute)
    assert abs(loss - loss_ref) <= 1e-12 * abs(loss_ref)
    assert grads_ours.keys() == grads_ref.keys()
    assert max_rel_error(grads_ours, grads_ref) <= 1e-10
    assert stats.adjoint_terms == layers * length * (length + 1) // 2
    assert stats.token_vjps == layers * length
    if block:
        assert stats.block_tokens[: -(-length // block)] == [block] * (length // block) + [length % block] * (length % block > 0)
    assert stats.vjp_calls > layers  # several blocks per layer


def truncated_reference_loss(model, batch, window: int):
    """The loss of a model whose layers' states are, for the gradient, rebuilt from the
    stopped state h^{t−window} over the last ``window`` steps (written without the engine)."""
    base = model.model
    mask = batch["attention_mask"]
    z = base.embed_tokens(batch["input_ids"])
    for layer in base.layers:
        a, b, c = layer.maps(z, mask)
        with torch.no_grad():
            h_full = linear_scan(a, b)
        states = []
        for t in range(z.shape[1]):
            start = t - window + 1
            h = h_full[:, start - 1] if start >= 1 else torch.zeros_like(b[:, 0])
            for i in range(max(start, 0), t + 1):
                h = a[:, i] * h + b[:, i]
            states.append(h)
        z = z + layer.readout(c, torch.stack(states, 1))
    logits = model.lm_head(base.norm(z))
    return causal_lm_loss(logits, batch["labels"], label_count(batch))


@pytest.mark.parametrize("window", [1, 4, 11])
def test_truncated_adjoint_equals_truncated_window_reference(window):
    reference, ours = ssm_pair(3)
    batch = padded(31, left=True)
    truncated_reference_loss(reference, batch, window).backward()
    grads_ref = grads(reference)
    _, grads_ours, stats = adjoint_grads(ours, batch, truncate=window, block=8)
    assert max_rel_error(grads_ours, grads_ref) <= 1e-10
    length = 31
    assert stats.adjoint_terms == 3 * (window * length - window * (window - 1) // 2)


def test_truncation_longer_than_the_sequence_is_exact_and_short_truncation_is_not():
    _, model = ssm_pair(3)
    batch = padded(20)
    _, exact, _ = adjoint_grads(model, batch)
    model.zero_grad(set_to_none=True)
    _, long_window, _ = adjoint_grads(model, batch, truncate=20)
    model.zero_grad(set_to_none=True)
    _, short_window, _ = adjoint_grads(model, batch, truncate=2)
    assert max_rel_error(long_window, exact) <= 1e-12
    assert max_rel_error(short_window, exact) > 1e-3


def test_truncated_term_count_is_linear_in_length():
    a = torch.rand(1, 1, 1).expand(1, 4096, 1)
    counts = [truncated_adjoint_states(a[:, :length], a[:, :length], 64)[1] for length in (1024, 2048, 4096)]
    assert counts[2] - counts[1] == 2 * (counts[1] - counts[0])  # constant slope: 64 per token


def test_adjoint_runs_in_bfloat16_close_to_float32():
    _, model32 = ssm_pair(3, dtype=torch.float32)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    batch = padded(40)
    _, g32, _ = adjoint_grads(model32, batch)
    _, g16, _ = adjoint_grads(model16, batch)
    assert all(g.dtype == torch.bfloat16 for g in g16.values())
    assert max_rel_error({k: v.float() for k, v in g16.items()}, g32) <= 0.03  # measured 0.011


def test_frozen_parameters_get_no_gradient_and_accumulation_adds():
    _, model = ssm_pair(3)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[1].decay_proj.requires_grad_(False)
    batch = padded(19)
    _, once, _ = adjoint_grads(model, batch)
    assert "model.embed_tokens.weight" not in once and "model.layers.1.decay_proj.weight" not in once
    adjoint_step(adjoint_context(model), batch)
    twice = grads(model)
    assert max_rel_error(twice, {k: 2 * v for k, v in once.items()}) <= 1e-12


def test_gradients_accumulate_through_autograd_hooks():
    """Parameter gradients arrive through autograd's accumulation (post-accumulate hooks,
    FSDP and optimizers-in-backward see them), not by writing ``.grad``."""
    _, model = ssm_pair(2)
    seen = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append(name))
    adjoint_grads(model, padded(17))
    assert set(seen) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_adjoint_refuses_transformers_packing_and_bad_options():
    model = build_from_config(preset_config("tiny-llama"))
    with pytest.raises(LongtrainError, match="trains state-space models"):
        adjoint_context(model)
    _, ssm = ssm_pair(2)
    packed = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    with pytest.raises(LongtrainError, match="does not reset its state at document boundaries"):
        adjoint_step(adjoint_context(ssm), packed)
    with pytest.raises(LongtrainError, match="trains state-space models"):
        lt.apply(build_from_config(preset_config("tiny-llama")), lt.Strategy(engine="adjoint"))
    with pytest.raises(LongtrainError, match="truncate"):
        AdjointOptions(truncate=0)
    with pytest.raises(LongtrainError, match="adjoint chunk must be a positive integer"):
        AdjointOptions(chunk=0)
    with pytest.raises(LongtrainError, match="recompute=false keeps every state whole"):
        AdjointOptions(recompute=False, chunk=64)
    with pytest.raises(LongtrainError, match="chunk_memory"):
        AdjointOptions(chunk_memory="lots")


def test_exact_adjoint_with_lora_equals_autograd():
    from longtrain.models.loading import add_lora

    reference, ours = ssm_pair(3)
    reference, ours = add_lora(reference, rank=4), add_lora(ours, rank=4)
    with torch.no_grad():  # random adapters (B ≠ 0), so gradients flow through every path
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    ours.load_state_dict(reference.state_dict())
    batch = padded(33)
    _, grads_ref = autograd_grads(reference, batch)
    _, grads_ours, _ = adjoint_grads(ours, batch, block=8)
    assert grads_ours.keys() == grads_ref.keys() and all("lora" in name for name in grads_ref)
    assert max_rel_error(grads_ours, grads_ref) <= 1e-10


def test_ssm_model_saves_and_loads_as_a_hugging_face_model(tmp_path):
    from longtrain.models.loading import load_config, load_pretrained

    _, model = ssm_pair(3, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    assert load_config(str(tmp_path)).model_type == "ssm_resnet"
    loaded = load_pretrained(str(tmp_path), torch.float32)
    ids = padded(21)["input_ids"]
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_command_line_adjoint_options_are_the_engines(capsys):
    from longtrain.cli import main

    assert main(["train", "--model", "ssm-demo", "--engine", "adjoint:truncate=0", "--steps", "1"]) == 2
    assert "adjoint truncate must be a positive integer" in capsys.readouterr().err


def test_adjoint_peak_is_below_backprop_and_simulation_matches_measurement():
    from longtrain.plan.simulate import run_training_steps
    from longtrain.strategy import Strategy

    config = dict(vocab_size=320, hidden_size=64, state_size=64, num_hidden_layers=4)

    def peak(engine, length, fake=False):
        report, _ = run_training_steps(lambda: build_from_config(preset_config("tiny-ssm", **config)), seq_len=length,
                                       batch_size=2, strategy=Strategy.parse("none", engine=engine), optimizer="none",
                                       iterations=1, fake=fake)
        return report.peak_device_bytes

    backprop = {n: peak(None, n) for n in (1024, 4096)}
    adjoint = {n: peak("adjoint", n) for n in (1024, 4096)}
    assert adjoint[4096] < 0.5 * backprop[4096]
    assert adjoint[4096] - adjoint[1024] < 0.5 * (backprop[4096] - backprop[1024])
    assert peak("adjoint", 4096, fake=True) == adjoint[4096]  # the simulator runs the same engine


def test_a_simulation_of_layer_groups_is_the_busiest_ranks_share(capsys):
    """Layer groups over R processes: the busiest rank (layer_ranges' largest group, 3 of
    8 layers over 3 ranks) simulated as one process running those layers; anything but the
    adjoint engine, or more ranks than layers, is refused in one line."""
    from longtrain.cli import main
    from longtrain.plan.simulate import simulate

    config = preset_config("tiny-ssm", num_hidden_layers=8)
    grouped = simulate(config, 256, strategy=lt.Strategy(engine="adjoint"), layer_groups=3)
    three = simulate(preset_config("tiny-ssm", num_hidden_layers=3), 256, strategy=lt.Strategy(engine="adjoint"))
    whole = simulate(config, 256, strategy=lt.Strategy(engine="adjoint"))
    assert grouped.device_peak_bytes == three.device_peak_bytes < whole.device_peak_bytes
    assert grouped.parameters == three.parameters and "busiest of 3 layer groups" in grouped.table()
    with pytest.raises(LongtrainError, match="layer groups split the layers of the adjoint engine.*not the backprop engine's; pass --engine adjoint"):
        simulate(config, 256, layer_groups=2)
    with pytest.raises(LongtrainError, match="launch at most 8 processes"):
        simulate(config, 256, strategy=lt.Strategy(engine="adjoint"), layer_groups=9)
    assert main(["simulate", "--model", "tiny-ssm", "--seq-len", "64", "--engine", "adjoint", "--layer-groups", "0"]) == 2
    assert "--layer-groups must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["none", "checkpoint", "mst", "checkpoint,mst"])
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_ssm_through_its_adapter_equals_its_own_forward(strategy, left):
    """The backprop engine runs the SSM-ResNet piece by piece through its adapter; that
    must be the model's own forward (float64, padding keeps the state)."""
    _, reference = ssm_pair(3)
    ours = copy.deepcopy(reference)
    batch = padded(41, left=left)
    _, expected = autograd_grads(reference, batch)
    lt.apply(ours, lt.Strategy.parse(strategy))
    lt.step(ours, batch)
    assert max_rel_error(grads(ours), expected) <= 1e-10
