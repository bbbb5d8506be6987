"""The fpdt engine (chunked attention with offload, FPDT on one device): the op it is built
on, a chunk store that keeps its accounts, device memory that stops growing, and clear
refusals. Its exactness against stock models is in test_exactness.py's table."""

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    STRATEGIES,
    AttentionKernelCalls,
    backward_on_another_thread,
    check_step,
    packed_batch,
    padded_batch,
    stock_and_ours,
)
from torch.utils._python_dispatch import TorchDispatchMode

import longtrain as lt
from longtrain.memory.chunk_store import ChunkStore
from longtrain.memory.tracker import MemoryTracker
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.ops.chunked_attention import attend_chunk, chunk_bounds
from longtrain.ops.masking import BlockPlanner, SequenceMask
from longtrain.plan.simulate import run_training_steps

TOL = 1e-10


def _fpdt(**options):
    return lt.Strategy(engine="fpdt", engine_options=options)


def test_recomputing_kv_parks_one_layer_of_kv_at_a_time():
    """Exact CPU measurement: the host peak without K/V recomputation exceeds the one
    with it by the K/V of all layers but one."""
    config = preset_config("tiny-llama")
    seq = 1024
    kv = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4 * seq

    def host_peak(recompute_kv):
        return _peaks(_fpdt(chunk=128, offload=True, recompute_kv=recompute_kv), seq)[1]

    assert host_peak(False) - host_peak(True) >= (config.num_hidden_layers - 1) * kv


def test_parking_kv_again_runs_no_output_projection():
    """Backward's K/V re-park (``recompute_kv``) stops at attention: per chunk and layer
    q/k/v run three times (forward, re-park, recompute) and o_proj twice; without the
    re-park both twice."""
    calls = {}

    def counting(model):
        for name, module in model.named_modules():
            if name.endswith(("self_attn.q_proj", "self_attn.o_proj")):
                module.register_forward_hook(lambda m, i, o, key=name.rsplit(".", 1)[1]: calls.update({key: calls.get(key, 0) + 1}))
        return model

    config = preset_config("tiny-llama", num_hidden_layers=2)
    for recompute_kv, expected in ((True, {"q_proj": 3 * 2 * 3, "o_proj": 2 * 2 * 3}), (False, {"q_proj": 2 * 2 * 3, "o_proj": 2 * 2 * 3})):
        calls.clear()
        model = counting(build_from_config(config, torch.float32))
        lt.apply(model, _fpdt(chunk=32, recompute_kv=recompute_kv))
        lt.step(model, {"input_ids": torch.randint(0, config.vocab_size, (1, 80))})  # 3 chunks, the last short
        assert calls == expected, (recompute_kv, calls)


