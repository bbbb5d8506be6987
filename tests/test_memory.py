import pytest
import torch

import longtrain as lt
from longtrain.errors import LongtrainError
from longtrain.memory import MemoryTracker, host_allocations, mark_host_resident
from longtrain.memory.units import format_bytes, parse_bytes, parse_tokens
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.optimizers import make_optimizer
from longtrain.plan.simulate import run_training_steps


def test_tracker_counts_storages_exactly():
    with MemoryTracker() as tracker:
        a = torch.empty(1000, dtype=torch.float32)
        assert tracker.current_bytes == 4000
        view = a[10:20]  # a view shares the storage: no new bytes
        b = torch.empty(250, dtype=torch.float64)
        assert tracker.current_bytes == 6000
        del a, view
        assert tracker.current_bytes == 2000
        tracker.reset_peak()
        c = torch.empty(100, dtype=torch.int8)
        del b, c
        report = tracker.report()
    assert tracker.peak_bytes == 2100
    assert report.peak_device_bytes == 2100
    assert {info.nbytes for info in report.largest} == {2000, 100}


def test_host_resident_tensors_count_as_host_bytes():
    with MemoryTracker() as tracker:
        on_device = torch.empty(256)
        with host_allocations():
            pinned = torch.empty(1024)  # allocated in host memory from the start
        assert tracker.current_bytes == 1024
        moved = torch.empty(512)
        mark_host_resident(moved)  # offloaded after the fact: leaves the device ledger
        assert tracker.current_bytes == 1024
        extra = torch.empty(16)
        report = tracker.report()
    assert report.peak_device_bytes == 1024 + 2048  # `moved` was on the device once
    assert report.host_bytes_at_peak == 4096
    assert report.peak_host_bytes == 4096 + 2048
    del on_device, pinned, moved, extra


def test_categories_of_a_training_step():
    model = build_from_config(preset_config("tiny-llama"))
    optimizer = make_optimizer("adamw", model.parameters())
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    batch = {"input_ids": torch.randint(0, 300, (2, 128))}
    with MemoryTracker(model, optimizer) as tracker:
        for _ in range(2):
            tracker.reset_peak()
            lt.step(model, batch)
            step_peak = tracker.report()
            tracker.reset_peak()  # a window holding just what is alive after backward
            after_backward = tracker.report()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    # After the second backward: every gradient exists, activations are gone.
    report = after_backward
    assert report.device_bytes("parameters") == param_bytes + buffer_bytes  # buffers: rotary frequencies
    assert report.device_bytes("gradients") == param_bytes
    # AdamW: two moments per parameter plus a float32 step counter per tensor.
    assert report.device_bytes("optimizer_state") == 2 * param_bytes + 4 * len(params)
    # Only the input batch (held by this test, first seen inside the step) remains.
    assert report.device_bytes("activations") == batch["input_ids"].numel() * 8
    # At the step's peak activations dominate, and the categories add up to the peak.
    assert step_peak.device_bytes("activations") > report.device_bytes("gradients")
    assert sum(step_peak.device_bytes(c) for c in step_peak.by_category) == step_peak.peak_device_bytes


@pytest.mark.parametrize("seq_len", [2048, 4096, 8192])
@pytest.mark.parametrize("strategy", ["none", "checkpoint"])
def test_simulation_matches_exact_cpu_measurement(seq_len, strategy):
    """Acceptance: fake-tensor simulation and real CPU measurement of the same code path
    agree within 2% on a tiny Llama at 2K-8K tokens."""
    build = lambda: build_from_config(preset_config("tiny-llama"))  # noqa: E731
    simulated, _ = run_training_steps(build, seq_len=seq_len, strategy=strategy, fake=True)
    measured, _ = run_training_steps(build, seq_len=seq_len, strategy=strategy, fake=False)
    assert abs(simulated.peak_device_bytes - measured.peak_device_bytes) <= 0.02 * measured.peak_device_bytes
    for category, where in measured.by_category.items():
        assert abs(simulated.by_category[category]["device"] - where["device"]) <= 0.02 * measured.peak_device_bytes


def test_checkpointing_lowers_the_measured_peak():
    build = lambda: build_from_config(preset_config("tiny-llama"))  # noqa: E731
    plain, _ = run_training_steps(build, seq_len=4096, strategy="none", fake=False)
    ckpt, _ = run_training_steps(build, seq_len=4096, strategy="checkpoint", fake=False)
    assert ckpt.device_bytes("activations") < plain.device_bytes("activations") / 2


def test_full_scale_simulation_of_llama3_8b():
    report = lt.simulate("llama3-8b", 1024, strategy="checkpoint", optimizer="adamw")
    n = 8_030_261_248
    assert report.parameters == n
    assert 2 * n <= report.peak.device_bytes("parameters") <= 2 * n + 4096  # bf16, plus rotary buffers
    assert report.peak.device_bytes("optimizer_state") >= 4 * n  # two bf16 moments
    # Each layer's attention output (bf16) and LSE (float32) wait in host memory for the backward.
    assert report.peak.host_bytes_at_peak == 32 * (1024 * 4096 * 2 + 32 * 1024 * 4)
    assert "optimizer_state" in report.table()


def test_units():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_tokens("64K") == 65536 and parse_tokens("1M") == 2**20 and parse_tokens("300") == 300
    assert format_bytes(1536) == "1.50 KiB"
    with pytest.raises(LongtrainError):
        parse_tokens("12 parsecs")


def test_accumulated_micro_batches_keep_gradients_alive_at_the_peak():
    """With two micro-batches, the second forward runs with the first one's gradients
    alive: every gradient is on the device at the peak, which is higher than one step's."""
    one = lt.simulate("tiny-llama", 512, strategy="checkpoint", optimizer="none", dtype="float32")
    two = lt.simulate("tiny-llama", 512, strategy="checkpoint", optimizer="none", dtype="float32", grad_accum=2)
    assert two.peak.device_bytes("gradients") >= 0.99 * two.peak.device_bytes("parameters")  # (buffers count as parameters)
    assert two.device_peak_bytes > one.device_peak_bytes
