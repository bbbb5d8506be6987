"""SeCO (exact chunk-wise optimization) and SpaCO (sparse, unbiased) engines."""

import dataclasses
import itertools
import math

import pytest
import torch
from conftest import grads, llama_norm_in_float64, max_rel_error, padded_batch, stock_and_ours

import longtrain as lt
from longtrain.engines.seco import seco_step
from longtrain.engines.spaco import SpaCOOptions, select_chunks, spaco_step
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.plan.simulate import run_training_steps
from longtrain.strategy import engine_context

TOL = 1e-10


def _context(model, engine: str, **options):
    """One model stepped by SeCO and by SpaCO with several option sets, as these checks need."""
    return engine_context(model, lt.Strategy(engine=engine, engine_options=options))


def _spaco_grads(model, batch, options, selected=None):
    spaco_step(_context(model, "spaco", **dataclasses.asdict(options)), batch, selected=selected)
    g = grads(model)
    model.zero_grad(set_to_none=True)
    return g


def _exact_and_expectation(k, budget, cap=None):
    """The SeCO gradient and the exact expectation of SpaCO's estimate, summed over all
    2^k chunk selections weighted by their probability."""
    stock, model = stock_and_ours("tiny-llama")
    batch = padded_batch(stock.config.vocab_size, lengths=(60, 47))
    chunk = -(-60 // k)
    seco_step(_context(model, "seco", chunk=chunk), batch)
    exact = grads(model)
    model.zero_grad(set_to_none=True)
    options = SpaCOOptions(chunk=chunk, budget=budget, cap=cap)
    rho = budget / k
    expectation = {n: torch.zeros_like(g) for n, g in exact.items()}
    for r in range(k + 1):
        for subset in itertools.combinations(range(k), r):
            weight = rho**r * (1 - rho) ** (k - r)
            for n, g in _spaco_grads(model, batch, options, set(subset)).items():
                expectation[n] += weight * g
    return exact, expectation, model, batch, options


@pytest.mark.parametrize("k,budget", [(3, 1), (4, 2)])
def test_spaco_expectation_over_all_selections_is_the_exact_gradient(k, budget):
    # Llama's RMSNorm rounds through float32; combining runs would expose that rounding.
    with llama_norm_in_float64():
        exact, expectation, *_ = _exact_and_expectation(k, budget)
    assert max_rel_error(expectation, exact) <= TOL


def test_spaco_cap_below_k_over_t_is_biased_and_above_is_not():
    with llama_norm_in_float64():
        exact, capped, *_ = _exact_and_expectation(4, 1, cap=2.0)  # k/t = 4 > cap
        _, uncapped_cap, *_ = _exact_and_expectation(4, 1, cap=4.0)  # cap = k/t: no effect
    assert max_rel_error(capped, exact) > 1e-4
    assert max_rel_error(uncapped_cap, exact) <= TOL


def test_spaco_sample_mean_converges_like_one_over_sqrt_n():
    """Statistical check with fixed seeds: the error of the mean of N sampled gradients
    falls like N^-1/2 (slope of log error vs log N between -0.75 and -0.25)."""
    with llama_norm_in_float64():
        stock, model = stock_and_ours("tiny-llama")
        batch = padded_batch(stock.config.vocab_size, lengths=(60, 47))
        k, budget = 6, 2
        seco_step(_context(model, "seco", chunk=10), batch)
        exact = torch.cat([g.flatten() for g in grads(model).values()])
        names = list(grads(model))
        model.zero_grad(set_to_none=True)
        options = SpaCOOptions(chunk=10, budget=budget)
        generator = torch.Generator().manual_seed(1234)
        total = torch.zeros_like(exact)
        errors = {}
        for n in range(1, 129):
            g = _spaco_grads(model, batch, options, select_chunks(k, budget, generator))
            total += torch.cat([g[name].flatten() if name in g else torch.zeros_like(dict(model.named_parameters())[name]).flatten() for name in names])
            if n in (8, 32, 128):
                errors[n] = float((total / n - exact).norm() / exact.norm())
    slope = (math.log(errors[128]) - math.log(errors[8])) / (math.log(128) - math.log(8))
    assert -0.75 <= slope <= -0.25, errors
    assert errors[128] < errors[32] < errors[8]


def test_spaco_draws_about_budget_chunks_and_repeats_with_the_seed():
    generator = torch.Generator().manual_seed(0)
    sizes = [len(select_chunks(64, 8, generator)) for _ in range(400)]
    assert abs(sum(sizes) / len(sizes) - 8) < 0.5
    model = build_from_config(preset_config("tiny-llama"), torch.float64)
    batch = {"input_ids": torch.randint(0, 100, (1, 64))}
    strategy = lt.Strategy(engine="spaco", engine_options={"chunk": 8, "budget": 2})
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        lt.step(model, batch, strategy)
        runs.append(grads(model))
        model.zero_grad(set_to_none=True)
    assert runs[0].keys() == runs[1].keys() and all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def _seco_peak(seq, chunk=64):
    report, _ = run_training_steps(
        lambda: build_from_config(preset_config("tiny-llama"), torch.float32),
        seq_len=seq, strategy=lt.Strategy(engine="seco", engine_options={"chunk": chunk}),
        optimizer="none", iterations=1, fake=False,
    )
    return report.peak_device_bytes


def test_seco_peak_grows_only_by_the_added_kv():
    """Exact CPU measurement: quadrupling the length adds at most the new tokens' K/V
    (every layer), their gradient accumulators, their ids/labels/positions and rotary
    tables (computed once for the whole sequence)."""
    config = preset_config("tiny-llama")
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    short, long = 256, 1024
    grown = _seco_peak(long) - _seco_peak(short)
    assert grown <= (long - short) * (2 * kv_per_token + 4 * 8 + 2 * head_dim * 4)
    # ... and the activations of a whole-sequence step grow far faster.
    plain = [run_training_steps(lambda: build_from_config(config, torch.float32), seq_len=n, strategy="checkpoint",
                                optimizer="none", iterations=1, fake=False)[0].peak_device_bytes for n in (short, long)]
    assert plain[1] - plain[0] > 2 * grown


def test_bad_options_are_refused_when_the_strategy_is_built():
    with pytest.raises(lt.LongtrainError, match="budget must be a positive integer"):
        lt.Strategy(engine="spaco", engine_options={"budget": 0})
    with pytest.raises(lt.LongtrainError, match="cap must be a number of at least 1"):
        lt.Strategy(engine="spaco", engine_options={"cap": 0.5})
    with pytest.raises(lt.LongtrainError, match="seco chunk must be a positive integer"):
        lt.Strategy.parse("none", engine="seco:chunk=big")
    with pytest.raises(lt.LongtrainError, match="now the 'fpdt' engine"):
        lt.Strategy(engine="seco", attention={"chunk": 16})


def test_simulated_seco_step_counts_parked_kv_in_host_memory():
    strategy = lt.Strategy(engine="seco", engine_options={"chunk": 256, "offload": True})
    report = lt.simulate("tiny-llama", 1024, strategy=strategy, dtype="float32", optimizer="none")
    config = preset_config("tiny-llama")
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    assert report.peak.peak_host_bytes >= 1024 * kv