@pytest.mark.parametrize("preset,passes", [("tiny-llama", 2), ("tiny-gemma2", 3)])
def test_the_recomputed_layer_does_not_compute_its_mlp_output(preset, passes):
    """FPDT recomputes a layer only to backpropagate through it: the tiled MLP runs
    forward in the forward pass and in its own backward, not for the recomputed output
    (tokens through down_proj per layer = 2 × tokens) — except where a later op saves
    that output (Gemma-2's post-feed-forward norm: 3 ×). Which it is, is learned at each
    layer's first recomputation (which computes the output): counted from the second step."""
    from longtrain.engines.fpdt.schedule import _UNREAD_MLP_OUTPUTS

    tokens = []
    config = preset_config(preset, num_hidden_layers=2)
    seq = 96  # whole chunks: a chunk no longer than a tile runs its MLP untiled
    model = build_from_config(config, torch.float32)
    for name, module in model.named_modules():
        if name.endswith("mlp.down_proj"):
            module.register_forward_hook(lambda m, i, o: tokens.append(i[0].numel() // i[0].shape[-1]))
    lt.apply(model, lt.Strategy(engine="fpdt", engine_options={"chunk": 32, "recompute_kv": False}, mst=lt.MsTOptions(mlp_chunk=16)))
    batch = {"input_ids": torch.randint(0, config.vocab_size, (1, seq))}
    lt.step(model, batch)
    assert sum(tokens) == (passes * seq + (32 if passes == 2 else 0)) * config.num_hidden_layers  # the first learns
    assert {_UNREAD_MLP_OUTPUTS._safe[layer] for layer in model.model.layers} == {passes == 2}
    tokens.clear()
    model.zero_grad()
    lt.step(model, batch)
    assert sum(tokens) == passes * seq * config.num_hidden_layers
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)


def test_a_norm_after_the_mlp_is_found_in_the_graph():
    """What the learning reads: a node between the layer's output and the MLP's that saves
    a tensor (a norm after the MLP) — not an add, nor a product with a number."""
    from longtrain.ops.unread_outputs import saved_between

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    mlp_out = x * 1.0
    plain = x + mlp_out * 0.5
    normed = x + torch.nn.functional.rms_norm(mlp_out, (8,), w)
    assert not saved_between(plain.grad_fn, {mlp_out.grad_fn})
    assert saved_between(normed.grad_fn, {mlp_out.grad_fn})
    assert not saved_between(normed.grad_fn, {normed.grad_fn})

    class KeepsInATuple(torch.autograd.Function):  # a custom op keeping its input as a ctx attribute
        @staticmethod
        def forward(ctx, t):
            ctx.kept = (t,)
            return t * 2.0

        @staticmethod
        def backward(ctx, grad):
            return grad * 2.0

    custom = x + KeepsInATuple.apply(mlp_out)
    assert saved_between(custom.grad_fn, {mlp_out.grad_fn})


def test_the_head_forms_its_logits_once_per_chunk_and_backpropagates_in_the_forward_pass():
    """The head's logits are computed once per chunk, training or not: its forward, which
    in training backpropagates at once (the chunked loss forms its gradients with the
    logits), and not again in the layers' backward."""
    logits = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("mm", "addmm") and out.shape[-1] == config.vocab_size:
                logits.append(out.shape[0])
            return out

    config = preset_config("tiny-llama", num_hidden_layers=2)
    model = build_from_config(config, torch.float32)
    lt.apply(model, lt.Strategy(engine="fpdt", engine_options={"chunk": 32, "offload": True}, mst=lt.MsTOptions(loss_chunks=1)))
    batch = {"input_ids": torch.randint(0, config.vocab_size, (2, 80))}
    with Count():
        loss = lt.step(model, batch)
    assert len(logits) == 3 and sum(logits) == 2 * 80  # 3 chunks of 2 rows, 80 tokens each row
    logits.clear()
    with torch.no_grad(), Count():
        assert torch.equal(lt.step(model, batch), loss)
    assert len(logits) == 3


def test_sliding_window_spanning_many_chunks_equals_stock():
    # A 64-token window over 16-token chunks puts whole chunks outside it (never fetched).
    config = preset_config("tiny-mistral")
    config.sliding_window = 64
    stock, ours = stock_and_ours(config)
    check_step(stock, ours, _fpdt(chunk=16, offload=True), padded_batch(320, lengths=(150, 131)))


@pytest.mark.parametrize("preset,batch", [("tiny-llama", "packed"), ("tiny-gemma2", "padded")])
def test_inputs_parked_with_kv_on_the_device_equals_stock(preset, batch):
    """``offload_inputs`` alone: layer inputs, output gradients, rotary tables and one
    layer's kept attention outputs in host memory, K/V and their gradient sums on the
    device (the planner's ``:offload_inputs`` candidates); float64, GQA, chunks of 40
    dividing no row."""
    stock, ours = stock_and_ours(preset)
    vocab = stock.config.vocab_size
    data = packed_batch(vocab) if batch == "packed" else padded_batch(vocab, lengths=(101, 77))
    check_step(stock, ours, _fpdt(chunk=40, offload_inputs=True, keep_output=1), data)


class _DictHistory:
    """A plain in-memory K/V history, to test the op without the store."""

    def __init__(self, kv, index):
        self.kv, self.index = kv, index
        self.grads = {}

    def blocks(self, backward=False):
        for j in range(self.index):
            yield j, *self.kv[j]

    def add_grad(self, j, dk, dv):
        old = self.grads.get(j)
        self.grads[j] = (dk, dv) if old is None else (old[0] + dk, old[1] + dv)

    def take_grad(self):
        return self.grads.pop(self.index, None)


@pytest.mark.parametrize("tile", [None, "5", "5, no cuts"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("padding", ["left", "right", "packed+right", "window"])
def test_attend_chunk_in_reverse_order_gives_exact_gradients(kv_heads, padding, tile, monkeypatch):
    """Masked blocks as one block or (``tile``: tiles of 5 tokens in 12-token chunks, as
    8K chunks run in 1,024-token tiles; cut where documents and padding start, or not)
    tile by tile: exact either way."""
    if tile is not None:
        monkeypatch.setattr("longtrain.ops.masking.TILE", 5)
        monkeypatch.setattr("longtrain.ops.masking.TILE_CUTS", 0 if "no cuts" in tile else 8)
    g = torch.Generator().manual_seed(kv_heads)
    b, h, s, d, chunk = 2, 4, 53, 8, 12
    q = torch.randn(b, h, s, d, dtype=torch.float64, generator=g)
    k = torch.randn(b, kv_heads, s, d, dtype=torch.float64, generator=g)
    v = torch.randn(b, kv_heads, s, d, dtype=torch.float64, generator=g)
    valid = torch.ones(b, s, dtype=torch.bool)
    segments, window = None, None
    if "right" in padding:
        valid[1, 40:] = False
    elif padding == "left":
        valid[1, :30] = False  # padded rows see no key at all: output 0
    if "packed" in padding:
        segments = torch.zeros(b, s, dtype=torch.long)
        segments[0, 17:] = 1
        segments[1, 26:] = 1
    if padding == "window":
        window = 7
    dout = torch.randn(b, h, s, d, dtype=torch.float64, generator=g)
    # Reference: SDPA over the whole sequence, padded keys masked.
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    pos = torch.arange(s)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed = allowed & (pos[None, :] > pos[:, None] - window)
    mask = allowed[None, None] & valid[:, None, None, :]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])[:, None]
    group = h // kv_heads
    ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(group, 1), vr.repeat_interleave(group, 1), attn_mask=mask)
    ref = ref.nan_to_num(0.0)  # rows with no visible key: 0
    ref.backward(dout)
    # Chunk by chunk in reverse, relaying K/V gradients through the history.
    bounds = chunk_bounds(s, chunk)
    planner = BlockPlanner(SequenceMask(segments, valid), bounds)
    kv = [(k[:, :, a:e], v[:, :, a:e]) for a, e in bounds]
    shared = _DictHistory(kv, 0)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i in reversed(range(len(bounds))):
        a, e = bounds[i]
        shared.index = i
        qi, ki, vi = (t[:, :, a:e].clone().requires_grad_() for t in (q, k, v))
        out = attend_chunk(qi, ki, vi, shared, planner=planner, index=i, window=window)
        torch.testing.assert_close(out, ref[:, :, a:e].detach(), rtol=0, atol=1e-12)
        out.backward(dout[:, :, a:e])
        dq[:, :, a:e], dk[:, :, a:e], dv[:, :, a:e] = qi.grad, ki.grad, vi.grad
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert float((got - want).norm() / want.norm()) <= TOL
    pairs = [(i, j) for i in range(len(bounds)) for j in range(i + 1)]
    tiled = [len(planner.tiles(i, j, window, q.device)) > 1 for i, j in pairs]
    assert any(tiled) == (tile is not None)


