"""``stream``: frozen layer weights in host memory, a window of layers on the device.

The step must be bit for bit the unstreamed one (the same values meet the same ops) under
every engine and technique, the device must hold at most the window's weights, and the
planner must count the bytes it moves and the copies' time."""

from __future__ import annotations

import contextlib
import copy
import weakref

import pytest
import torch
from conftest import (
    backward_on_another_thread,
    check_step,
    grads,
    packed_batch,
    padded_batch,
    randomize_lora,
    stock_and_ours,
    stock_lora_and_ours,
)
from torch.utils._python_dispatch import TorchDispatchMode

import longtrain as lt
from longtrain.errors import LongtrainError
from longtrain.memory import weight_stream
from longtrain.memory.token_swap import storage_id
from longtrain.memory.tracker import MemoryTracker
from longtrain.models.loading import add_lora
from longtrain.models.presets import preset_config
from longtrain.plan.bounds import Budget, budget_under
from longtrain.plan.candidates import added_techniques, candidates
from longtrain.plan.time_model import step_time
from longtrain.strategy import Strategy, applied_context
from longtrain.techniques.stream.costs import layer_weight_bytes
from longtrain.thread_flag import ThreadFlag

STRATEGIES = [
    "backprop",
    "mst",
    "checkpoint",
    "checkpoint,mst",
    "checkpoint:offload_inputs,mst",
    "checkpoint:except_last=1,mst",
    "fpdt:chunk=16",
    "fpdt:chunk=16:offload:keep_output=2,mst",
    "seco:chunk=16,mst",
    "seco:chunk=16",
    "spaco:chunk=16:budget=2",
    "memo:alpha=1",
]


def _four_layers(preset: str):
    config = preset_config(preset)
    config.num_hidden_layers = 4
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = (config.layer_types * 4)[:4]
    return config


def _lora_pair(preset: str, dropout: float = 0.0):
    """Two copies of a 4-layer model with LoRA adapters (random B), identical weights."""
    _, model = stock_and_ours(_four_layers(preset))
    model = add_lora(model, rank=4, dropout=dropout)
    randomize_lora(model)
    return model, copy.deepcopy(model)


def _frozen_experts_pair(preset: str):
    """Two copies of a 4-layer mixture of experts whose experts do not train."""
    _, model = stock_and_ours(_four_layers(preset))
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.requires_grad_(False)
    return model, copy.deepcopy(model)


class HostCopyReads(TorchDispatchMode):
    """Records every op that reads a streamed weight's host copy outside the copy to the
    device: on a GPU each would mix host and device tensors (on the CPU they would not
    show, the values being the same)."""

    def __init__(self, stream):
        super().__init__()
        self.hosts = {storage_id(t) for t in stream.host_tensors()}
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not _COPYING.on and any(storage_id(t) in self.hosts for t in tensors):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


_COPYING = ThreadFlag()


@pytest.fixture
def host_copy_reads(monkeypatch):
    """The reads of host copies of the steps run while it is active (``watch(stream)``)."""
    fetch = weight_stream.WeightStream._fetch

    def marked_fetch(self, group):
        with _COPYING.raised():
            return fetch(self, group)

    monkeypatch.setattr(weight_stream.WeightStream, "_fetch", marked_fetch)
    return HostCopyReads


def _same_step(plain, streamed, strategy: str, batch, another_thread: bool = False, watch=None):
    lt.apply(plain, strategy)
    lt.apply(streamed, strategy + ",stream")
    losses = []
    for model in (plain, streamed):
        torch.manual_seed(7)
        watching = watch(applied_context(model).weight_stream) if watch and model is streamed else None
        with backward_on_another_thread() if another_thread else contextlib.nullcontext(), \
                watching or contextlib.nullcontext():
            losses.append(lt.step(model, batch))
        assert watching is None or not watching.reads, watching.reads
    plain_grads, streamed_grads = grads(plain), grads(streamed)
    assert torch.equal(losses[0], losses[1])
    assert plain_grads.keys() == streamed_grads.keys() and plain_grads
    for name in plain_grads:
        assert torch.equal(plain_grads[name], streamed_grads[name]), name


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("preset, dropout", [("tiny-qwen3-moe", 0.0), ("tiny-llama", 0.1)])
def test_a_lora_step_with_streamed_weights_is_bit_for_bit_the_step_without(strategy, preset, dropout, host_copy_reads):
    """No op reads a host copy (on a GPU: a device mismatch). peft takes no dropout on
    adapters of a mixture's 3-D experts (and adds their delta to the expert weight before
    calling the experts); the dense model's adapters draw theirs, the same draws with and
    without streaming."""
    plain, streamed = _lora_pair(preset, dropout=dropout)
    _same_step(plain, streamed, strategy, padded_batch(plain.config.vocab_size, lengths=(37, 29)), watch=host_copy_reads)
    assert streamed._longtrain.weight_stream.fetches >= 4  # every layer came from host memory


