"""The one mechanism for kept attention outputs (longtrain.models.kept_attention): its budget
rule gives the counts checkpointing, Memo and FPDT each counted before, and an output kept
and served to backward gives what attending again gives, in float64."""

import itertools

import pytest
import torch

import longtrain as lt
from longtrain.engines.chunked import costs as chunked
from longtrain.memory.chunk_store import ChunkStore
from longtrain.models.attention import AttentionCall, WholeSequenceAttention
from longtrain.models.kept_attention import (
    KeptOutputStore,
    RecordingAttention,
    ReplayingAttention,
    attend_keeping,
    kept_layers_that_fit,
)
from longtrain.models.presets import preset_config
from longtrain.models.shapes import kept_output_bytes
from longtrain.ops.causal_attention import causal_attention
from longtrain.techniques.checkpoint import kept_output_share
from longtrain.techniques.memo import memo_alpha

GIB = 2**30


def _old_checkpoint_share(config, tokens, options):  # checkpoint.kept_output_share as it was written
    if not options.keep_attention:
        return 0.0
    if not options.offload or options.host_memory is None:
        return 1.0
    layers = config.num_hidden_layers - min(options.except_last, config.num_hidden_layers)
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    output = tokens * (width * 2 + config.num_attention_heads * 4)
    inputs = layers * tokens * config.hidden_size * 2 if options.offload_inputs else 0
    return min(layers, max(0, (options.host_memory - inputs) // output)) / layers


def _old_fpdt_fit(layers, budget, parked_with):  # chunked.outputs_that_fit's "fit", as it was written
    if budget is None:
        return layers
    parked = parked_with(0)
    return max(0, min(layers, (budget - parked) // max(1, parked_with(1) - parked)))


@pytest.mark.parametrize("model", ["llama3-8b", "gemma2-9b"])
def test_checkpoint_share_is_the_count_it_was(model):
    config = preset_config(model)
    for tokens, host, inputs, last in itertools.product((4096, 65536, 262144), (1 * GIB, 20 * GIB, 100 * GIB, 900 * GIB),
                                                        (False, True), (0, 8)):
        options = lt.Strategy.parse(f"checkpoint:host_memory={host}:offload_inputs={str(inputs).lower()}:"
                                    f"except_last={last}").techniques["checkpoint"]
        assert kept_output_share(config, tokens, options) == _old_checkpoint_share(config, tokens, options)


def test_fpdt_fit_is_the_count_it_was():
    config = preset_config("llama3-8b")
    for length, host, chunk in itertools.product((32768, 131072, 524288), (8 * GIB, 90 * GIB, 400 * GIB, None),
                                                 (8192, 32768)):
        settings = lt.Strategy.parse("mst", engine=f"fpdt:chunk={chunk}:offload=true:keep_output=fit"
                                     + (f":host_memory={host}" if host else "")).engine_options.settings()
        parked = lambda k: chunked.parked_host_bytes(config, 1, length, 2, settings, k)  # noqa: E731
        old = _old_fpdt_fit(config.num_hidden_layers, settings.host_budget, parked)
        assert chunked.planned_kept_outputs(config, length, settings, 2) == old


def test_checkpoint_step_and_memo_checks_are_the_comparisons_they_were():
    for used, above, out, budget in itertools.product((0, 7, 100), (0, 50, 1000), (0, 1, 9, 64), (0, 99, 157, 1200)):
        # CheckpointLayers.has_room: what is held, this output and the inputs above within the budget.
        assert (kept_layers_that_fit(1, budget, used + above, out) == 1) == (used + out + above <= budget)
    for swapped, inputs, outputs, budget in itertools.product((1, 6, 30), (1, 10, 64), (1, 10, 64), (0, 100, 400, 10**9)):
        # memo_alpha's refusal: every swapped layer's input and attention output in host memory.
        fits = kept_layers_that_fit(swapped, budget, swapped * inputs, outputs) == swapped
        assert fits == (swapped * (inputs + outputs) <= budget)
    assert kept_layers_that_fit(32, None, 10**12, 1) == 32 and kept_layers_that_fit(32, float("inf"), 10**12, 1) == 32
    sizes = dict(input_bytes=10, attention_bytes=10, other_bytes=100, layers=10, keep_last=2, bandwidth=1e9, layer_seconds=1)
    assert memo_alpha(**sizes, host_budget=160) == 0.0  # every layer's input and output fit exactly
    with pytest.raises(lt.LongtrainError, match="over the host budget"):
        memo_alpha(**sizes, host_budget=159)


def test_fpdt_correction_counts_with_the_rule():
    config = preset_config("llama3-8b")
    settings = lt.Strategy.parse("mst", engine="fpdt:chunk=32768:offload=true:keep_output=fit:host_memory=90GiB"
                                 ).engine_options.settings()
    per_layer = kept_output_bytes(config, 1, 262144, 2)
    parked = chunked.parked_host_bytes(config, 1, 262144, 2, settings, 0)
    assert chunked.planned_kept_outputs(config, 262144, settings, 2) == kept_layers_that_fit(32, 90 * GIB, parked,
                                                                                               per_layer)


def _qkv(batch=2, heads=4, kv_heads=2, tokens=24, dim=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, tokens, dim, dtype=torch.float64, generator=g)
    k = torch.randn(batch, kv_heads, tokens, dim, dtype=torch.float64, generator=g)
    v = torch.randn(batch, kv_heads, tokens, dim, dtype=torch.float64, generator=g)
    return q, k, v


def _grads(fn, q, k, v, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    torch.autograd.backward(out, grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("offload,layout", [(False, "BHSD"), (True, "BHSD"), (True, "BSHD")])
def test_kept_output_served_to_backward_equals_attending_again(offload, layout):
    q, k, v = _qkv()
    grad = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    settings = dict(scale=None, window=None, softcap=None)
    want_out, want = _grads(lambda *t: causal_attention(*t), q, k, v, grad)

    kept = KeptOutputStore(ChunkStore("cpu", offload=offload), layout=layout)
    call, backward = WholeSequenceAttention(None), []

    def forward(*t):
        out, attention_backward = attend_keeping(call, None, *t, **settings, kept=kept, key=(3, 0))
        backward.append(attention_backward)
        return out

    forward_out, kept_grads = _grads(forward, q, k, v, grad)  # the forward's node, kept output and all
    served_out, served = _grads(lambda *t: kept.serve((3, 0), *t, backward[0]), q, k, v, grad)  # the replay's
    assert torch.equal(forward_out, want_out) and torch.equal(served_out, want_out)
    for a, b, c in zip(want, kept_grads, served):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
        torch.testing.assert_close(c, a, rtol=0, atol=1e-12)
    if layout == "BSHD":  # kept as the layer reads it next; served as a (B, H, S, D) view from any token
        assert kept.store.get(("out", (3, 0))).is_contiguous()
        tail, lse = kept.fetch((3, 0), start=10)
        assert torch.equal(tail, want_out[:, :, 10:]) and lse.shape == q.shape[:2] + (14,)


def test_replaying_call_and_recording_call():
    q, k, v = _qkv()
    settings = dict(scale=None, window=None, softcap=None)
    kept = KeptOutputStore(ChunkStore("cpu", offload=False))
    out = RecordingAttention(WholeSequenceAttention(None), kept, "layer").attend(None, q, k, v, **settings)
    stand_in = ReplayingAttention(kept, "layer", None, start=5).attend(None, q[:, :, 5:], k, v, **settings)
    assert torch.equal(stand_in, out[:, :, 5:])
    with pytest.raises(RuntimeError, match="stand-in"):  # no backward: a recomputation's stand-in
        torch.autograd.backward(ReplayingAttention(kept, "layer", None).attend(
            None, q.clone().requires_grad_(True), k, v, **settings).sum())

    class Chunked(AttentionCall):
        mask = None

    with pytest.raises(NotImplementedError):
        RecordingAttention(Chunked(), kept, "x").attend(None, q, k, v, **settings)
    with pytest.raises(lt.LongtrainError, match="whole sequence"):
        RecordingAttention(Chunked(), kept, "x", refusal="needs the whole sequence").attend(None, q, k, v, **settings)
