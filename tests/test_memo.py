"""Memo (token-wise swapping + recomputation without attention): float64 proofs against
stock autograd for any α, the recomputation it promises (none at α = 1; attention once
per layer forward at α = 0), its α rule, its memory, and its refusals."""

import pytest
import torch
from conftest import BATCHES, AttentionKernelCalls, check_step, packed_batch, padded_batch, stock_and_ours

import longtrain as lt
from longtrain.memory.token_swap import NotTokenWise, token_axis
from longtrain.models.flops import count_flops
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.plan.simulate import run_training_steps
from longtrain.techniques.memo import memo_alpha

TOL = 1e-10


def memo(alpha, **options):
    # keep_last=0: every layer of the 2-layer test models swaps to host.
    return lt.Strategy(memo=lt.MemoOptions(alpha=alpha, keep_last=options.pop("keep_last", 0), **options))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2"])
def test_memo_equals_stock_autograd(preset, batch, alpha):
    stock, ours = stock_and_ours(preset)
    check_step(stock, ours, memo(alpha), BATCHES[batch](stock.config.vocab_size), TOL)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-phi3", "tiny-granite", "tiny-cohere"])
def test_memo_on_the_other_families(preset):
    stock, ours = stock_and_ours(preset)
    check_step(stock, ours, memo(0.3), packed_batch(stock.config.vocab_size), TOL)


@pytest.mark.parametrize("strategy", [memo(0.45, keep_last=1), memo(0.0, offload=False), memo("auto"),
                                      lt.Strategy(memo=lt.MemoOptions(alpha=0.7, keep_last=0), mst=lt.MsTOptions(mlp_chunk=29))])
def test_memo_odd_lengths_and_options(strategy):
    stock, ours = stock_and_ours("tiny-qwen2")
    batch = {"input_ids": torch.randint(3, 320, (3, 131), generator=torch.Generator().manual_seed(4))}
    check_step(stock, ours, strategy, batch, TOL)


def test_memo_second_step_on_the_same_model():
    stock, ours = stock_and_ours("tiny-llama")
    batch = padded_batch(stock.config.vocab_size, lengths=(61, 50))
    check_step(stock, ours, memo(0.5), batch, TOL)
    stock.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    check_step(stock, ours, memo(0.5), batch, TOL)


def _flops_and_attention_calls(strategy, batch):
    _, ours = stock_and_ours("tiny-llama")
    lt.apply(ours, strategy)
    with AttentionKernelCalls() as calls:
        flops, _ = count_flops(lt.step, ours, batch)
    return flops, calls.calls, ours.config.num_hidden_layers


@pytest.mark.parametrize("batch", [{"input_ids": torch.randint(3, 320, (2, 101))}, padded_batch(320, lengths=(100, 77))])
def test_memo_recomputes_nothing_at_alpha_one_and_never_attention(batch):
    backprop, _, _ = _flops_and_attention_calls(lt.Strategy(), batch)
    checkpoint, _, _ = _flops_and_attention_calls(lt.Strategy(checkpoint={"keep_attention": False}), batch)
    full, _, _ = _flops_and_attention_calls(memo(1.0), batch)
    none, calls, layers = _flops_and_attention_calls(memo(0.0), batch)
    assert full == backprop  # α = 1: no layer op runs twice
    assert backprop < none < checkpoint  # α = 0: token-wise work recomputed, attention not
    forward = [n for n in calls if "attention" in n and not n.endswith("backward")]
    assert forward and all(calls[n] == layers for n in forward), calls


def test_alpha_rule():
    sizes = dict(input_bytes=10, attention_bytes=10, other_bytes=100, layers=10, keep_last=2)
    # Copies: 20 + α·100 bytes must take ≤ one layer's time at 100 B/s -> α = 0.3.
    assert memo_alpha(**sizes, bandwidth=100, layer_seconds=0.5, host_budget=10**9) == pytest.approx(0.3)
    # Host: 8 swapped layers × (20 + α·100) ≤ 400 -> α = 0.3.
    assert memo_alpha(**sizes, bandwidth=1e9, layer_seconds=1, host_budget=400) == pytest.approx(0.3)
    assert memo_alpha(**sizes, bandwidth=1e9, layer_seconds=1, host_budget=10**9) == 1.0  # clipped
    assert memo_alpha(**sizes, bandwidth=1, layer_seconds=1, host_budget=10**9) == 0.0  # clipped
    with pytest.raises(lt.LongtrainError, match="input and attention output in host memory.*over the host budget"):
        memo_alpha(**sizes, bandwidth=1e9, layer_seconds=1, host_budget=100)