def test_chunk_store_parks_in_host_memory_and_brings_back():
    store = ChunkStore("cpu", offload=True, host_budget=3 * 4 * 100)
    x = torch.arange(100, dtype=torch.float32)
    with MemoryTracker() as tracker:
        store.put("a", x * 1)
        store.add_("a", x)  # accumulate: 2x
        store.prefetch("a")
        got = store.get("a")
        report = tracker.report()
    assert torch.equal(got, 2 * x)
    assert store.host_bytes == x.nbytes and report.peak_host_bytes >= x.nbytes
    store.put("b", x)
    store.put("c", x)
    with pytest.raises(lt.LongtrainError, match="host memory budget exceeded"):
        store.put("d", x)
    store.clear()
    assert store.host_bytes == 0 and len(store) == 0


class _FakeCuda:
    """Streams and events that log what they are asked (for the store's CUDA branch on a CPU)."""

    def __init__(self, monkeypatch):
        import contextlib

        self.log, self.current = [], None
        log = self.log

        class Event:
            def record(self, stream):
                self.on = stream
                log.append(("record", stream.name, self))

        class Stream:
            def __init__(self, name="side"):
                self.name = name

            def wait_stream(self, other):
                log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                log.append(("wait_event", self.name, event))

        self.main = Stream("main")

        @contextlib.contextmanager
        def stream(s):
            log.append(("enter", s.name))
            yield
            log.append(("exit", s.name))

        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.main)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, s: log.append(("record_stream", s.name)))


def test_a_released_host_buffer_is_reused_only_after_its_copies_from_and_to_the_device(monkeypatch):
    """On CUDA a parked chunk's host buffer is written by a copy on the to-host stream and
    read by copies on the to-device stream. A chunk parked and never fetched (the last
    chunk's K/V) is discarded while its write may be in flight: the buffer's release event
    must follow that write too, and the next user — another step's store on other
    streams — waits for it before writing (the streams are logged: no GPU needed)."""
    from longtrain.memory.chunk_store import PinnedPool

    cuda = _FakeCuda(monkeypatch)
    pool = PinnedPool(pin=False)

    def store(prefix):  # a store on "CUDA" with its two side streams
        made = ChunkStore("cpu", offload=True, pool=pool)
        made._cuda, made._to_host, made._to_device = True, torch.cuda.Stream(), torch.cuda.Stream()
        made._to_host.name, made._to_device.name = prefix + "to_host", prefix + "to_device"
        return made

    first = store("")
    first.put("kv", torch.ones(8))
    written = first._entries["kv"].written
    first.discard("kv")
    release = [e[2] for e in cuda.log if e[:2] == ("record", "to_device")][-1]
    assert cuda.log.index(("wait_event", "to_device", written)) < cuda.log.index(("record", "to_device", release))
    cuda.log.clear()
    second = store("next_")
    second.put("kv", torch.full((8,), 2.0))
    assert ("wait_event", "next_to_host", release) in cuda.log
    assert torch.equal(second._entries["kv"].host, torch.full((8,), 2.0))


