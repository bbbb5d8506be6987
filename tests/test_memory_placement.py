"""The memory planner (offline dynamic storage allocation): bounds between the most bytes
alive, CP-SAT, greedy and an online allocator on recorded traces; plans checked overlap-free
by an independent sweep; the two-level solve of a whole-model trace; the arena."""

import random

import pytest
import torch

import longtrain as lt
from longtrain.memory import placement as P
from longtrain.memory.tracker import MemoryTracker
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config

pytest.importorskip("ortools")


def _recorded_step(layers: int, seq_len: int, strategy) -> list[P.Block]:
    """The device trace of a second training step (the first allocates gradients)."""
    model = build_from_config(preset_config("demo", num_hidden_layers=layers), torch.float32)
    lt.apply(model, strategy)
    batch = {"input_ids": torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(0))}
    with MemoryTracker(model) as tracker:
        lt.step(model, batch)
        model.zero_grad(set_to_none=True)
        tracker.reset_peak()
        lt.step(model, batch)
        return tracker.trace()


@pytest.mark.parametrize("strategy", [lt.Strategy(), lt.Strategy(memo=lt.MemoOptions(alpha=0.5, keep_last=0))])
def test_a_llama_layer_step_is_planned_between_the_bounds(strategy):
    blocks = _recorded_step(1, 1024, strategy)
    assert len(blocks) > 100
    greedy = P.best_fit(blocks)
    best = P.solve(blocks, time_limit=8, hint=greedy)  # (CP-SAT's own limit; no clock is asserted in tests)
    P.check_plan(blocks, best)
    P.check_plan(blocks, greedy)
    assert P.live_peak(blocks) <= best.peak <= greedy.peak <= P.first_fit_online(blocks).peak


def test_a_whole_model_trace_is_planned_in_two_levels():
    blocks = _recorded_step(4, 1024, lt.Strategy(memo=lt.MemoOptions(alpha=0.3, keep_last=1), mst=True))
    plan = P.solve_bilevel(blocks, windows=16, time_limit=2)
    P.check_plan(blocks, plan)
    assert plan.peak >= P.live_peak(blocks) and plan.details["outer_blocks"] < len(blocks)
    best, greedy = P.plan_memory(blocks, bilevel_above=50)
    P.check_plan(blocks, best)
    assert best.peak <= greedy.peak


def test_cp_sat_beats_greedy_where_greedy_is_poor():
    # Greedy places the biggest first; a long thin block then cannot fill the gaps two
    # short ones leave. The optimum packs everything at the bound.
    blocks = [P.Block(4 * P.ALIGN, 0, 2), P.Block(4 * P.ALIGN, 2, 4), P.Block(2 * P.ALIGN, 0, 4),
              P.Block(2 * P.ALIGN, 1, 3), P.Block(3 * P.ALIGN, 3, 5)]
    best = P.solve(blocks, time_limit=5)
    P.check_plan(blocks, best)
    assert best.peak == P.live_peak(blocks) <= P.best_fit(blocks).peak


def test_random_traces_plans_are_overlap_free():
    rng = random.Random(0)
    for _ in range(20):
        blocks = []
        for _ in range(rng.randint(1, 40)):
            start = rng.randint(0, 50)
            blocks.append(P.Block(rng.randint(1, 5000), start, start + rng.randint(1, 20)))
        for plan in (P.best_fit(blocks), P.first_fit_online(blocks), P.solve(blocks, time_limit=1)):
            P.check_plan(blocks, plan)
            assert plan.peak >= P.live_peak(blocks)


def test_the_checker_catches_overlaps():
    blocks = [P.Block(1024, 0, 5), P.Block(1024, 3, 8)]
    with pytest.raises(AssertionError, match="overlap"):
        P.check_plan(blocks, P.Plan([0, 512], 2048, "wrong"))
    P.check_plan(blocks, P.Plan([0, 1024], 2048, "right"))
    P.check_plan([P.Block(1024, 0, 3), P.Block(1024, 3, 8)], P.Plan([0, 0], 1024, "reuse after free"))


def test_cuda_snapshot_traces_are_read():
    snapshot = {"device_traces": [[
        {"action": "alloc", "addr": 0, "size": 512}, {"action": "alloc", "addr": 512, "size": 1024},
        {"action": "free_requested", "addr": 0, "size": 512}, {"action": "free_completed", "addr": 0, "size": 512},
        {"action": "alloc", "addr": 0, "size": 256},
    ]]}
    blocks = P.trace_from_cuda_snapshot(snapshot)
    assert sorted((b.size, b.start, b.end) for b in blocks) == [(256, 4, 6), (512, 0, 3), (1024, 1, 6)]


def test_the_arena_serves_planned_views_that_do_not_clobber_each_other():
    blocks = [P.Block(4096, 0, 2), P.Block(4096, 1, 3), P.Block(4096, 2, 4)]
    plan = P.solve(blocks, time_limit=2)
    arena = P.Arena(plan)
    assert arena.buffer.numel() == plan.peak == 2 * 4096
    a, b = arena.tensor(0, (1024,), torch.float32), arena.tensor(1, (1024,), torch.float32)
    a.fill_(1.0)
    b.fill_(2.0)
    assert float(a.sum()) == 1024.0  # alive together: disjoint
    c = arena.tensor(2, (512,), torch.float64)  # alive with b only: reuses a's bytes, never b's
    assert c.data_ptr() == a.data_ptr()
    c.fill_(3.0)
    assert float(b.sum()) == 2048.0


def test_simulate_reports_fragmentation():
    report = lt.simulate(preset_config("demo", num_hidden_layers=2), 512, strategy="memo:alpha=0.5:keep_last=0",
                         optimizer="none", fragmentation=True)
    frag = report.fragmentation
    assert frag.live_peak <= frag.planned_peak <= frag.greedy_peak and frag.online_peak >= frag.live_peak
    assert report.notes["memo_alpha"] == 0.5
    assert "planned" in report.table() and "online first-fit" in report.table()
