"""Pinned host buffers of exactly the size asked for (longtrain.memory.pinned), and the
default host budget of the chunked engines' offload.

PyTorch's pinned allocator rounds each buffer up to a power of two, so budgets that count
requested bytes understated what was page-locked by up to 2×. These tests stand a fake
CUDA runtime in for ``cudaHostRegister``/``cudaHostUnregister`` and check what would be
locked on a GPU machine: the exact bytes, once per buffer, unlocked after the device's
queued work when the last view goes. The CUDA tier (tests/test_cuda.py) checks real
copies through such buffers."""

from __future__ import annotations

import gc
import types

import pytest
import torch

import longtrain as lt
from longtrain.engines.chunked import run as chunked
from longtrain.engines.chunked.settings import ChunkSettings
from longtrain.memory import pinned
from longtrain.memory.chunk_store import ChunkStore, PinnedPool
from longtrain.memory.tracker import MemoryTracker


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in one of this process's memory mappings (Linux)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


class FakeRuntime:
    """Records what a CUDA runtime would lock and unlock; ``status`` is what registering
    returns, and a failure stays the thread's ``last_error`` until read, as the runtime's does."""

    def __init__(self, status: int = 0):
        self.status, self.log, self.locked, self.last_error = status, [], {}, 0

    def cudaHostRegister(self, address, nbytes, flags):
        self.log.append(("register", address, nbytes))
        if self.status == 0:
            assert address not in self.locked, "registered twice"
            self.locked[address] = nbytes
        else:
            self.last_error = self.status
        return self.status

    def cudaHostUnregister(self, address):
        self.log.append(("unregister", address))
        assert _mapped(address), "unlocking pages that are no longer mapped"
        assert self.locked.pop(address, None) is not None, "unregistered memory that was not registered"
        return 0


@pytest.fixture
def runtime(monkeypatch):
    fake = FakeRuntime()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    monkeypatch.setattr(pinned, "_synchronize", lambda: fake.log.append(("synchronize",)))
    return fake


def test_a_pinned_buffer_locks_exactly_its_bytes_until_its_last_view_goes(runtime):
    numel = 3 * 2**20 + 5  # bf16: 6 MiB + 10 bytes; PyTorch's pinned allocator would lock 8 MiB
    buffer = pinned.host_empty(numel, torch.bfloat16, pin=True)
    assert buffer.shape == (numel,) and buffer.dtype == torch.bfloat16 and not buffer.any()
    assert runtime.log == [("register", buffer.data_ptr(), numel * 2)]
    assert buffer.data_ptr() % 4096 == 0  # a page boundary: the pages locked are the buffer's own
    view = buffer[7:].view(-1)
    view.fill_(1.5)
    address = buffer.data_ptr()
    del buffer
    gc.collect()
    assert runtime.locked == {address: numel * 2}  # a view still uses the pages
    del view
    gc.collect()
    # The device's queued copies end before the pages are unlocked.
    assert runtime.log[1:] == [("synchronize",), ("unregister", address)] and runtime.locked == {}


def test_without_pinning_or_elements_nothing_is_locked(runtime):
    assert pinned.host_empty(10, torch.float32, pin=False).shape == (10,)
    assert pinned.host_empty(0, torch.float32, pin=False).numel() == 0
    assert runtime.log == []