@pytest.mark.parametrize("strategy", ["checkpoint,mst", "fpdt:chunk=16:offload,mst", "seco:chunk=16"])
def test_frozen_experts_streamed_over_packed_documents_on_autograd_s_thread(strategy, host_copy_reads):
    plain, streamed = _frozen_experts_pair("tiny-gpt-oss")  # sinks, sliding and full layers, biased experts
    _same_step(plain, streamed, strategy, packed_batch(plain.config.vocab_size), another_thread=True,
               watch=host_copy_reads)


def test_memo_s_shape_only_pass_over_streamed_weights(host_copy_reads):
    """Memo learns which saved tensors carry tokens in a fake mode over the real weights:
    the streamed copies it meets are real ones, and the step is bit for bit the same."""
    plain, streamed = _lora_pair("tiny-llama")
    _same_step(plain, streamed, "memo:alpha=0.5,mst", padded_batch(plain.config.vocab_size, lengths=(37, 29)),
               watch=host_copy_reads)


def test_a_streamed_lora_step_equals_the_stock_model_in_float64():
    stock, ours = stock_lora_and_ours("tiny-llama")
    check_step(stock, ours, "checkpoint,mst,stream", padded_batch(stock.config.vocab_size, lengths=(37, 29)))


@pytest.mark.parametrize("strategy, ahead", [("backprop", 1), ("mst", 1), ("checkpoint,mst", 1), ("checkpoint,mst", 2)])
def test_the_device_holds_at_most_the_window_of_layers(strategy, ahead, monkeypatch):
    """Each fetched copy is watched: after every fetch and every unpack of a saved weight,
    at most ``ahead`` + 1 layers' copies are alive — nothing in the graph pins one (without
    checkpointing the graph saves every layer's weights) — and the tracker's device peak,
    and its parameters at the peak, are lower by the layers outside the window."""
    config = _four_layers("tiny-qwen3-moe")
    config.num_hidden_layers = 6
    _, base = stock_and_ours(config)
    base = add_lora(base, rank=4)
    plain, streamed = base, copy.deepcopy(base)
    copies, most = [], [0]
    fetch, ensure = weight_stream.WeightStream._fetch, weight_stream.WeightStream.ensure

    def watched_fetch(self, group):
        made = fetch(self, group)
        copies.append((group, [weakref.ref(t) for t in made.tensors]))
        return made

    def watched_ensure(self, group):
        tensors = ensure(self, group)
        alive = {g for g, refs in copies if any(ref() is not None for ref in refs)}
        most[0] = max(most[0], len(alive))
        return tensors

    monkeypatch.setattr(weight_stream.WeightStream, "_fetch", watched_fetch)
    monkeypatch.setattr(weight_stream.WeightStream, "ensure", watched_ensure)
    lt.apply(plain, strategy)
    lt.apply(streamed, f"{strategy},stream:ahead={ahead}")
    batch = padded_batch(config.vocab_size, lengths=(37, 29))
    reports = []
    for model in (plain, streamed):
        with MemoryTracker(model) as tracker:
            lt.step(model, batch)  # warm (optimizer-free: the step alone)
            tracker.reset_peak()
            lt.step(model, batch)
            reports.append(tracker.report())
    assert 2 <= most[0] <= ahead + 1
    stream = streamed._longtrain.weight_stream
    per_layer = sum(t.nbytes for t in stream.host[1])
    outside = (6 - ahead - 1) * per_layer
    assert reports[0].peak_device_bytes - reports[1].peak_device_bytes >= outside
    assert reports[0].device_bytes("parameters") - reports[1].device_bytes("parameters") >= outside
    assert reports[1].host_bytes("parameters") >= 6 * per_layer  # the host copies, counted as host parameters


