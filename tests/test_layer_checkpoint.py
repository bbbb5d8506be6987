"""Layer checkpointing keeps attention's output: float64 proofs that the recomputation
reuses it (attention's forward runs once per layer per step) with stock autograd's
gradients, on the device or parked in host memory, within or past the host budget,
with backward on another thread as CUDA runs it."""

import copy
import functools

import pytest
import torch
from conftest import (
    backward_on_another_thread,
    check_step,
    grads,
    max_rel_error,
    packed_batch,
    padded_batch,
    stock_and_ours,
)
from ssm_helpers import padded, ssm
from ssm_helpers import stock as ssm_stock

import longtrain as lt
import longtrain.models.attention as attention_module
from longtrain.models.presets import preset_config
from longtrain.strategy import applied_context
from longtrain.techniques.checkpoint import CheckpointOptions

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
    strategy = lt.Strategy(checkpoint=CheckpointOptions(offload=offload), mst=lt.MsTOptions(loss_chunks=3))
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
    from conftest import grads, max_rel_error, stock_loss

    from longtrain.engines.backprop import forward_loss
    from longtrain.strategy import applied_context

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
    ("checkpoint:except_last=-1", "except_last"),
    ("checkpoint:except_last=two", "except_last"),
])
def test_bad_options_are_refused(spec, message):
    with pytest.raises(lt.LongtrainError, match=message):
        lt.Strategy.parse(spec)