def test_a_refused_registration_falls_back_to_pytorchs_pinned_memory(monkeypatch):
    fake = FakeRuntime(status=1)  # e.g. the locked-memory limit
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    # The next kernel's launch check would raise the refusal as its own error: it is read at once.
    monkeypatch.setattr(pinned, "_clear_last_error", lambda: setattr(fake, "last_error", 0))
    fallback = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        fallback.append(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(pinned.torch, "empty", empty)
    buffer = pinned.host_empty(1000, torch.float32, pin=True)
    assert buffer.shape == (1000,) and fallback[-1] is True and fake.locked == {} and fake.last_error == 0


@pytest.mark.parametrize("strategy", [lt.Strategy(engine="fpdt", engine_options={"chunk": 64, "offload": True}),
                                      lt.Strategy(checkpoint=True, mst=True), lt.Strategy(memo=lt.MemoOptions(alpha=0.5, keep_last=1))])
def test_a_simulation_on_a_gpu_machine_locks_nothing(strategy, runtime, monkeypatch):
    """The pools pin on a machine with CUDA; a simulation (fake tensors: ``longtrain plan``,
    ``--strategy auto``) allocates nothing, so it must lock nothing — a real locked buffer
    under fake tensors failed the simulation's first view of it."""
    from longtrain.models.loading import build_from_config
    from longtrain.models.presets import preset_config
    from longtrain.plan.simulate import run_training_steps

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    report, _ = run_training_steps(lambda: build_from_config(preset_config("tiny-llama"), torch.float32), seq_len=256,
                                   strategy=strategy, optimizer="none", iterations=1)
    assert report.peak_host_bytes > 0 and runtime.log == []


def test_the_pool_locks_each_buffer_once_and_counts_the_bytes_asked_for(runtime):
    pool = PinnedPool(pin=True)
    a, _ = pool.acquire(torch.Size([3, 1001]), torch.bfloat16)
    b, _ = pool.acquire(torch.Size([7]), torch.float32)
    assert pool.allocated_bytes == 3 * 1001 * 2 + 7 * 4
    assert sorted(n for _, _, n in (e for e in runtime.log if e[0] == "register")) == [28, 6006]
    pool.release(a)
    again, _ = pool.acquire(torch.Size([1001, 3]), torch.bfloat16)  # same elements and dtype: reused
    assert again.data_ptr() == a.data_ptr() and len(runtime.locked) == 2
    pool.reserve(torch.Size([5]), torch.float64)
    assert pool.allocated_bytes == 6006 + 28 + 40 and len(runtime.locked) == 3
    del a, b, again
    pool.clear()
    gc.collect()
    assert runtime.locked == {}


def test_a_store_parks_in_exact_pinned_buffers_counted_as_host_memory(runtime):
    store = ChunkStore("cpu", offload=True, pool=PinnedPool(pin=True))
    x = torch.arange(1001, dtype=torch.float32)
    with MemoryTracker() as tracker:
        store.put("a", x * 2)
        report = tracker.report()
    assert report.peak_host_bytes == x.nbytes  # the tracker sees the buffer no op allocated
    assert list(runtime.locked.values()) == [x.nbytes]
    assert torch.equal(store.get("a"), x * 2)
    store.clear()


# ---- the chunked engines' default host budget ------------------------------------------


def _shard(device: str):
    ids = types.SimpleNamespace(device=torch.device(device), shape=(2, 1000))
    return types.SimpleNamespace(input_ids=ids, rotary_positions=torch.zeros(1, 1000))


def _check(monkeypatch, shard, budget=None, need=10 * 2**30, default=2**30):
    monkeypatch.setattr(chunked, "host_bytes_needed", lambda *args, **kwargs: need)
    monkeypatch.setattr(chunked, "pinned_host_budget", lambda: default)
    embeddings = types.SimpleNamespace(weight=torch.zeros(1, dtype=torch.bfloat16))
    context = types.SimpleNamespace(adapter=types.SimpleNamespace(
        base=types.SimpleNamespace(get_input_embeddings=lambda: embeddings)), strategy=types.SimpleNamespace(engine="fpdt"),
        host_held=0, host_room=lambda: None)
    settings = ChunkSettings(chunk=256, offload=True, prefetch=1, host_budget=budget, offload_inputs=True,
                             recompute_kv=True, keep_output=False, segment=1)
    chunked.check_host_budget(context, shard, settings)


def test_offload_on_cuda_is_bounded_by_half_the_host_unless_told(monkeypatch):
    with pytest.raises(lt.LongtrainError) as refused:
        _check(monkeypatch, _shard("cuda"))
    message = str(refused.value)
    assert "\n" not in message and "10.00 GiB" in message and "1.00 GiB (half the physical memory, the default)" in message
    assert "fpdt:host_memory=" in message
    _check(monkeypatch, _shard("cuda"), budget=11 * 2**30)  # told: the budget given holds
    _check(monkeypatch, _shard("cuda"), need=2**29)  # within the default


def test_offload_on_the_cpu_and_in_simulations_is_unbounded_by_default(monkeypatch):
    _check(monkeypatch, _shard("cpu"))  # nothing is page-locked on the CPU
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2, 1000, dtype=torch.long)
    _check(monkeypatch, types.SimpleNamespace(input_ids=fake, rotary_positions=torch.zeros(1, 1000)))


def test_the_default_host_budget_is_shared_by_the_processes_of_a_machine(monkeypatch):
    """Half the physical memory, divided among torchrun's processes on this machine (each
    rank would otherwise pin up to half of it)."""
    from longtrain.memory import units

    monkeypatch.setattr(units, "physical_memory", lambda: 128 * 2**30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert units.pinned_host_budget() == 64 * 2**30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert units.pinned_host_budget() == 16 * 2**30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    assert units.pinned_host_budget() == 64 * 2**30