def test_a_fetched_copy_is_allocated_on_the_compute_stream_after_its_queued_work(monkeypatch):
    """The caching allocator pools memory per stream: a copy that allocated its destination
    on the to-device stream gives that stream segments the compute stream cannot reuse (the
    likely cause of reserved 1.17-1.29x allocated with offload on the H100). The destination is allocated
    on the compute stream; the copy waits for the compute work queued so far (its previous
    user may still be reading it), and a prefetch discarded unread makes the compute stream
    wait for its copy (the memory is not reused mid-copy)."""
    from longtrain.memory.chunk_store import PinnedPool

    cuda = _FakeCuda(monkeypatch)
    store = ChunkStore("cpu", offload=True, pool=PinnedPool(pin=False))
    store._cuda, store._to_host, store._to_device = True, torch.cuda.Stream(), torch.cuda.Stream()
    store._to_host.name, store._to_device.name = "to_host", "to_device"
    store.put("kv", torch.arange(8.0))
    real_empty_like = torch.empty_like

    def empty_like(*args, **kwargs):
        cuda.log.append(("allocate", "current"))
        return real_empty_like(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", empty_like)
    cuda.log.clear()
    store.prefetch("kv")
    steps = [entry[:2] for entry in cuda.log]
    copy = steps.index(("enter", "to_device"))
    assert steps.index(("allocate", "current")) < copy
    assert ("wait_stream", "to_device") in steps[:copy] and cuda.log[steps.index(("wait_stream", "to_device"))][2] == "main"
    assert ("record_stream", "to_device") not in steps  # would hold it until later copies end too
    assert torch.equal(store.get("kv"), torch.arange(8.0))
    # Fetched and discarded unread: the compute stream waits for the copy before it may reuse the memory.
    store.put("next", torch.ones(8))
    store.prefetch("next")
    fetched = store._entries["next"].fetched
    cuda.log.clear()
    store.discard("next")
    assert ("wait_event", "main", fetched) in cuda.log


def test_host_budget_too_small_is_refused_before_the_step():
    model = build_from_config(preset_config("tiny-llama"), torch.float32)
    lt.apply(model, _fpdt(chunk=32, offload=True, host_memory="1KiB"))
    ids = torch.randint(0, 100, (1, 128))
    with pytest.raises(lt.LongtrainError, match="fpdt engine needs .* host memory for 128 tokens.*budget is 1.00 KiB"):
        lt.step(model, {"input_ids": ids})
    assert all(p.grad is None for p in model.parameters())


def test_bad_options_get_one_clear_line():
    with pytest.raises(lt.LongtrainError, match="fpdt chunk must be a positive integer"):
        lt.FPDTOptions(chunk=0)
    with pytest.raises(lt.LongtrainError, match="cannot read size"):
        lt.FPDTOptions(host_memory="lots")
    with pytest.raises(lt.LongtrainError, match="offload must be true or false, got 'no'"):
        lt.FPDTOptions(offload="no")  # a string is not quietly taken as true
    with pytest.raises(lt.LongtrainError, match="fpdt engine already recomputes every layer.*drop 'checkpoint'"):
        lt.Strategy(engine="fpdt", checkpoint=True)
    with pytest.raises(lt.LongtrainError, match="now the 'fpdt' engine: write --engine fpdt"):
        lt.Strategy.parse("mst,attention:chunk=64")
    with pytest.raises(lt.LongtrainError, match="ChunkedAttention is now longtrain.FPDTOptions"):
        lt.ChunkedAttention(chunk=64)


def test_chunked_engines_refuse_ssms_and_dropout():
    ssm = build_from_config(preset_config("tiny-ssm"), torch.float32)
    with pytest.raises(lt.LongtrainError, match="fpdt engine chunks attention; ssm_resnet models have none"):
        lt.apply(ssm, _fpdt())
    config = preset_config("tiny-llama")
    config.attention_dropout = 0.1
    with pytest.raises(lt.LongtrainError, match="apply no dropout to attention weights.*attention_dropout=0.1"):
        lt.apply(build_from_config(config, torch.float32), lt.Strategy(engine="seco"))


def _peaks(strategy, seq):
    report, _ = run_training_steps(
        lambda: build_from_config(preset_config("tiny-llama"), torch.float32),
        seq_len=seq, strategy=strategy, optimizer="none", iterations=1, fake=False,
    )
    return report.peak_device_bytes, report.peak_host_bytes


def test_offloaded_device_peak_stops_growing_with_the_sequence():
    """Exact CPU measurement: with K/V and layer inputs in host memory, quadrupling the
    sequence adds only its token ids, labels and positions to the device peak, while the
    host holds what grew; without offload the device holds it."""
    offload = _fpdt(chunk=128, offload=True)
    on_device = _fpdt(chunk=128)
    short, long = 512, 2048
    dev_short, host_short = _peaks(offload, short)
    dev_long, host_long = _peaks(offload, long)
    config = preset_config("tiny-llama")
    per_token_ids = 3 * 8 + 8  # int64 input ids, labels and shifted targets; position ids
    assert dev_long - dev_short <= (long - short) * per_token_ids
    layers, hidden = config.num_hidden_layers, config.hidden_size
    kv = 2 * config.num_key_value_heads * (hidden // config.num_attention_heads)
    head_dim = hidden // config.num_attention_heads
    # float32 inputs of every layer but the first (embeddings are recomputed) and the final
    # output, one layer's K/V (recompute_kv), the rotary tables
    parked_per_token = 4 * (kv + layers * hidden + 2 * head_dim)
    assert host_long - host_short >= (long - short) * parked_per_token
    dev_short_kept, _ = _peaks(on_device, short)
    dev_long_kept, _ = _peaks(on_device, long)
    assert dev_long_kept - dev_short_kept >= (long - short) * layers * hidden * 4


def test_simulated_strategy_reports_host_bytes():
    report = lt.simulate("tiny-llama", 1024, strategy=lt.Strategy(engine="fpdt", engine_options=lt.FPDTOptions(chunk=256, offload=True), mst=True),
                         dtype="float32", optimizer="none")
    assert report.peak.peak_host_bytes > 0
    assert report.strategy["engine"]["offload"] is True


def test_evaluation_outside_a_step_uses_plain_attention():
    stock, ours = stock_and_ours("tiny-qwen2")
    lt.apply(ours, _fpdt(chunk=16))
    batch = padded_batch(stock.config.vocab_size, lengths=(50, 41))
    with torch.no_grad():
        want = stock(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = ours(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-10)


def test_kept_attention_outputs_mean_attention_runs_forward_once():
    """fpdt:keep_output parks each chunk's attention output and LSE: the backward's
    recomputation hands them to attention's backward, so every attention block's forward
    kernel runs once per step instead of twice — and the gradients stay exact
    (tests/test_exactness.py runs 'fpdt+offload,output-kept+mst' on every family)."""
    batch = {"input_ids": torch.randint(3, 300, (2, 160), generator=torch.Generator().manual_seed(0))}
    counts = {}
    for keep in (False, True, 1):  # 1: the lowest of the 2 layers only
        model = build_from_config(preset_config("tiny-llama"))
        lt.apply(model, lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "keep_output": keep}))
        with AttentionKernelCalls() as kernels:
            lt.step(model, batch)
        counts[repr(keep)] = kernels.calls  # (not keep itself: 1 == True as a key)
    forward, backward = "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"
    every, none, lowest = counts["True"], counts["False"], counts["1"]
    assert every[backward] == none[backward] == lowest[backward] == every[forward]
    assert none[forward] == 2 * every[forward]
    assert 2 * lowest[forward] == 3 * every[forward]  # the upper layer attends again


def test_keep_output_fit_keeps_as_many_layers_outputs_as_the_host_budget_holds(monkeypatch):
    """``keep_output=fit``: the lowest layers whose attention outputs fit the host budget
    beside the parked inputs and K/V keep them, the others attend again; the step stays
    exact (float64, backward on another thread), its parked bytes within the budget, and a
    budget that does not hold even the inputs is refused in one line before any work."""
    from longtrain.engines.chunked import run as chunked

    resolved = []
    count = chunked.kept_output_layers

    def recording(context, shard, settings):
        resolved.append((count(context, shard, settings), context, shard, settings))
        return resolved[-1][0]

    monkeypatch.setattr(chunked, "kept_output_layers", recording)
    peaks = []  # each step's store at its fullest
    reserve = ChunkStore._reserve

    def reserving(self, nbytes, key):
        reserve(self, nbytes, key)
        if not peaks or self.host_bytes > peaks[-1][1]:
            peaks.append((self, self.host_bytes))

    monkeypatch.setattr(ChunkStore, "_reserve", reserving)
    config = preset_config("tiny-llama")
    config.num_hidden_layers = 4
    batch = padded_batch(config.vocab_size, lengths=(101, 77))

    def fpdt(**options):
        return lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "offload": True, "keep_output": "fit", **options})

    # Unbounded on the CPU (nothing is pinned there): every layer keeps its output.
    lt.step(lt.apply(build_from_config(config), fpdt()), batch)
    kept, context, shard, settings = resolved[-1]
    assert kept == 4
    parked = chunked.host_bytes_needed(context, shard, settings, torch.float64, kept_outputs=0)
    per_layer = chunked.host_bytes_needed(context, shard, settings, torch.float64, kept_outputs=1) - parked
    budget = parked + 5 * per_layer // 2

    stock, ours = stock_and_ours(config)
    check_step(stock, ours, fpdt(host_memory=budget), batch, another_thread=True)
    kept, context, shard, settings = resolved[-1]
    # What the check counts bounds what the store parks (its own budget would stop the step midway).
    assert kept == 2 and peaks[-1][1] <= chunked.host_bytes_needed(context, shard, settings, torch.float64) <= budget
    assert count(context, shard, dataclasses.replace(settings, offload_inputs=False)) == 0  # inputs on the device: none
    with pytest.raises(lt.LongtrainError, match="needs .* of host memory .* the host budget is"):
        lt.step(lt.apply(build_from_config(config, torch.float64), fpdt(host_memory=parked - 1)), batch)


