"""A simulation or a plan is for the machine the user names (--device-memory, --host-memory),
never for the one computing it (DESIGN.md, "Budgets belong to the target machine"); and a
length that no configuration can hold is refused at once.

The simulating machine's physical memory is patched (``longtrain.memory.units.physical_memory``,
which real runs' default budgets read) to values on both sides of what the steps park.
"""

import pytest

import longtrain as lt
from longtrain.cli import main
from longtrain.memory import units
from longtrain.models.presets import preset_config
from longtrain.plan.planner import PlanRequest, plan
from longtrain.plan.simulate import simulate

GIB = 2**30
MACHINES = (8 * GIB, 2**40)  # the physical memory of the machine that simulates


def _figures(report):
    return (report.device_peak_bytes, report.peak.peak_host_bytes, report.peak.host_bytes_at_peak,
            report.notes.get("memo_alpha"))


def _close(a: int, b: int) -> bool:
    return abs(a - b) <= 1e-3 * max(abs(a), abs(b))


@pytest.mark.parametrize("host_memory", [None, "20GiB", "40GiB"])
def test_checkpointed_inputs_parked_within_a_host_budget_extrapolate_and_ignore_this_machine(host_memory, monkeypatch):
    """Llama-3-8B's layers at 256K tokens (8 of them): each parks a 2 GiB input and keeps a
    2 GiB attention output. Unbounded (no host memory named) every layer parks both; 20 GiB
    holds the inputs and one output (the budget stops the layers partway: the model is
    simulated whole); 40 GiB holds everything. The extrapolated figures equal the whole
    model's, and neither depends on the simulating machine — before, the budget was half its
    physical memory, shared out unevenly among the small simulations."""
    config = preset_config("llama3-8b", num_hidden_layers=8)
    strategy = "checkpoint:offload_inputs=true,mst"
    seen = set()
    for physical in MACHINES:
        monkeypatch.setattr(units, "physical_memory", lambda physical=physical: physical)
        fast = simulate(config, 256 * 1024, strategy=strategy, optimizer="none", host_memory=host_memory)
        seen.add(_figures(fast))
    assert len(seen) == 1
    exact = simulate(config, 256 * 1024, strategy=strategy, optimizer="none", host_memory=host_memory, exact=True)
    assert _close(fast.device_peak_bytes, exact.device_peak_bytes)
    assert _close(fast.peak.peak_host_bytes, exact.peak.peak_host_bytes)
    parked = {None: 16 + 8 * 2.03, "20GiB": 18.03, "40GiB": 16 + 8 * 2.03}[host_memory]
    assert abs(exact.peak.peak_host_bytes / GIB - parked) < 0.1
    if host_memory is not None:
        assert exact.peak.peak_host_bytes <= units.parse_bytes(host_memory)


def test_memo_takes_its_budget_from_the_named_host_memory(monkeypatch, capsys):
    """`longtrain simulate --strategy memo --host-memory 120GiB` on a 24 GiB machine: Memo's
    budget is the 120 GiB named (it refused, over a budget of half the 24 GiB); without
    --host-memory it is unbounded, whatever machine simulates."""
    monkeypatch.setattr(units, "physical_memory", lambda: 24 * GIB)
    code = main(["simulate", "--model", "llama3-8b", "--seq-len", "32768", "--strategy", "memo", "--host-memory",
                 "120GiB", "--no-progress", "--json"])
    out = capsys.readouterr().out
    assert code == 0 and '"memo_host_budget": 128849018880' in out
    config = preset_config("llama3-8b", num_hidden_layers=6)
    figures = set()
    for physical in MACHINES:
        monkeypatch.setattr(units, "physical_memory", lambda physical=physical: physical)
        report = simulate(config, 32768, strategy="memo,mst", optimizer="none")
        assert report.notes["memo_host_budget"] is None
        figures.add(_figures(report))
    assert len(figures) == 1


def test_a_budget_the_strategy_names_is_kept_and_the_default_one_resolved_for_the_named_machine():
    from longtrain.plan.simulate import on_machine

    strategy = lt.Strategy.parse("memo:host_memory=8GiB,mst")
    assert on_machine(strategy, 100 * GIB).techniques["memo"].host_memory == 8 * GIB
    assert on_machine(lt.Strategy.parse("memo,mst"), 100 * GIB).techniques["memo"].host_memory == 100 * GIB
    fpdt = on_machine(lt.Strategy.parse("mst", engine="fpdt:offload=true"), 100 * GIB)
    assert fpdt.engine_options.host_memory == 100 * GIB
    assert on_machine(strategy, None) is strategy


def test_the_longest_length_named_by_a_refusal_is_a_bound_on_what_fits():
    """simulate's refusal names the longest length whose token ids and parked bytes fit
    beside the weights (a bound: the step holds more); within it the simulation runs. plan refuses too."""
    config = preset_config("tiny-llama")
    with pytest.raises(lt.LongtrainError) as refused:
        simulate(config, 10**9, strategy="checkpoint,mst", optimizer="none", device_memory="64MiB")
    longest = int(str(refused.value).split("at most ")[1].split(" tokens")[0].replace(",", ""))
    assert 10**4 < longest < 10**9
    report = simulate(config, longest // 8, strategy="checkpoint,mst", optimizer="none", device_memory="64MiB")
    assert report.seq_len == longest // 8
    with pytest.raises(lt.LongtrainError, match="no strategy weighed fits 1,000,000,000 tokens"):
        plan(PlanRequest(config, 10**9, device_memory=64 * 2**20, host_memory=64 * 2**20))