def test_settled_weights_take_the_adapters_merge_on_the_device():
    """Before a LoRA run's final model is merged, every streamed weight goes back to the
    device for good (a merge adds a device delta to the weight), and streaming stops."""
    from longtrain.strategy import weights_on_device

    plain, streamed = _lora_pair("tiny-qwen3-moe")
    lt.apply(plain, "checkpoint")
    lt.apply(streamed, "checkpoint,stream")
    batch = padded_batch(plain.config.vocab_size)
    for model in (plain, streamed):
        lt.step(model, batch)
    stream = applied_context(streamed).weight_stream
    held = stream.host_tensors()  # alive, so that no new storage takes their ids
    hosts = {storage_id(t) for t in held}
    weights_on_device(streamed)
    assert stream.settled and not stream.host_tensors()
    assert not any(storage_id(p) in hosts for p in streamed.parameters())
    fetches = stream.fetches
    merged, expected = streamed.merge_and_unload(), plain.merge_and_unload()
    for (name, a), b in zip(merged.named_parameters(), expected.parameters()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        merged(input_ids=batch["input_ids"])
    assert stream.fetches == fetches  # nothing fetched again


def test_weights_read_between_steps_are_the_model_s_and_evaluation_streams_too():
    plain, streamed = _lora_pair("tiny-llama")
    before = {name: p.detach().clone() for name, p in streamed.named_parameters()}
    lt.apply(streamed, "checkpoint,stream")
    lt.step(streamed, padded_batch(streamed.config.vocab_size))
    for name, p in streamed.named_parameters():
        assert torch.equal(p.detach().cpu(), before[name]) or p.requires_grad, name
    streamed.eval()
    with torch.no_grad():
        ids = torch.arange(20).unsqueeze(0) % streamed.config.vocab_size
        lt.apply(plain, "checkpoint")
        assert torch.equal(streamed(input_ids=ids).logits, plain.eval()(input_ids=ids).logits)


def test_a_model_whose_layers_all_train_is_refused_in_one_line():
    _, model = stock_and_ours(_four_layers("tiny-llama"))
    with pytest.raises(LongtrainError, match="every decoder-layer weight of this model trains; drop stream"):
        lt.apply(model, "checkpoint,stream")


def test_the_plan_weighs_streaming_where_frozen_layers_fill_the_device():
    moe, dense = preset_config("qwen3-30b-a3b"), preset_config("llama3-8b")
    assert added_techniques(moe, 80 * 2**30, 2, frozen=True) == ("stream",)
    assert added_techniques(moe, 80 * 2**30, 2, frozen=False) == ()  # full fine-tuning: nothing frozen
    assert added_techniques(dense, 80 * 2**30, 2, frozen=True) == ()  # 15 GiB of 80: not worth the copies
    found = candidates(2**17, 128 * 2**30, 48, added=("stream",))
    assert "checkpoint,mst" in found and "checkpoint,stream,mst" in found
    budget = Budget(80 * 2**30, 128 * 2**30, 61 * 2**30, 0, 0, "adamw")
    streamed = budget_under(Strategy.parse("checkpoint,mst,stream"), budget, moe, 2)
    per_layer = layer_weight_bytes(moe, 2)
    assert budget.persistent - streamed.persistent == int(per_layer * 46)  # 48 layers, 2 on the device
    assert streamed.host_state == int(per_layer * 48)
    assert budget_under(Strategy.parse("checkpoint,mst"), budget, moe, 2) is budget


def test_streaming_costs_copy_time_where_compute_cannot_hide_it():
    moe = preset_config("qwen3-30b-a3b")
    short = [step_time(moe, 8192, Strategy.parse(s)).seconds for s in ("checkpoint,mst", "checkpoint,mst,stream")]
    long = [step_time(moe, 2**19, Strategy.parse(s)).seconds for s in ("checkpoint,mst", "checkpoint,mst,stream")]
    assert short[1] > short[0]  # 48 layers × 2 passes of ~1.2 GiB at host bandwidth, little compute to hide them
    assert long[1] == long[0]  # a layer's compute at 512K tokens hides its copy


def test_a_mixture_of_experts_trains_lora_with_streamed_weights_from_the_command_line(tmp_path):
    """To the end: the summary of a run the simulator cannot stand for (a mixture of experts
    in float32) says so instead of failing the finished run."""
    import json

    from conftest import cli

    code, out, err = cli("train", "--model", "tiny-qwen3-moe", "--seq-len", 128, "--steps", 2, "--lora",
                         "--strategy", "checkpoint,mst,stream", "--out", tmp_path, "--eval-samples", 2)
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["simulated_stock_peak_bytes"] is None and "bfloat16 only" in summary["simulated_stock_setup"]
    assert "simulated stock peak  n/a (not simulated:" in out
    assert (tmp_path / "final" / "adapter" / "adapter_model.safetensors").exists()