@pytest.mark.parametrize("engine,options", [("fpdt", dict(keep_output=True)), ("fpdt", dict(segment=2)), ("seco", {})])
def test_every_parked_tensor_a_step_reads_was_prefetched(engine, options, monkeypatch):
    """Layer inputs, rotary tables, final outputs, output gradients, kept attention outputs
    and LSEs, K/V gradient sums: each is on its way back to the device before it is read. A
    fetch started only when a tensor is read puts the copy on the critical path on a GPU
    (on the CPU copies are synchronous, so only this bookkeeping shows it)."""
    from longtrain.memory.chunk_store import ChunkStore

    late = []
    get = ChunkStore.get

    def watching(self, key):
        entry = self._entries.get(key)
        if entry is not None and entry.host is not None and entry.device is None:
            late.append(key)
        return get(self, key)

    monkeypatch.setattr(ChunkStore, "get", watching)
    config = preset_config("tiny-llama")
    config.num_hidden_layers = 3
    model = build_from_config(config)
    lt.apply(model, lt.Strategy(engine=engine, engine_options=dict(chunk=40, offload=True, **options)))
    lt.step(model, {"input_ids": torch.randint(3, 300, (2, 150), generator=torch.Generator().manual_seed(0))})
    assert late == []


@pytest.mark.parametrize("layers,segment", [(5, 2), (5, 3), (6, 2)])
def test_segments_park_fewer_inputs_and_stay_exact(layers, segment):
    """``segment=k`` parks every k-th layer's input (segments that do not divide the layer
    count included) and recomputes the rest in backward: stock gradients in float64, and
    the host holds the parked inputs of the segment starts only."""
    config = preset_config("tiny-llama")
    config.num_hidden_layers = layers
    stock, ours = stock_and_ours(config)
    strategy = lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "offload": True, "segment": segment})
    check_step(stock, ours, strategy, padded_batch(config.vocab_size, lengths=(101, 77)), another_thread=True)

    def host_peak(options):
        report, _ = run_training_steps(lambda: build_from_config(config, torch.float32), seq_len=160,
                                       strategy=lt.Strategy(engine="fpdt", engine_options=options), optimizer="none",
                                       iterations=1)
        return report.peak_host_bytes

    every = host_peak({"chunk": 40, "offload": True})
    fewer = host_peak({"chunk": 40, "offload": True, "segment": segment})
    input_bytes = 160 * config.hidden_size * 4
    # Parked: the segment starts but layer 0 (embeddings are recomputed), and in backward one segment's inner inputs.
    parked = -(-layers // segment) - 1 + segment - 1
    assert fewer <= every - (layers - 1 - parked) * input_bytes < every


def test_segment_refuses_options_that_park_per_layer():
    with pytest.raises(lt.LongtrainError, match="segment"):
        lt.FPDTOptions(chunk=64, segment=2, keep_output=True)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Ops that make the host wait for the GPU: scalar reads (``.item()``, ``bool()``,
    ``int()`` of a tensor), data-dependent shapes, and host data turned into a tensor
    (``torch.tensor``/``as_tensor``: on a GPU a copy from pageable memory, which PyTorch
    synchronizes — the chunked head's loss normalizer did so once per chunk)."""

    NAMES = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique2",
             "lift_fresh", "lift_fresh_copy")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in self.NAMES
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep_output", [False, True])
def test_the_chunk_loop_never_reads_the_device(keep_output):
    """Host reads happen once per step (the label count, the mask summary), never per
    chunk or layer: 4× the chunks, the same count."""
    config = preset_config("tiny-llama")
    counts = []
    for chunk in (48, 12):
        model = lt.apply(build_from_config(config, torch.float32).train(),
                         lt.Strategy(engine="fpdt", engine_options={"chunk": chunk, "offload": True,
                                                                    "keep_output": keep_output}, mst=True))
        batch = padded_batch(config.vocab_size, lengths=(96, 80))
        with _HostReads() as reads:
            lt.step(model, batch)
        counts.append(reads.count)
    assert counts[0] == counts[1] <= 3, counts


@pytest.mark.parametrize("engine", ["fpdt", "seco"])
def test_packed_documents_in_large_chunks_run_in_tiles_and_stay_exact(engine, monkeypatch):
    """Chunks that straddle document boundaries are masked blocks; longer than TILE tokens
    (here 16 in 40-token chunks, as 1,024 in 8K chunks) they run tile by tile — stock
    gradients in float64 with backward on another thread, offloaded K/V and padding."""

    monkeypatch.setattr("longtrain.ops.masking.TILE", 16)
    config = preset_config("tiny-qwen2")
    stock, ours = stock_and_ours(config)
    strategy = lt.Strategy(engine=engine, engine_options={"chunk": 40, "offload": True})
    check_step(stock, ours, strategy, packed_batch(config.vocab_size), another_thread=True)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_host_reads_per_step_do_not_grow_with_the_layers(strategy):
    """A device value read by the host is a synchronization on a GPU: every engine and
    technique reads a fixed few per step (the label count, the mask's documents or block
    summary), never one per layer — 2 and 5 layers read the same, on a packed batch. (On
    the CPU the count also holds reads of host-side tensors — SpaCO's draws, the documents'
    host copy — which are no synchronization; only its growth is asserted.)"""
    counts = []
    for layers in (2, 5):
        config = preset_config("tiny-llama")
        config.num_hidden_layers = layers
        model = lt.apply(build_from_config(config, torch.float32).train(), STRATEGIES[strategy]())
        batch = packed_batch(config.vocab_size)
        lt.step(model, batch)  # one-time work (Memo's plan) stays out of the count
        with _HostReads() as reads:
            lt.step(model, batch)
        counts.append(reads.count)
    assert counts[0] == counts[1], counts


def _bf16_gradients(strategy, batch, reference, threads=False):
    """Every parameter's gradient of one step of ``strategy`` (None: plain backprop) on a
    bf16 copy of ``reference``."""
    model = copy.deepcopy(reference).to(torch.bfloat16)
    if strategy is not None:
        lt.apply(model, strategy)
    with backward_on_another_thread() if threads else contextlib.nullcontext():
        lt.step(model, batch)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def bf16_case():
    """Tiny-Llama (2 layers) in float64, 1,024 tokens, and its float64 gradients."""
    config = preset_config("tiny-llama", num_hidden_layers=2)
    torch.manual_seed(0)
    exact = build_from_config(config, torch.float64)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(0))}
    model = copy.deepcopy(exact)
    lt.step(model, batch)
    return exact, batch, {name: p.grad for name, p in model.named_parameters()}