@pytest.mark.parametrize("batch", ["packed", "left-padded"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2"])
def test_layers_left_whole_recompute_nothing_and_gradients_are_exact(preset, batch, monkeypatch):
    """``except_last=1``: the bottom layer is checkpointed (attention kept), the top one runs
    as stock autograd runs it — not checkpointed, its MLP untiled — so its attention runs
    once, the plain way, and nothing of it is recomputed."""
    stock, ours = stock_and_ours(preset)
    calls = _KernelCalls(monkeypatch)
    strategy = lt.Strategy(checkpoint={"except_last": 1}, mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=37))
    data = packed_batch(stock.config.vocab_size) if batch == "packed" else padded_batch(
        stock.config.vocab_size, lengths=(100, 70), left=True)
    check_step(stock, ours, strategy, data, TOL, another_thread=True)
    assert (calls.kept, calls.plain) == (1, 1)
    adapter = applied_context(ours).adapter
    bottom, top = adapter.layers
    assert isinstance(bottom.forward, functools.partial) and not isinstance(top.forward, functools.partial)
    assert isinstance(adapter.mlp(bottom).forward, functools.partial)  # tiled
    assert not isinstance(adapter.mlp(top).forward, functools.partial)  # whole


def test_a_whole_layer_between_checkpointed_ones_keeps_the_chain_exact():
    """Three layers, the top two whole: the kept output of the bottom one is still
    prefetched and read in the right order, with a left-padded batch of two."""
    config = preset_config("tiny-llama")
    config.num_hidden_layers = 3
    stock, ours = stock_and_ours(config)
    strategy = lt.Strategy(checkpoint={"except_last": 2}, mst=lt.MsTOptions(loss_chunks=3))
    check_step(stock, ours, strategy, padded_batch(config.vocab_size, lengths=(90, 61), left=True), TOL,
               another_thread=True)


def test_leaving_more_layers_whole_than_the_model_has_is_refused():
    _, ours = stock_and_ours("tiny-llama")
    with pytest.raises(lt.LongtrainError, match=r"except_last=3 leaves more layers whole than the model has \(2\)"):
        lt.apply(ours, lt.Strategy.parse("checkpoint:except_last=3,mst"))


def test_a_layer_left_whole_under_seco_is_exact():
    """SeCO runs every chunk's layers under checkpointing: the layer left whole keeps its
    activations per chunk, and the gradients are still stock autograd's."""
    stock, ours = stock_and_ours("tiny-qwen2")
    strategy = lt.Strategy(engine="seco", engine_options={"chunk": 40}, checkpoint={"except_last": 1},
                           mst=lt.MsTOptions(loss_chunks=3))
    check_step(stock, ours, strategy, packed_batch(stock.config.vocab_size), TOL, another_thread=True)


# ---- offload_inputs: the checkpointed inputs in host memory too ----------------------------


class _StoreLog:
    """What the kept-attention store parks, fetches ahead and hands back, in order."""

    def __init__(self, monkeypatch):
        from longtrain.memory.chunk_store import ChunkStore

        self.events = []
        self.store = None  # the last store anything was put in
        put, get, prefetch = ChunkStore.put, ChunkStore.get, ChunkStore.prefetch

        def logged(kind, real):
            def call(store, key, *args, **kwargs):
                self.events.append((kind, key[1], key[0]))
                if kind == "put":
                    self.store = store
                return real(store, key, *args, **kwargs)
            return call

        monkeypatch.setattr(ChunkStore, "put", logged("put", put))
        monkeypatch.setattr(ChunkStore, "get", logged("get", get))
        monkeypatch.setattr(ChunkStore, "prefetch", logged("prefetch", prefetch))

    def of(self, what: str, kind: str | None = None):
        return [(k, layer) for k, w, layer in self.events if w == what and (kind is None or k == kind)]


@pytest.mark.parametrize("batch", ["packed", "left-padded"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2"])
def test_inputs_parked_in_host_memory_give_exact_gradients(preset, batch, monkeypatch):
    """Every checkpointed layer's input waits in host memory and comes back for its
    recomputation, the layer below's fetch started then; attention's output is kept too."""
    stock, ours = stock_and_ours(preset)
    calls, log = _KernelCalls(monkeypatch), _StoreLog(monkeypatch)
    strategy = lt.Strategy(checkpoint={"offload_inputs": True}, mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=37))
    data = packed_batch(stock.config.vocab_size) if batch == "packed" else padded_batch(
        stock.config.vocab_size, lengths=(100, 70), left=True)
    check_step(stock, ours, strategy, data, TOL, another_thread=True)
    assert (calls.kept, calls.plain) == (2, 0)
    bottom, top = [layer for _, layer in log.of("input", "put")]
    assert bottom < top
    # Backward recomputes the top layer first: its input is read, then the bottom one's fetched ahead.
    assert log.of("input", "get")[0] == ("get", top) and ("prefetch", bottom) in log.of("input")
    assert log.of("input").index(("prefetch", bottom)) < log.of("input").index(("get", bottom))


def test_inputs_come_first_in_the_host_budget(monkeypatch):
    """Room for both inputs and one attention output: the bottom layer, which would keep
    its output first, leaves room for the input above it, so exactly one output is kept;
    with room for one input only, the other input stays on the device. Exact either way."""
    config = preset_config("tiny-llama")
    tokens = 170
    item = 8  # float64
    hidden = tokens * config.hidden_size * item
    output = tokens * config.hidden_size * item + config.num_attention_heads * tokens * 8
    batch = padded_batch(config.vocab_size, lengths=(100, 70))  # 2 rows of 100 tokens, 170 real
    assert batch["input_ids"].numel() == 200
    hidden, output = hidden * 200 // tokens, output * 200 // tokens
    for budget, kept, parked in ((2 * hidden + output, 1, 2), (hidden + hidden // 2, 0, 1)):
        stock, ours = stock_and_ours("tiny-llama")
        calls, log = _KernelCalls(monkeypatch), _StoreLog(monkeypatch)
        strategy = lt.Strategy(checkpoint={"offload_inputs": True, "host_memory": budget})
        check_step(stock, ours, strategy, batch, TOL, another_thread=True)
        assert calls.kept == kept and len(log.of("input", "put")) == parked, (budget, calls.kept, log.events)


def test_parked_inputs_with_outputs_kept_on_the_device_and_a_layer_left_whole(monkeypatch):
    config = preset_config("tiny-llama")
    config.num_hidden_layers = 3
    stock, ours = stock_and_ours(config)
    log = _StoreLog(monkeypatch)
    strategy = lt.Strategy(checkpoint={"offload_inputs": True, "offload": False, "except_last": 1},
                           mst=lt.MsTOptions(loss_chunks=3))
    check_step(stock, ours, strategy, packed_batch(config.vocab_size), TOL, another_thread=True)
    assert len(log.of("input", "put")) == 2  # the layer left whole saves its activations itself


def test_parked_inputs_without_kept_attention_replay_it():
    stock, ours = stock_and_ours("tiny-qwen2")
    strategy = lt.Strategy(checkpoint={"offload_inputs": True, "keep_attention": False}, mst=True)
    check_step(stock, ours, strategy, padded_batch(stock.config.vocab_size, lengths=(90, 61), left=True), TOL,
               another_thread=True)


def test_a_second_forward_before_the_first_ones_backward_is_refused_in_one_line():
    """Parked inputs belong to one forward: a second forward drops the first one's, whose
    backward then stops with what to do instead of a bare KeyError."""
    _, ours = stock_and_ours("tiny-llama")
    model = lt.apply(ours, lt.Strategy(checkpoint={"offload_inputs": True}, mst=True))
    ids = torch.randint(0, ours.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    first = model(input_ids=ids, labels=ids).loss
    second = model(input_ids=ids, labels=ids).loss
    with pytest.raises(lt.LongtrainError, match="run each forward's backward before the next forward"):
        (first + second).backward()


def test_parking_inputs_under_a_chunked_engine_is_refused():
    _, ours = stock_and_ours("tiny-llama")
    with pytest.raises(lt.LongtrainError, match="offload_inputs.*seco engine parks its chunks itself"):
        lt.apply(ours, lt.Strategy(engine="seco", engine_options={"chunk": 64}, checkpoint={"offload_inputs": True}))


@pytest.mark.parametrize("preset,randomized", [("tiny-mamba", ("conv1d.bias", ".D")),
                                               ("tiny-mamba2", ("conv1d.bias", ".D", "mixer.norm.weight")),
                                               ("tiny-ssm", ())],
                         ids=["mamba", "mamba2", "ssm-resnet"])
def test_inputs_of_a_model_without_attention_parked_give_exact_gradients(float64_throughout, preset, randomized,
                                                                          monkeypatch):
    """Mamba, Mamba-2 and the SSM-ResNet (no attention call marks their steps): each
    checkpointed layer's input waits in host memory and comes back for its recomputation,
    the layer below's fetch started then; the next step's bottom layer drops the last
    step's entries."""
    reference = ssm(preset, 3, torch.float64, 0, randomized)
    ours = copy.deepcopy(reference)
    batch = padded(29, left=True)
    loss_ref, expected = ssm_stock(reference, batch)
    log = _StoreLog(monkeypatch)
    lt.apply(ours, lt.Strategy(checkpoint={"offload_inputs": True}, mst=lt.MsTOptions(loss_chunks=3)))
    with backward_on_another_thread():
        loss = lt.step(ours, batch)
    assert abs(float(loss) - float(loss_ref)) <= 1e-12 * abs(float(loss_ref))
    assert max_rel_error(grads(ours), expected) <= 1e-10
    layers = [layer for _, layer in log.of("input", "put")]
    assert len(layers) == 3 and layers == sorted(layers)
    assert [layer for _, layer in log.of("input", "get")] == layers[::-1]
    assert log.of("input").index(("prefetch", layers[0])) < log.of("input").index(("get", layers[0]))
    parked = log.store.host_bytes
    assert parked == sum(batch["input_ids"].numel() * reference.config.hidden_size * 8 for _ in layers)
    with backward_on_another_thread():
        lt.step(ours, batch)  # gradients accumulate: twice the stock ones
    assert max_rel_error(grads(ours), {name: 2 * g for name, g in expected.items()}) <= 1e-10
    assert log.store.host_bytes == parked and len(log.store) == 3
