"""The longest-context search (plan/longest.py): the length it reports fits by a
whole-length simulation and the next one does not; on convex overflows it needs few
evaluations."""

import math

import pytest

import longtrain as lt
from longtrain.models.presets import preset_config
from longtrain.plan.bounds import Budget, reserved_bytes
from longtrain.plan.longest import longest_context, overflow, search
from longtrain.plan.simulate import simulate

CONVEX = {
    "a line": lambda n: 3.0 * n - 1_000_000,
    "a kink (the peak moves to another place)": lambda n: max(1.0 * n - 200_000, 9.0 * n - 2_500_000),
    "a curve": lambda n: n * n / 1e6 - 150_000,
}


@pytest.mark.parametrize("name", CONVEX)
@pytest.mark.parametrize("start", [1024, 100_000, 5_000_000])
def test_search_ends_where_a_convex_overflow_crosses_zero(name, start):
    calls = []

    def over(n):
        calls.append(n)
        return CONVEX[name](n), "device memory"

    true_end = max(n for n in range(1024, 3_000_000, 1024) if CONVEX[name](n) <= 0)
    found, binds = search(over, start, 1024)
    assert CONVEX[name](found) <= 0 and found % 1024 == 0 and binds == "device memory"
    assert true_end - true_end // 64 - 1024 <= found <= true_end
    assert len(calls) <= 12, calls  # each call is a simulation of up to a minute
    assert search(lambda n: (CONVEX[name](n), "x"), start, 1024, exact=True)[0] == true_end


def test_search_says_when_nothing_fits_or_nothing_binds():
    assert search(lambda n: (1.0, "host memory"), 4096, 1024) == (0, "host memory")
    assert search(lambda n: (-1.0, "-"), 4096, 1024, limit=2**20) == (2**20, "no limit below 1,048,576 tokens")
    # A simulation that refuses (Memo over its host budget) counts as not fitting.
    assert search(lambda n: (math.inf if n > 5000 else -1.0, "refused"), 1024, 1024) == (4096, "refused")


def _peaks(config, tokens, strategy) -> tuple[int, int]:
    report = simulate(config, tokens, strategy=strategy, optimizer="none", dtype="float32", iterations=1)
    return report.device_peak_bytes, report.peak.peak_host_bytes


@pytest.mark.parametrize("spec, engine, aim", [("mst", "fpdt:chunk=16:offload=true:segment=2", 640),
                                               ("checkpoint,mst", None, 3000)])
def test_the_longest_context_fits_and_one_step_more_does_not(spec, engine, aim):
    """Whole-length simulations (simulate(), not the curve the search reads) on both sides
    of the limit found: FPDTOptions to the chunk, the others to within 1/64."""
    config = preset_config("tiny-llama", num_hidden_layers=2)
    strategy = lt.Strategy.parse(spec, engine=engine)
    # A device just large enough for `aim` tokens (the allocator's margin included).
    needs = reserved_bytes(strategy, Budget(0, 0, 0, 0, 0, "none"), _peaks(config, aim, strategy)[0])
    budget = Budget(needs + 100, 2**40, 0, 0, 0, "none")
    found, binds = longest_context(config, strategy, budget, "float32")
    assert binds == "device memory"
    step = 16 if engine else max(1024, found // 64)
    fits = lambda n: overflow(strategy, budget, *_peaks(config, n, strategy))[0] <= 0  # noqa: E731
    assert fits(found) and not fits(found + step)
    if engine:
        assert found == aim  # 40 whole chunks: the budget is what they need plus 100 bytes


def test_max_context_searches_over_a_4_bit_base_when_asked_and_needs_lora(monkeypatch):
    """QLoRA's rows of docs/results/max_context.md: every candidate's search runs on the base
    held in 4 bits (as `plan --lora --4bit` simulates it)."""
    from longtrain.errors import LongtrainError
    from longtrain.models.adapters import adapter_class
    from longtrain.plan import longest

    searched = []

    def recorded(config, strategy, budget, dtype, **_):
        searched.append(adapter_class(config.model_type).base_bits(config))
        return 1024, "device memory"

    monkeypatch.setattr(longest, "longest_context", recorded)
    machine = dict(device_memory=2**30, host_memory=2**30)
    with pytest.raises(LongtrainError, match="lora_rank"):
        longest.max_context("tiny-llama", four_bit=True, **machine)
    longest.max_context("tiny-llama", lora_rank=4, **machine)
    plain = list(searched)
    searched.clear()
    longest.max_context("tiny-llama", lora_rank=4, four_bit=True, **machine)
    assert searched and set(searched) == {4} and not any(plain)