def _errors(grads, exact):
    """Each weight matrix's error relative to its norm, and the norm weights' together
    (vectors of 64: one at a time their errors are too few numbers to compare)."""
    def rel(names):
        return float(torch.cat([(grads[n].double() - exact[n]).flatten() for n in names]).norm()
                     / torch.cat([exact[n].flatten() for n in names]).norm())
    errors = {n: rel([n]) for n, g in grads.items() if g.dim() > 1}
    errors["norms"] = rel([n for n, g in grads.items() if g.dim() == 1])
    return errors


def test_bf16_gradients_are_summed_over_chunks_in_float32_whatever_the_chunk_count(bf16_case):
    """FPDT backpropagates each layer once per chunk; a bf16 layer's (and the head's)
    gradients are summed over the chunks in float32 and rounded once, so in 64 chunks
    every gradient is as close to float64 as stock bf16 backprop's (one GEMM over every
    token, one rounding). Summed in bf16 by autograd (``float32_grad_sum=false``), the
    LM head's error was 2.2x stock's, ``down_proj``'s 1.6x, ``o_proj``'s up to 1.6x."""
    exact, batch, reference = bf16_case
    stock = _errors(_bf16_gradients(None, batch, exact), reference)
    summed = _errors(_bf16_gradients(_fpdt(chunk=16), batch, exact, threads=True), reference)
    ratios = {n: summed[n] / stock[n] for n in stock}
    assert max(ratios.values()) < 1.2, ratios
    autograd = _errors(_bf16_gradients(_fpdt(chunk=16, float32_grad_sum=False), batch, exact), reference)
    assert autograd["lm_head.weight"] > 1.8 * stock["lm_head.weight"]  # what the float32 sum removes


