"""Layer checkpointing keeps attention's output: float64 proofs that the recomputation
reuses it (attention's forward runs once per layer per step) with stock autograd's
gradients, on the device or parked in host memory, within or past the host budget,
with backward on another thread as CUDA runs it."""

import pytest
import torch

import longtrain as lt
import longtrain.models.attention as attention_module
from longtrain.techniques.checkpoint import CheckpointOptions

from conftest import check_step, packed_batch, padded_batch, stock_and_ours

TOL = 1e-10


class _KernelCalls:
    """Counts attention's forward kernels: kept (forward + LSE, no autograd) and plain."""

    def __init__(self, monkeypatch):
        self.kept = self.plain = 0
        kept, plain = attention_module.causal_attention_forward, attention_module.causal_attention

        def count_kept(*args, **kwargs):
            self.kept += 1
            return kept(*args, **kwargs)

        def count_plain(*args, **kwargs):
            self.plain += 1
            return plain(*args, **kwargs)

        monkeypatch.setattr(attention_module, "causal_attention_forward", count_kept)
        monkeypatch.setattr(attention_module, "causal_attention", count_plain)


@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2"])
def test_attention_runs_once_per_layer_and_gradients_are_exact(preset, offload, monkeypatch):
    stock, ours = stock_and_ours(preset)
    calls = _KernelCalls(monkeypatch)
    strategy = lt.Strategy(checkpoint=CheckpointOptions(offload=offload), mst=lt.MsT(loss_chunks=3))
    check_step(stock, ours, strategy, packed_batch(stock.config.vocab_size), TOL, another_thread=True)
    assert (calls.kept, calls.plain) == (stock.config.num_hidden_layers, 0)


def test_recomputing_attention_runs_it_twice_per_layer(monkeypatch):
    stock, ours = stock_and_ours("tiny-llama")
    calls = _KernelCalls(monkeypatch)
    strategy = lt.Strategy(checkpoint=CheckpointOptions(keep_attention=False))
    check_step(stock, ours, strategy, padded_batch(320, lengths=(100, 70), left=True), TOL, another_thread=True)
    assert (calls.kept, calls.plain) == (0, 2 * stock.config.num_hidden_layers)


def test_layers_past_the_host_budget_recompute_attention(monkeypatch):
    """One layer's output and LSE fit the budget, the second's do not: it recomputes."""
    stock, ours = stock_and_ours("tiny-llama")
    batch = padded_batch(320, lengths=(100, 70))
    config = stock.config
    one_layer = 2 * 100 * config.hidden_size * 8 + 2 * config.num_attention_heads * 100 * 8  # output + LSE, float64
    calls = _KernelCalls(monkeypatch)
    strategy = lt.Strategy(checkpoint=CheckpointOptions(host_memory=one_layer + one_layer // 2))
    check_step(stock, ours, strategy, batch, TOL, another_thread=True)
    assert (calls.kept, calls.plain) == (1, 2)  # the second layer runs attention the plain way, forward and replay


def test_a_step_whose_backward_never_ran_leaves_nothing_behind(monkeypatch):
    """A step that fails between forward and backward leaves kept outputs; the next
    step's first layer drops them, so the store holds one step's entries at most."""
    stock, ours = stock_and_ours("tiny-llama")
    lt.apply(ours, lt.Strategy(checkpoint=True))
    batch = packed_batch(320)
    backward = torch.autograd.backward

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory in the loss")

    monkeypatch.setattr(torch.autograd, "backward", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        lt.step(ours, batch)
    kept = ours.model.layers[0].forward.args[1]
    one_step = kept.store.host_bytes
    assert len(kept.store) == 2 * stock.config.num_hidden_layers and one_step > 0  # output and LSE of every layer
    monkeypatch.setattr(torch.autograd, "backward", backward)
    for _ in range(2):
        lt.step(ours, batch)
        assert len(kept.store) == 2 * stock.config.num_hidden_layers and kept.store.host_bytes == one_step


def test_a_second_backward_through_the_same_graph_replays_the_kept_outputs_again():
    """retain_graph: the checkpointed layers replay twice, and both read the kept outputs."""
    from longtrain.engines.backprop import forward_loss
    from longtrain.strategy import applied_context

    from conftest import grads, max_rel_error, stock_loss

    stock, ours = stock_and_ours("tiny-llama")
    batch = padded_batch(320, lengths=(100, 70))
    reference = stock_loss(stock, batch)
    reference.backward(retain_graph=True)
    reference.backward()
    lt.apply(ours, lt.Strategy(checkpoint=True))
    loss = forward_loss(applied_context(ours), batch)
    loss.backward(retain_graph=True)
    loss.backward()
    assert max_rel_error(grads(ours), grads(stock)) <= TOL


@pytest.mark.parametrize("spec,message", [
    ("checkpoint:keep_attention=maybe,mst", "keep_attention"),
    ("checkpoint:host_memory=-1", "host_memory"),
])
def test_bad_options_are_refused(spec, message):
    with pytest.raises(lt.LongtrainError, match=message):
        lt.Strategy.parse(spec)
