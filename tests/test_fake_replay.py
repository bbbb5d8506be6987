"""The simulator's replay of FakeTensor's answers (longtrain.memory.fake_replay): a
simulation with it equals one without it to the byte — every engine and technique, LoRA,
4-bit bases, sequence parallelism, a mixture of experts and a state-space model — and
the ops whose records could not be trusted are answered by FakeTensorMode every time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from longtrain.memory import fake_replay
from longtrain.memory.tracker import MemoryTracker
from longtrain.plan.simulate import simulate
from longtrain.strategy import Strategy


@pytest.fixture
def fresh_records():
    """No record from earlier tests, and replaying back on afterwards."""
    fake_replay._RECORDS.clear()
    yield
    fake_replay.replaying(True)
    fake_replay._RECORDS.clear()


def _figures(report) -> tuple:
    peak = report.peak
    return (peak.peak_device_bytes, peak.host_bytes_at_peak, peak.peak_host_bytes, peak.by_category,
            [dataclasses.astuple(t) for t in peak.largest], report.notes)


CASES = [
    ("tiny-llama", 97, "checkpoint,mst", {}),
    ("tiny-llama", 97, "checkpoint:offload_inputs:except_last=1,mst", {"batch_size": 2}),
    ("tiny-llama", 100, "memo", {}),
    ("tiny-llama", 101, "fpdt:chunk=32:offload:keep_output,mst", {}),
    ("tiny-llama", 101, "fpdt:chunk=32:segment=2", {"optimizer": "adamw-offload"}),
    ("tiny-llama", 96, "seco:chunk=32", {}),
    ("tiny-llama", 96, "spaco:chunk=32:budget=1", {}),
    ("tiny-llama", 64, Strategy.parse("checkpoint,mst", sequence_parallel=2), {}),
    ("tiny-llama", 97, "fpdt:chunk=32,mst", {"lora_rank": 4}),
    ("tiny-llama", 97, "checkpoint", {"lora_rank": 4, "four_bit": True}),
    ("tiny-qwen3-moe", 67, "checkpoint,mst", {}),
    ("tiny-gemma2", 70, "fpdt:chunk=32:offload_inputs", {}),
    ("tiny-mamba", 70, "adjoint", {}),
]


@pytest.mark.parametrize("model,seq_len,strategy,extra", CASES, ids=[f"{m}-{s if isinstance(s, str) else s.name}" for m, _, s, _ in CASES])
def test_replayed_simulation_equals_fake_tensor_mode_to_the_byte(fresh_records, model, seq_len, strategy, extra):
    kwargs = dict(strategy=strategy, exact=True, optimizer="none") | extra
    fake_replay.replaying(False)
    reference = _figures(simulate(model, seq_len, **kwargs))
    fake_replay.replaying(True)
    recording = _figures(simulate(model, seq_len, **kwargs))  # records made on the way
    replayed = _figures(simulate(model, seq_len, **kwargs))  # every op seen before: built from records
    assert recording == reference
    assert replayed == reference
    assert any(record is not fake_replay._NEVER for record in fake_replay._RECORDS.values())


def _fakes(*shapes):
    mode = FakeTensorMode()
    with mode:
        return mode, [torch.empty(shape) for shape in shapes]


def _replayed(func, *args, **kwargs):
    """``func`` dispatched twice through the replay (the second time from its record, where the
    one mode active is FakeTensorMode, as inside the tracker's dispatch)."""
    first = fake_replay.dispatch(func, args, kwargs)
    return first, fake_replay.dispatch(func, args, kwargs)


def test_views_share_their_input_storage_and_in_place_ops_return_their_input(fresh_records):
    mode, (x,) = _fakes((4, 6))
    ops = (torch.ops.aten.view.default, torch.ops.aten.add_.Tensor, torch.ops.aten.mul.Tensor)
    with mode:  # FakeTensorMode the one mode below: as inside the tracker's dispatch
        _, view = _replayed(ops[0], x, [6, 4])
        _, same = _replayed(ops[1], x, x)
        _, fresh = _replayed(ops[2], x, 2.0)
    recorded = {key[0]: record for key, record in fake_replay._RECORDS.items()}
    assert all(recorded[op] is not fake_replay._NEVER for op in ops)  # the second calls were built from them
    assert type(view) is FakeTensor and view.shape == (6, 4)
    assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert same is x
    assert fresh.untyped_storage()._cdata != x.untyped_storage()._cdata
    assert (fresh.shape, fresh.stride(), fresh.dtype, fresh.device) == (x.shape, x.stride(), x.dtype, x.device)


def test_ops_that_change_metadata_or_storage_are_never_replayed(fresh_records):
    mode, (x, y) = _fakes((4, 6), (4, 6))
    with mode:
        fake_replay.dispatch(torch.ops.aten.unsqueeze_.default, (x, 0), {})
        assert x.shape == (1, 4, 6)
        fake_replay.dispatch(torch.ops.aten.resize_.default, (y, [8, 6]), {})
        fake_replay.dispatch(torch.ops.aten.mul.out, (x, 2.0), {"out": torch.empty(1, 4, 6)})
    records = {key[0]: record for key, record in fake_replay._RECORDS.items()}
    assert records[torch.ops.aten.unsqueeze_.default] is fake_replay._NEVER
    assert records[torch.ops.aten.resize_.default] is fake_replay._NEVER
    assert records[torch.ops.aten.mul.out] is fake_replay._NEVER


def test_real_tensors_and_constants_pass_through_unrecorded(fresh_records):
    real = torch.ones(3)
    assert torch.equal(fake_replay.dispatch(torch.ops.aten.mul.Tensor, (real, 2.0), {}), torch.full((3,), 2.0))
    mode, (x,) = _fakes((2,))
    constant = FakeTensor(mode, torch.empty(2, device="meta"), x.fake_device, constant=torch.tensor([1.0, 2.0]))
    with mode:
        fake_replay.dispatch(torch.ops.aten.mul.Tensor, (constant, 2.0), {})
    assert fake_replay._RECORDS == {}


def test_quickly_built_fake_tensors_equal_constructed_ones(fresh_records):
    mode, (x,) = _fakes((4, 6))
    meta = torch.empty((2, 3), device="meta")
    made = FakeTensor(mode, meta, x.fake_device)
    fake_replay._TEMPLATE[0] = None
    first = fake_replay._fake(mode, torch.empty((2, 3), device="meta"), x.fake_device, False)
    second = fake_replay._fake(mode, torch.empty((2, 3), device="meta"), x.fake_device, False)
    for built in (first, second):
        assert type(built) is FakeTensor and built.__dict__ == made.__dict__
        assert torch._C._dispatch_keys(built) == torch._C._dispatch_keys(made)
        assert (built.shape, built.device, built.requires_grad) == (made.shape, made.device, False)


def test_a_mode_between_the_tracker_and_fake_tensor_mode_sees_every_op(fresh_records):
    from torch.utils.flop_counter import FlopCounterMode

    mode, (a, b) = _fakes((64, 64), (64, 64))
    with mode, FlopCounterMode(display=False) as flops, MemoryTracker():
        for _ in range(3):
            torch.mm(a, b)
    assert flops.get_total_flops() == 3 * 2 * 64**3


def test_inference_mode_and_mixed_fake_modes_are_answered_as_fake_tensor_mode_answers(fresh_records):
    mode, (x, y) = _fakes((4, 6), (4, 6))
    _, (other,) = _fakes((4, 6))  # of another fake mode
    with mode, MemoryTracker():
        x.view(6, 4)  # recorded outside inference mode
        with torch.inference_mode():
            view = x.view(6, 4)
        view.add_(1)  # a view made in inference mode of a normal tensor stays usable
        x * y  # recorded
        with pytest.raises(AssertionError, match="Mixing fake modes"):
            x * other


def test_the_tracker_counts_no_fake_meta_tensor(fresh_records):
    mode = FakeTensorMode()
    with mode, MemoryTracker() as tracker:
        kept = torch.empty(1000, device="meta")
        kept * 2
    assert tracker.peak_bytes == 0