def test_summed_gradients_add_to_what_earlier_micro_batches_left(bf16_case):
    """A second micro-batch's float32 sum is added to ``.grad`` before the one rounding:
    the same batch twice gives exactly twice the first gradient (the sum rounds to the
    first's bf16 value within half a unit, and twice that is representable)."""
    exact, batch, _ = bf16_case
    model = copy.deepcopy(exact).to(torch.bfloat16)
    lt.apply(model, _fpdt(chunk=64, offload=True))
    lt.step(model, batch)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    lt.step(model, batch)
    for n, p in model.named_parameters():
        if "embed" not in n:  # the embeddings' gradient is autograd's sum (it does not grow with the chunks)
            assert torch.equal(p.grad, 2 * first[n]), n


def test_seco_sums_in_float32_when_asked(bf16_case):
    exact, batch, reference = bf16_case
    stock = _errors(_bf16_gradients(None, batch, exact), reference)
    seco = lt.Strategy(engine="seco", engine_options={"chunk": 16, "float32_grad_sum": True})
    summed = _errors(_bf16_gradients(seco, batch, exact), reference)
    assert max(summed[n] / stock[n] for n in stock) < 1.2


def test_float32_sum_leaves_other_parameters_and_dtypes_to_autograd():
    from longtrain.engines.gradient_sum import Float32GradientSum

    half, full = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16), requires_grad=False)
    half.grad = torch.full((3,), 256.0, dtype=torch.bfloat16)
    with Float32GradientSum([half, full, frozen, half]) as sums:
        assert sums.params == [half] and half.grad is None
        for _ in range(4):  # 256 + 4 x 1 is 260 in float32; bf16 (8 bits) would stay at 256 after every add
            (half.sum() + full.sum()).backward()
            sums.collect()
        assert half.grad is None and torch.equal(full.grad, torch.full((3,), 4.0))
    assert torch.equal(half.grad, torch.full((3,), 260.0, dtype=torch.bfloat16))
    with Float32GradientSum([half], enabled=False) as sums:
        assert sums.params == [] and half.grad is not None