def test_auto_alpha_is_measured_and_reported():
    _, ours = stock_and_ours("tiny-llama")
    lt.apply(ours, memo("auto", host_memory="1GiB"))
    lt.step(ours, padded_batch(320, lengths=(60, 41)))
    notes = ours._longtrain.notes
    assert 0.0 <= notes["memo_alpha"] <= 1.0 and notes["memo_measured"] and notes["memo_host_budget"] == 2**30
    assert notes["memo_layer_seconds"] > 0 and notes["memo_host_bandwidth"] > 0 and notes["memo_other_bytes"] > 0


def test_alpha_is_timed_without_the_first_steps_host_allocations(monkeypatch):
    """T_layer is the layer's compute. On the H100 it was timed around the first step's
    training forward, which also page-locked the host buffers its parked tensors took
    (~1 s per few GB): 80 ms measured at 16K for ~20 ms of compute, so α came out 1.00
    and the copies did not hide. Here every host allocation takes 0.3 s; the measured
    layer time must not contain one. The clock Memo reads is this test's (no wall clock,
    so a loaded machine changes nothing): it moves 1 µs per reading and 0.3 s per host
    allocation."""
    from types import SimpleNamespace

    from longtrain.memory import chunk_store
    from longtrain.techniques.memo import layers as memo_layers

    slow, now = 0.3, [0.0]
    allocate = chunk_store.host_empty

    def perf_counter():
        now[0] += 1e-6
        return now[0]

    def slow_host_empty(*args, **kwargs):
        now[0] += slow
        return allocate(*args, **kwargs)

    monkeypatch.setattr(memo_layers, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(chunk_store, "host_empty", slow_host_empty)
    _, ours = stock_and_ours("tiny-llama")
    lt.apply(ours, memo("auto", host_memory="1GiB"))
    lt.step(ours, {"input_ids": torch.randint(3, 320, (1, 96), generator=torch.Generator().manual_seed(5))})
    notes = ours._longtrain.notes
    assert notes["memo_measured"] and 0 < notes["memo_layer_seconds"] < slow / 2, notes["memo_layer_seconds"]


@pytest.mark.parametrize("strategy,layers", [
    (lt.Strategy(memo=lt.MemoOptions(host_memory="1GiB"), mst=True), 6),  # α measured in the first step
    (lt.Strategy(memo=lt.MemoOptions(host_memory="1GiB"), mst=True), 4),  # the first layer at α keeps on the device
    (lt.Strategy(memo=lt.MemoOptions(alpha=0.4, keep_last=1)), 6),
    (lt.Strategy(checkpoint=True, mst=True), 6),  # kept attention
    (lt.Strategy(engine="fpdt", engine_options={"chunk": 64, "offload": True, "keep_output": True}, mst=True), 6),
], ids=["memo-auto", "memo-auto-4-layers", "memo-0.4", "checkpoint", "fpdt-offload-keep"])
def test_no_step_after_the_first_pins_host_memory(strategy, layers):
    """Pinning host memory takes about a second per few GB on a GPU host: a step after the
    first that pins more is slower for it (on the H100, Memo's first timed step pinned the
    α-share of the two layers that ran before α was known). The pinned pool's size after
    each of four steps: set by the first."""
    from longtrain.strategy import applied_context

    config = preset_config("tiny-llama")
    config.num_hidden_layers = layers
    model = lt.apply(build_from_config(config, torch.float32).train(), strategy)
    ids = torch.randint(0, config.vocab_size, (1, 512))
    sizes = []
    for _ in range(4):
        lt.step(model, {"input_ids": ids})
        model.zero_grad(set_to_none=True)
        sizes.append(applied_context(model).pool.allocated_bytes)
    assert sizes[0] > 0 and len(set(sizes)) == 1, sizes


def test_token_axis_is_the_axis_that_changes_with_the_token_count():
    # (batch 2, 7 tokens) against the same layer on 3 of the tokens
    assert token_axis((2, 7, 5), (2, 3, 5), 2, 7) == (1, False)
    assert token_axis((2, 4, 7, 5), (2, 4, 3, 5), 2, 7) == (2, False)
    assert token_axis((14, 5), (6, 5), 2, 7) == (0, True)
    assert token_axis((7, 5), (3, 5), 1, 7) == (0, False)
    assert token_axis((5, 3), (5, 3), 2, 7) is None
    # sizes that coincide with the token count are not mistaken for it
    assert token_axis((2, 7, 7, 7), (2, 7, 3, 7), 2, 7) == (2, False)
    assert token_axis((14,), (14,), 2, 7) is None
    with pytest.raises(NotTokenWise):
        token_axis((2, 7, 7), (2, 3, 3), 2, 7)  # two axes move: not token-wise


def _peak(strategy, fake, layers=4):
    config = preset_config("demo", num_hidden_layers=layers)
    report, _ = run_training_steps(lambda: build_from_config(config, torch.float32), seq_len=1024, strategy=strategy,
                                   fake=fake, optimizer="none", iterations=1)
    return report


def test_memo_memory_measured_equals_simulated_and_moves_activations_to_host():
    backprop = _peak(lt.Strategy(), fake=False)
    for strategy in (memo(0.0), memo(0.5), lt.Strategy(memo=lt.MemoOptions(alpha=1.0, keep_last=0), mst=True)):
        measured, simulated = _peak(strategy, fake=False), _peak(strategy, fake=True)
        assert measured.peak_device_bytes == simulated.peak_device_bytes
        assert measured.peak_host_bytes == simulated.peak_host_bytes > 0
        assert measured.peak_device_bytes < backprop.peak_device_bytes
    # More tokens swapped, more host memory.
    assert _peak(memo(0.0), True).peak_host_bytes < _peak(memo(0.5), True).peak_host_bytes


@pytest.mark.parametrize("make,match", [
    (lambda: lt.Strategy(memo=True, checkpoint=True), "'memo' does not combine with 'checkpoint'"),
    (lambda: lt.Strategy(engine="fpdt", memo=True), "fpdt engine does not combine with 'memo'"),
    (lambda: lt.Strategy(memo=True, sequence_parallel=2), "memo does not run under sequence parallelism"),
    (lambda: lt.MemoOptions(alpha=1.5), "alpha must be a number in \\[0, 1\\] or 'auto'"),
    (lambda: lt.MemoOptions(alpha="half"), "alpha must be a number"),
    (lambda: lt.MemoOptions(offload="no"), "offload must be true or false"),
    (lambda: lt.MemoOptions(host_memory="lots"), "cannot read size 'lots'"),
    (lambda: lt.Strategy.parse("memo:alpha=2"), "alpha must be a number"),
])
def test_memo_refusals(make, match):
    with pytest.raises(lt.LongtrainError, match=match):
        make()


def test_memo_refuses_an_attention_free_model():
    model = build_from_config(preset_config("tiny-ssm"))
    with pytest.raises(lt.LongtrainError, match="no attention"):
        lt.apply(model, lt.Strategy(memo=True))


def test_memo_parses_from_the_command_line_spelling():
    strategy = lt.Strategy.parse("memo:alpha=0.25:host_memory=64GiB,mst")
    assert strategy.techniques["memo"].alpha == 0.25 and strategy.techniques["memo"].host_memory == 64 * 2**30
    assert lt.Strategy.from_yaml(strategy.to_yaml()) == strategy


# ---- shapes that break shape-based guesses ---------------------------------------------------
# tiny-llama: hidden size 64 (MsT's default MLP tile), 4 heads, 2 K/V heads.

@pytest.mark.parametrize("mlp_chunk", [None, 7])
@pytest.mark.parametrize("alpha", [0.3, 0.75, 0.8, 0.95, "auto"])
def test_memo_with_tiled_mlp_at_any_alpha(alpha, mlp_chunk):
    """Batch 2 × 101 tokens: the recomputed tokens (2·(1 − α)·101: 142, 50, 40, 10) fall
    over and under the default tile of 64 while the whole batch is longer."""
    stock, ours = stock_and_ours("tiny-llama")
    batch = padded_batch(stock.config.vocab_size, lengths=(101, 90))
    check_step(stock, ours, lt.Strategy(memo=lt.MemoOptions(alpha=alpha, keep_last=0), mst=lt.MsTOptions(mlp_chunk=mlp_chunk)), batch, TOL)


@pytest.mark.parametrize("split", [36, 37, 38])
def test_memo_recomputes_tokens_just_over_at_and_under_the_tile(split):
    """One row of 101 tokens: 65, 64 and 63 tokens recomputed against a 64-token MLP tile."""
    stock, ours = stock_and_ours("tiny-llama")
    batch = {"input_ids": torch.randint(3, 320, (1, 101), generator=torch.Generator().manual_seed(6))}
    check_step(stock, ours, lt.Strategy(memo=lt.MemoOptions(alpha=split / 101, keep_last=0), mst=True), batch, TOL)


# Gemma-2 at 2 tokens is left out: its q/k gradients are exactly 0 in stock (the one
# labelled query attends only to itself) and ~1e-17 in any rounding order.
@pytest.mark.parametrize("preset,tokens", [("tiny-llama", 2), ("tiny-llama", 4), ("tiny-gemma2", 4)])
def test_memo_when_the_length_equals_a_head_count(preset, tokens):
    stock, ours = stock_and_ours(preset)
    batch = {"input_ids": torch.randint(3, 320, (3, tokens), generator=torch.Generator().manual_seed(7))}
    check_step(stock, ours, lt.Strategy(memo=lt.MemoOptions(alpha=0.5, keep_last=0), mst=lt.MsTOptions(mlp_chunk=3)), batch, TOL)


@pytest.mark.parametrize("mst", [False, True])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma2"])
def test_memo_when_batch_times_length_equals_the_hidden_size(preset, mst):
    stock, ours = stock_and_ours(preset)
    batch = {"input_ids": torch.randint(3, 320, (2, 32), generator=torch.Generator().manual_seed(8))}  # 2 × 32 = 64
    strategy = lt.Strategy(memo=lt.MemoOptions(alpha=0.5, keep_last=0), mst=lt.MsTOptions(mlp_chunk=16) if mst else False)
    check_step(stock, ours, strategy, batch, TOL)


def test_memo_with_an_explicit_alpha_keeps_to_its_host_budget():
    _, ours = stock_and_ours("tiny-llama")
    lt.apply(ours, lt.Strategy(memo=lt.MemoOptions(alpha=0.3, host_memory="1KiB", keep_last=0)))
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    with pytest.raises(lt.LongtrainError, match="over the host budget of 1.00 KiB") as error:
        lt.step(ours, padded_batch(320, lengths=(101, 90)))
    assert "\n" not in str(error.value) and "memo:alpha" in str(error.value)
    assert all(torch.equal(p, before[n]) for n, p in ours.named_parameters())


def test_memo_under_autocast_with_float32_adapters_returns_real_tensors():
    """bf16 weights, float32 LoRA adapters, CPU autocast (what a Trainer with bf16=True
    runs): the shape-only run must leave no fake casts in autocast's weight cache."""
    from peft import LoraConfig, get_peft_model
    from torch._subclasses.fake_tensor import is_fake

    def make(alpha):
        _, model = stock_and_ours("tiny-llama", dtype=torch.bfloat16)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
        return lt.apply(model, lt.Strategy(memo=lt.MemoOptions(alpha=alpha, keep_last=0, offload=False)))

    ours, whole = make(0.5), make(1.0)
    whole.load_state_dict(ours.state_dict())
    batch = padded_batch(320, lengths=(101, 80))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, reference = lt.step(ours, batch), lt.step(whole, batch)
    assert not is_fake(loss) and float(loss) == float(reference)
    for (name, p), q in zip(ours.named_parameters(), whole.parameters()):
        if p.requires_grad:
            assert not is_fake(p.grad) and torch.equal(p.grad, q.grad), name


def test_memo_after_the_layer_changes_what_it_saves():
    """Steps after the model changed what its layers save (Phi-3's residual dropout on in
    training mode, off in evaluation mode; MLP weights frozen): the shape-only run is made
    again for each, every step exact."""
    config = preset_config("tiny-phi3")
    config.resid_pdrop = 0.1
    stock, ours = stock_and_ours(config)
    batch = padded_batch(320, lengths=(101, 80))
    lt.apply(ours, memo(0.5))
    for change in ("eval", "train", "freeze"):
        for model in (stock, ours):
            model.zero_grad(set_to_none=True)
            model.train(change != "eval")
            if change == "freeze":
                for name, p in model.named_parameters():
                    p.requires_grad_("mlp" not in name)
        check_step(stock, ours, memo(0.5), batch, tol=TOL, seed=5)


def test_an_explicit_alpha_over_its_budget_is_refused_at_the_first_layer(monkeypatch):
    """What a step would park is known after its first offloaded layer (input, attention
    output and α's share of the rest): refused there, not when the host is already full."""
    from longtrain.techniques import memo as memo_module

    seen = []
    check = memo_module.MemoLayers._check_host_budget

    def watched(self, index, layer_bytes):
        seen.append(self.store.host_bytes)
        return check(self, index, layer_bytes)

    monkeypatch.setattr(memo_module.MemoLayers, "_check_host_budget", watched)
    config = preset_config("tiny-llama", num_hidden_layers=8)
    batch = padded_batch(320, lengths=(101, 90))
    _, ours = stock_and_ours(config)
    lt.step(lt.apply(ours, lt.Strategy(memo=lt.MemoOptions(alpha=0.3, keep_last=0))), batch)
    whole_step = seen[-1]  # the last layer's check: every layer parked
    seen.clear()
    _, tight = stock_and_ours(config)
    lt.apply(tight, lt.Strategy(memo=lt.MemoOptions(alpha=0.3, keep_last=0, host_memory=whole_step - 1)))
    with pytest.raises(lt.LongtrainError, match="over the host budget"):
        lt.step(tight, batch)
    assert len(seen) == 1 and 8 * seen[0] == whole_step


def test_memo_does_not_combine_with_liger():
    with pytest.raises(lt.LongtrainError, match="'memo' does not combine with 'liger'"):
        lt.Strategy(memo=True, liger=True)