@pytest.mark.parametrize("engine,options", [
    ("fpdt", {}), ("fpdt", {"keep_output": True}), ("fpdt", {"keep_output": 2, "prefetch": 2}), ("fpdt", {"segment": 2}),
    ("fpdt", {"recompute_kv": False}), ("fpdt", {"offload_inputs": False}), ("seco", {}), ("spaco", {"budget": 2}),
])
def test_the_host_budget_check_bounds_what_the_store_parks(engine, options, monkeypatch):
    """The refusal before a step counts at least what the step's store parks at its fullest
    (K/V-gradient sums included: one layer's in FPDT, every layer's in the chunk-major
    engines): a budget the check lets through is never exceeded midway, where the store's own
    check would end the step after its forward."""
    from longtrain.engines.chunked import run as chunked

    counted, peak = [], [0]
    needed, reserve = chunked.host_bytes_needed, ChunkStore._reserve

    def counting(*args, **kwargs):
        counted.append(needed(*args, **kwargs))
        return counted[-1]

    def reserving(self, nbytes, key):
        reserve(self, nbytes, key)
        peak[0] = max(peak[0], self.host_bytes)

    monkeypatch.setattr(chunked, "host_bytes_needed", counting)
    monkeypatch.setattr(ChunkStore, "_reserve", reserving)
    config = preset_config("tiny-llama")
    config.num_hidden_layers = 4
    model = build_from_config(config, torch.float64)
    lt.apply(model, lt.Strategy(engine=engine, engine_options={"chunk": 40, "offload": True, "host_memory": "1GiB", **options}))
    lt.step(model, packed_batch(config.vocab_size))
    assert 0 < peak[0] <= counted[-1]


@pytest.mark.parametrize("preset,options", [
    ("tiny-llama", {"offload": True}), ("tiny-llama", {"offload_inputs": True}),
    ("tiny-llama", {"offload": True, "keep_output": 1, "prefetch": 2}), ("tiny-llama", {"offload": True, "recompute_kv": False}),
    ("tiny-llama", {"offload": True, "segment": 2}), ("tiny-llama", {"offload": True, "prefetch": 0}),
    ("tiny-phi3", {"offload": True}),  # rotary over half of each head (partial_rotary_factor 0.5)
])
def test_host_traffic_is_what_a_step_copies(preset, options, monkeypatch):
    """``fpdt.host_traffic`` (the time model's FPDT copies) counts exactly the bytes a step
    parks and fetches, K/V apart from the rest: here 3 layers, chunks of 40 that do not
    divide 150 tokens, batch 2. With the inputs alone parked no K/V move at all."""
    from longtrain.engines.fpdt import host_traffic

    moved = {"kv": 0, "inputs": 0}
    put, prefetch = ChunkStore.put, ChunkStore.prefetch

    def kind(key):
        return "kv" if key[0] in ("k", "v", "dk", "dv") else "inputs"

    def counting_put(self, key, tensor, *, offload=None):
        if self.offload if offload is None else offload:
            moved[kind(key)] += tensor.nbytes
        put(self, key, tensor, offload=offload)

    def counting_prefetch(self, key):
        entry = self._entries.get(key)
        if entry is not None and entry.host is not None and entry.device is None:
            moved[kind(key)] += entry.host.nbytes
        prefetch(self, key)

    monkeypatch.setattr(ChunkStore, "put", counting_put)
    monkeypatch.setattr(ChunkStore, "prefetch", counting_prefetch)
    config = preset_config(preset, num_hidden_layers=3, **({"partial_rotary_factor": 0.5} if preset == "tiny-phi3" else {}))
    model = build_from_config(config, torch.float32)
    strategy = lt.Strategy(engine="fpdt", engine_options={"chunk": 40, **options}, mst=True)
    lt.apply(model, strategy)
    lt.step(model, {"input_ids": torch.randint(0, config.vocab_size, (2, 150))})
    settings = strategy.engine_options.settings()
    traffic = host_traffic(config, 2, 150, 4, settings, kept_outputs=int(settings.keep_output))
    assert (traffic.kv, traffic.inputs) == (moved["kv"], moved["inputs"])
    assert moved["inputs"] > 0 and (moved["kv"] > 0) == settings.offload


@pytest.mark.parametrize("family", ["olmo2", "glm4", "exaone4"])
@pytest.mark.parametrize("strategy", ["fpdt:chunk=24,mst", "fpdt:chunk=24:offload:keep_output=1,mst"])
def test_a_norm_after_the_mlp_keeps_fpdt_with_mst_exact(family, strategy):
    """Post-norm families (``residual + norm(mlp(x))``): the norm saves the MLP's output, so
    FPDT's recomputation computes it (a placeholder would be read: NaN gradients). Three
    layers, a right-padded batch of 101 and 77 tokens."""
    from longtrain.families import float64_throughout, tiny_config

    config = tiny_config(family)
    config.num_hidden_layers = 3
    if getattr(config, "layer_types", None):
        config.layer_types = (list(config.layer_types) * 3)[:3]
    stock, ours = stock_and_ours(config)
    with float64_throughout():
        check_step(stock, ours, strategy, padded_batch(config.vocab_size, lengths=(101, 77)))
    assert all(p.grad.isfinite().all() for p in ours.parameters() if p.grad is not None)
