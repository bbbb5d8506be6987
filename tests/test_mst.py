"""Mini-sequence MLP and LM-head loss (MsT): float64 proofs against stock autograd,
memory properties measured exactly, and the integration switch."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import check_step, grads, padded_batch, stock_and_ours, stock_lora_and_ours, stock_loss
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import longtrain as lt
from longtrain.errors import LongtrainError
from longtrain.memory import MemoryTracker
from longtrain.models.loading import build_from_config
from longtrain.ops.chunked_loss import chunked_causal_lm_loss
from longtrain.ops.tiled_mlp import outputs_unread, tiled_mlp

TOL = 1e-10
LENGTHS = [1, 63, 300, 1000]


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _mlps():
    gated = LlamaMLP(LlamaConfig(hidden_size=24, intermediate_size=80, hidden_act="silu", num_attention_heads=4, num_key_value_heads=4)).double()
    plain = torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.GELU(), torch.nn.Linear(64, 24)).double()
    # changes its first linear's output in place: the backward must not form that linear's
    # weight gradient from the recorded output (its gradient is no longer that tensor's)
    in_place = torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.ReLU(inplace=True), torch.nn.Linear(64, 24)).double()
    return {"gated": gated, "plain": plain, "in-place": in_place}


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("kind,linears", [("gated", False), ("gated", True), ("plain", False), ("plain", True),
                                          ("in-place", True)])
def test_tiled_mlp_is_exact(length, kind, linears):
    """Against stock autograd; ``linears``: the module is given, and its linears' weight
    (and bias) gradients are formed by the tiled backward itself, one GEMM per tile."""
    mlp = _mlps()[kind]
    x = torch.randn(2, length, 24, dtype=torch.float64, requires_grad=True)
    out = mlp(x)
    g = torch.randn_like(out)
    params = list(mlp.parameters())
    ref = torch.autograd.grad(out, [x, *params], g)
    # 2·1000 tokens: 32 chunks, remainder 16
    tiled = tiled_mlp(mlp, x, params, chunk_tokens=64, module=mlp if linears else None)
    got = torch.autograd.grad(tiled, [x, *params], g)
    assert rel(tiled, out) <= TOL
    assert max(rel(a, b) for a, b in zip(got, ref)) <= TOL


def test_tiled_linear_weight_gradients_are_one_gemm_per_tile_into_their_sum():
    """Given the module, each plain linear's weight gradient is one ``addmm_`` per tile into
    the running sum: no weight-sized product per tile for the loop to add (on CUDA a bf16
    weight's is one GEMM accumulating into float32; tests/test_cuda.py). Frozen weights
    (LoRA's base) are left alone; a linear whose output an in-place activation changed
    falls back to autograd's products, exactly."""
    torch.manual_seed(0)
    tiles, n = 5, 350  # 70-token tiles: no activation shares a weight's shape
    for kind, formed in (("gated", 3), ("plain", 2), ("in-place", 0)):
        mlp = _mlps()[kind]
        params = list(mlp.parameters())
        x = torch.randn(n, 24, dtype=torch.float64, requires_grad=True)
        out = tiled_mlp(mlp, x, params, chunk_tokens=n // tiles, module=mlp)
        with _MatmulFlops() as backward:
            out.backward(torch.ones_like(out))
        weights = {tuple(p.shape) for p in params if p.dim() == 2}
        summed = [m for m in backward.matmuls if m[0] == "addmm_" and m[2] in weights]
        products = [m for m in backward.matmuls if m[0] != "addmm_" and m[2] in weights]
        assert len(summed) == formed * tiles, (kind, backward.matmuls)
        assert len(products) == (sum(p.dim() == 2 for p in params) - formed) * tiles, kind
    # frozen: the first projection of the gated MLP keeps no gradient and is not formed
    mlp = _mlps()["gated"]
    mlp.gate_proj.weight.requires_grad_(False)
    params = [p for p in mlp.parameters() if p.requires_grad]
    x = torch.randn(n, 24, dtype=torch.float64, requires_grad=True)
    with _MatmulFlops() as counted:
        tiled_mlp(mlp, x, params, chunk_tokens=n // tiles, module=mlp).sum().backward()
    assert sum(m[0] == "addmm_" for m in counted.matmuls) == 2 * tiles
    assert mlp.gate_proj.weight.grad is None


class _Products(TorchDispatchMode):
    """(op, output shape, dtype) of every ``mm``/``addmm`` product (not the in-place sums)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm"):
            self.shapes.append((func.overloadpacket.__name__, tuple(out.shape), out.dtype))
        return out


class _GatedMLP(torch.nn.Module):
    def __init__(self, width, inner, dtype):
        super().__init__()
        self.gate_proj, self.up_proj = (torch.nn.Linear(width, inner, bias=False, dtype=dtype) for _ in range(2))
        self.down_proj = torch.nn.Linear(inner, width, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Unusual(torch.nn.Module):
    """Gated MLPs whose linears' recorded calls are not the whole story (review of the
    tiled backward's own weight gradients): each must fall back to autograd, exactly."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.gate_proj, self.up_proj = torch.nn.Linear(24, 40).double(), torch.nn.Linear(24, 40).double()
        self.down_proj = torch.nn.Linear(40, 24).double()
        if how == "hook replaces the output":
            self.up_proj.register_forward_hook(lambda m, args, out: out * 3)
        if how == "forward patched on the instance":
            plain = self.up_proj.forward
            self.up_proj.forward = lambda t: plain(t) * 0.5

    def forward(self, x):
        up = self.up_proj(input=x) if self.how == "called by keyword" else self.up_proj(x)
        gate = self.gate_proj(x)
        if self.how == "weight read outside its call":  # as PEFT's VeLoRA reads lora_A.weight
            gate = gate + F.linear(x, self.gate_proj.weight) * 0.1
        if self.how == "weight read without its call":
            gate = F.linear(x, self.gate_proj.weight)
        return self.down_proj(F.silu(gate) * up)


@pytest.mark.parametrize("how", ["hook replaces the output", "forward patched on the instance", "called by keyword",
                                 "weight read outside its call", "weight read without its call"])
def test_tiled_linears_whose_calls_are_not_the_whole_story_fall_back_exactly(how):
    torch.manual_seed(0)
    mlp = _Unusual(how)
    params = list(mlp.parameters())
    x = torch.randn(2, 150, 24, dtype=torch.float64, requires_grad=True)
    out = mlp(x)
    g = torch.randn_like(out)
    ref = torch.autograd.grad(out, [x, *params], g, allow_unused=True)
    tiled = tiled_mlp(mlp, x, params, chunk_tokens=64, module=mlp)
    got = torch.autograd.grad(tiled, [x, *params], g, allow_unused=True)
    assert rel(tiled, out) <= TOL
    for a, b in zip(got, ref):
        assert (a is None) == (b is None) and (b is None or rel(a, b) <= TOL), how


def test_the_tiled_backward_holds_one_tiles_intermediates_at_a_time():
    """Each tile's recomputed activations and output gradients are freed before the next
    tile recomputes its own: the backward's peak does not exceed the autograd path's."""
    torch.manual_seed(0)
    mlp = _GatedMLP(64, 704, torch.float32)
    params = list(mlp.parameters())
    x = torch.randn(6 * 97, 64, requires_grad=True)
    peaks = {}
    for module in (None, mlp):
        out = tiled_mlp(mlp, x, params, chunk_tokens=97, module=module)
        with MemoryTracker() as tracker:
            out.backward(torch.ones_like(out))
            peaks[module is not None] = tracker.peak_bytes
        x.grad = None
        mlp.zero_grad(set_to_none=True)
    tile_activation = 97 * 704 * 4
    assert peaks[True] <= peaks[False] + tile_activation // 2, (peaks, tile_activation)


def test_a_simulated_bf16_tiled_mlp_plans_the_gpus_gemm_not_weight_sized_products():
    """On fake tensors (a simulation plans the GPU) a bf16 tiled MLP's weight gradients
    are GEMMs into their float32 sums, which allocate nothing: no bf16 weight-sized product
    per tile, where the CPU forms one per tile and weight and adds it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for fake in (False, True):
        with FakeTensorMode() if fake else contextlib.nullcontext():
            mlp = _GatedMLP(32, 96, torch.bfloat16)  # (a module cannot change dtype under FakeTensorMode)
            params = list(mlp.parameters())
            x = torch.randn(4 * 64, 32, dtype=torch.bfloat16, requires_grad=True)
            out = tiled_mlp(mlp, x, params, chunk_tokens=64, module=mlp)
            with _Products() as products:
                out.backward(torch.ones_like(out))
        weight_sized = [p for p in products.shapes if p[1] in ((96, 32), (32, 96))]
        # the CPU: a bf16 product per tile and weight (4 x 3); a simulation: none (the real
        # tensors run all four tiles, fake ones three: tiles.py)
        assert len(weight_sized) == (0 if fake else 12), products.shapes


def test_tiled_mlp_saves_only_its_input_whatever_the_chunk_count():
    mlp = _mlps()["gated"]
    x = torch.randn(2, 512, 24, dtype=torch.float64, requires_grad=True)
    params = list(mlp.parameters())
    saved_bytes = {}
    for chunk in (512, 128, 32, 8):  # 2, 8, 32, 128 chunks
        total = [0]

        def pack(t):
            total[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            tiled_mlp(mlp, x, params, chunk_tokens=chunk)
        saved_bytes[chunk] = total[0]
    assert set(saved_bytes.values()) == {x.numel() * 8}


def _head_case(length, vocab=50, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, length, d, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (2, length), generator=g)
    labels[1, (2 * length) // 3 :] = -100  # row 1 is padded
    return hidden, weight, bias, labels


def _reference(hidden, weight, bias, labels, smoothing, softcap, normalizer, logit_scale=1.0):
    z = (hidden @ weight.t() + bias) * logit_scale
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    terms = F.cross_entropy(z[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, label_smoothing=smoothing, reduction="sum")
    return terms / normalizer


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("smoothing,softcap,logit_scale", [(0.0, None, 1.0), (0.1, None, 1.0), (0.0, 30.0, 1.0),
                                                            (0.1, 5.0, 0.25), (0.0, None, 1 / 8)])
def test_chunked_loss_is_exact(length, smoothing, softcap, logit_scale):
    hidden, weight, bias, labels = _head_case(length)
    normalizer = 7  # a caller-given count (accumulation, sequence parallelism)
    ref = _reference(hidden, weight, bias, labels, smoothing, softcap, normalizer, logit_scale)
    got = chunked_causal_lm_loss(hidden, weight, labels, bias=bias, num_label_tokens=normalizer, chunks=7,
                                 label_smoothing=smoothing, softcap=softcap, logit_scale=logit_scale)
    assert abs(float(got - ref)) <= TOL * max(1.0, abs(float(ref)))
    if length > 1:
        expected = torch.autograd.grad(ref, (hidden, weight, bias))
        actual = torch.autograd.grad(got, (hidden, weight, bias))
        assert max(rel(a, b) for a, b in zip(actual, expected)) <= TOL


def test_a_carry_sums_the_head_gradients_over_calls_and_hands_them_over_once():
    """FPDT's head runs once per chunk of the sequence: with one GradientCarry the weight's
    and bias's gradients stay in the op's buffer until the last call, which hands their
    sum to autograd — the whole sequence's gradients, in one .grad assignment."""
    from longtrain.ops.chunked_loss import GradientCarry
    from longtrain.ops.loss import shift_labels

    hidden, weight, bias, labels = _head_case(61)
    ref = _reference(hidden, weight, bias, labels, 0.0, None, 7)
    expected = torch.autograd.grad(ref, (hidden, weight, bias))
    targets, carry = shift_labels(labels), GradientCarry()
    pieces = [(0, 23), (23, 46), (46, 61)]
    for n, (a, b) in enumerate(pieces):
        carry.last = n == len(pieces) - 1
        loss = chunked_causal_lm_loss(hidden[:, a:b], weight, targets[:, a:b], bias=bias, num_label_tokens=7, shifted=True,
                                      chunks=2, carry=carry)
        loss.backward()
        assert (weight.grad is None and bias.grad is None) == (not carry.last)
    assert carry.weight is None and carry.bias is None  # the last call handed the buffers over
    assert max(rel(a, b) for a, b in zip((hidden.grad, weight.grad, bias.grad), expected)) <= TOL


def test_chunked_loss_reductions_and_frozen_head():
    hidden, weight, bias, labels = _head_case(300)
    n_valid = int((labels[:, 1:] != -100).sum())
    total = chunked_causal_lm_loss(hidden, weight, labels, bias=bias, reduction="sum")
    mean = chunked_causal_lm_loss(hidden, weight, labels, bias=bias, reduction="mean", chunk_tokens=64)
    assert abs(float(total / n_valid - mean)) <= 1e-12
    frozen = weight.detach()  # a frozen head: no weight gradient is computed or stored
    loss = chunked_causal_lm_loss(hidden, frozen, labels)
    loss.backward()
    assert hidden.grad is not None and frozen.grad is None


def test_lm_head_peak_falls_with_the_chunk_count():
    """Exact CPU measurement: the head+loss step's peak over its fixed part falls about
    as 1/M (the logits term)."""
    n, d, vocab = 4096, 32, 2048
    x = torch.randn(1, n, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    labels = torch.randint(0, vocab, (1, n))
    logits_bytes = n * vocab * 4
    excess = {}
    for chunks in (1, 2, 4, 8, 16):
        x.grad = weight.grad = None
        with MemoryTracker() as tracker:
            chunked_causal_lm_loss(x, weight, labels, chunks=chunks).backward()
            peak = tracker.peak_bytes
        fixed = 2 * (x.numel() + weight.numel()) * 4  # gradients of x and weight
        excess[chunks] = (peak - fixed) / logits_bytes
    # A fixed number k of logits-sized chunk buffers is alive at once, so excess ≈ k/M.
    for m in (2, 4, 8, 16):
        assert 0.8 * excess[1] / m <= excess[m] <= 1.2 * excess[1] / m + 0.02, excess
    assert excess[1] <= 3.1  # at most ~3 full-logits-sized buffers without chunking


ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2", "tiny-qwen3", "tiny-phi3"]


# Padding stays shorter than tiny-gemma2's 64-token sliding window: a padded query whose
# window holds only padding makes the stock model itself produce NaN.
@pytest.mark.parametrize("lengths", [(63, 40), (300, 250), (1000, 950)])
@pytest.mark.parametrize("preset", ARCHS)
def test_mst_training_step_equals_stock(preset, lengths):
    stock, ours = stock_and_ours(preset)
    batch = padded_batch(stock.config.vocab_size, lengths=lengths)
    check_step(stock, ours, lt.Strategy(checkpoint=True, mst=lt.MsTOptions(mlp_chunk=48, loss_chunks=5)), batch, TOL)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])  # untied and tied heads
def test_mst_with_lora_equals_stock_lora(preset):
    stock, ours = stock_lora_and_ours(preset)
    batch = padded_batch(stock.config.vocab_size, lengths=(300, 211))
    check_step(stock, ours, lt.Strategy(mst=lt.MsTOptions(mlp_chunk=64, loss_chunks=3)), batch, TOL)


def _global_rel_error(got: dict, exact: dict) -> float:
    """‖got − exact‖ / ‖exact‖ over all gradients together (per-tensor maxima are
    dominated by tiny, noisy gradients in bf16)."""
    num = sum(float((got[k].double() - exact[k]).norm() ** 2) for k in exact)
    return (num / sum(float(exact[k].norm() ** 2) for k in exact)) ** 0.5


def test_mst_in_bf16_stays_within_bf16_tolerance():
    """The same weights in bf16, with and without MsT, against a float64 run: MsT's
    gradient error must be of stock bf16's order (~1e-2; a 5% error would be ~5e-2)."""
    exact, _ = stock_and_ours("tiny-llama", dtype=torch.float64)
    stock16 = copy.deepcopy(exact).to(torch.bfloat16)
    ours16 = build_from_config(copy.deepcopy(exact.config), torch.bfloat16)
    ours16.load_state_dict(stock16.state_dict())
    batch = padded_batch(exact.config.vocab_size, lengths=(300, 211))
    ref = stock_loss(exact, batch)
    ref.backward()
    lt.apply(ours16, lt.Strategy(mst=True))
    loss16 = lt.step(ours16, batch)
    stock_loss(stock16, batch).backward()
    assert abs(float(loss16) - float(ref)) <= 1e-2 * abs(float(ref))
    ours_err = _global_rel_error(grads(ours16), grads(exact))
    stock_err = _global_rel_error(grads(stock16), grads(exact))
    assert ours_err <= 1.5 * stock_err, (ours_err, stock_err)


@pytest.mark.parametrize("tiles,linears", [(4, False), (64, False), (256, False), (256, True)])
def test_tiled_bf16_weight_gradients_are_summed_in_float32_whatever_the_tile_count(tiles, linears):
    """Each tile's weight gradient of a bf16 MLP is summed in float32 and rounded once:
    the error against float64 stays stock bf16's (one GEMM, one rounding) at any tile
    count. Summed in bf16 it grew with the tiles: 1.4x stock's at 16 tiles, 2.1x at 64,
    3.7x at 256 (the long-context end: 64 tiles of Llama-3-8B's 4,096 tokens at 256K)."""
    torch.manual_seed(0)
    exact = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=224)).double()
    n = 16384
    x, grad_out = torch.randn(n, 64, dtype=torch.float64), torch.randn(n, 64, dtype=torch.float64)
    expected = torch.autograd.grad(exact(x), list(exact.parameters()), grad_out)
    half = copy.deepcopy(exact).bfloat16()
    params = list(half.parameters())
    stock = torch.autograd.grad(half(x.bfloat16()), params, grad_out.bfloat16())
    tiled = torch.autograd.grad(tiled_mlp(half.forward, x.bfloat16(), params, n // tiles, module=half if linears else None),
                                params, grad_out.bfloat16())
    assert all(g.dtype == torch.bfloat16 for g in tiled)
    for ours, theirs, want in zip(tiled, stock, expected):
        assert rel(ours.double(), want) <= 1.1 * rel(theirs.double(), want)


def test_unsupported_architecture_is_named():
    from transformers import AutoModelForCausalLM, GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(LongtrainError, match="does not support gpt2 models; supported model families: apertus, .*, llama"):
        lt.apply(model, lt.Strategy(mst=True))


def test_mst_options_are_validated():
    with pytest.raises(LongtrainError, match="mlp_chunk must be a positive integer"):
        lt.Strategy(mst={"mlp_chunk": 0})
    assert lt.Strategy.parse("checkpoint,mst") == lt.Strategy(checkpoint=True, mst=lt.MsTOptions())
    assert lt.Strategy.from_yaml(lt.Strategy(mst=lt.MsTOptions(loss_chunks=8)).to_yaml()).techniques["mst"].loss_chunks == 8


def test_mst_lowers_the_simulated_peak():
    plain = lt.simulate("llama3-8b", 32768, strategy="checkpoint", optimizer="none")
    mst = lt.simulate("llama3-8b", 32768, strategy="checkpoint,mst", optimizer="none")
    # Without the full logits (32768 × 128256, in bf16 and fp32, and their gradients)
    # and the MLP intermediates the peak drops by tens of gigabytes.
    assert plain.device_peak_bytes - mst.device_peak_bytes > 30 * 2**30


def test_tiled_mlp_recomputes_under_the_forward_autocast_state():
    """Under autocast, backward's recomputation must run in the precision the forward
    ran in, or the gradients belong to a different function."""
    mlp = _mlps()["gated"].float()
    seen = []

    def fn(chunk):
        seen.append(torch.is_autocast_enabled("cpu"))
        return mlp(chunk)

    x = torch.randn(2, 100, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiled_mlp(fn, x, list(mlp.parameters()), chunk_tokens=64)
    n_forward = len(seen)
    out.backward(torch.randn_like(out))  # outside autocast, as training loops do
    assert out.dtype == torch.bfloat16
    assert n_forward == 4 and len(seen) == 8 and all(seen)


@pytest.mark.parametrize("dtype,autocast", [(torch.float64, False), (torch.float64, True), (torch.float32, True)])
def test_an_unread_tiled_mlp_output_is_a_placeholder_with_the_same_gradients(dtype, autocast):
    """Under outputs_unread the output node computes nothing — a NaN placeholder of the
    output's shape and dtype (autocast's too) — and the gradients through it are those of
    the computed output."""
    mlp = _mlps()["gated"].to(dtype)
    x = torch.randn(2, 100, 24, dtype=dtype)
    grad_out = torch.randn(2, 100, 24, dtype=dtype)
    results = []
    for unread in (False, True):
        calls = []
        xi = x.clone().requires_grad_(True)
        mlp.zero_grad(set_to_none=True)
        context = outputs_unread() if unread else contextlib.nullcontext()
        with context, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = tiled_mlp(lambda t: calls.append(t.shape[0]) or mlp(t), xi, list(mlp.parameters()), chunk_tokens=64)
        forwards = sum(calls)
        out.backward(grad_out.to(out.dtype))
        results.append((out, xi.grad, [p.grad for p in mlp.parameters()], forwards, sum(calls) - forwards))
    (out, dx, dw, forward_tokens, _), (placeholder, dx_u, dw_u, unread_tokens, backward_tokens) = results
    assert placeholder.dtype == out.dtype and placeholder.shape == out.shape and placeholder.isnan().all()
    assert forward_tokens == 200 and unread_tokens == 0 and backward_tokens == 200
    assert torch.equal(dx, dx_u) and all(torch.equal(a, b) for a, b in zip(dw, dw_u))


# ---- speed: FLOPs and GEMMs counted on the CPU ----------------------------------------

class _MatmulFlops(TorchDispatchMode):
    """FLOPs of every op PyTorch has a formula for, and each matmul's operand dtypes.
    (FlopCounterMode's module tracking cannot follow modules called inside an autograd
    Function's forward, which the tiled MLP does.)"""

    def __init__(self):
        super().__init__()
        self.flops, self.matmuls = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        if func.overloadpacket.__name__ in ("mm", "addmm", "addmm_", "bmm"):
            self.matmuls.append((func.overloadpacket.__name__, tuple(a.dtype for a in args if isinstance(a, torch.Tensor)),
                                 tuple(out.shape)))
        return out


def test_tiled_mlp_backward_is_one_recomputed_forward_plus_the_backward():
    """FLOPs: the tiled MLP's forward equals the plain MLP's (F); its backward is F (the
    recomputation) + 2F (the backward proper), whatever the chunk count."""
    mlp = _mlps()["gated"]
    params = list(mlp.parameters())
    x = torch.randn(2, 300, 24, dtype=torch.float64, requires_grad=True)
    with _MatmulFlops() as plain_fwd:
        out = mlp(x)
    with _MatmulFlops() as plain_bwd:
        out.backward(torch.ones_like(out))
    assert plain_bwd.flops == 2 * plain_fwd.flops
    for chunk in (64, 100, 7):
        with _MatmulFlops() as fwd:
            out = tiled_mlp(mlp, x, params, chunk_tokens=chunk)
        with _MatmulFlops() as bwd:
            out.backward(torch.ones_like(out))
        assert fwd.flops == plain_fwd.flops
        assert bwd.flops == 3 * plain_fwd.flops, (chunk, bwd.flops / plain_fwd.flops)


def _mlp_passes(preset: str, strategy, length: int = 256) -> list[float]:
    """Per layer: tokens through the MLP's last projection in one step, over the length."""
    from longtrain.models.presets import preset_config
    from longtrain.strategy import applied_context

    config = preset_config(preset)
    config.use_cache = False
    torch.manual_seed(0)
    model = lt.apply(build_from_config(config, torch.float32).train(), strategy)
    adapter = applied_context(model).adapter
    tokens = [0] * len(adapter.layers)
    for i, layer in enumerate(adapter.layers):
        last = adapter.mlp(layer).down_proj

        def count(module, args, i=i):  # a pre-hook: counts the projection even when a recomputation stops inside it
            tokens[i] += args[0].numel() // args[0].shape[-1]

        last.register_forward_pre_hook(count)
    lt.step(model, {"input_ids": torch.randint(0, config.vocab_size, (1, length))})
    return [t / length for t in tokens]


def test_checkpointed_tiled_mlp_runs_no_third_forward():
    """checkpoint + mst on Llama: the layer's recomputation stops at the tiled MLP's saved
    input (nothing after the MLP saves a tensor), so the MLP runs forward twice per step —
    once in the forward, once in its own backward — not three times. Gemma-2's
    post-feed-forward norm saves the MLP's output, which the recomputation must produce:
    three there (documented in docs/speed.md)."""
    mst = lt.MsTOptions(mlp_chunk=64)
    assert _mlp_passes("tiny-llama", lt.Strategy(checkpoint=True, mst=mst)) == [2.0, 2.0]
    assert _mlp_passes("tiny-llama", lt.Strategy(mst=mst)) == [2.0, 2.0]
    assert _mlp_passes("tiny-gemma2", lt.Strategy(checkpoint=True, mst=mst)) == [3.0, 3.0]


def test_head_forms_logits_once_and_its_weight_gradient_is_one_input_dtype_gemm_per_chunk():
    """A bf16 head's step runs, per chunk, three bf16 GEMMs, all in forward (the logits, the
    input's gradient, the weight's gradient into the float32 buffer) and none in backward
    (it only scales the stored gradients): the logits are formed once, as Liger's fused loss
    does, where they were formed again in backward; and no float32 GEMM (the first GPU run
    found the weight gradient as float32 addmm_ calls at ~50 TFLOP/s). Evaluation (no_grad)
    runs the logits' GEMM only. Counted by dispatch and by torch.profiler; float64 stays one
    addmm_ per chunk."""
    from torch.profiler import ProfilerActivity, profile

    n, d, vocab, chunks = 1024, 32, 512, 8
    x = torch.randn(1, n, d, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, n))
    with _MatmulFlops() as forward:
        loss = chunked_causal_lm_loss(x, weight, labels, chunks=chunks)
    with _MatmulFlops() as backward:
        loss.backward()
    assert weight.grad.dtype == torch.bfloat16
    assert len(forward.matmuls) == 3 * chunks and backward.matmuls == []
    assert all(dtypes[-2:] == (torch.bfloat16, torch.bfloat16) for _, dtypes, _ in forward.matmuls), forward.matmuls
    assert sum(shape == (vocab, d) for _, _, shape in forward.matmuls) == chunks  # the weight gradient
    x.grad = weight.grad = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        chunked_causal_lm_loss(x, weight, labels, chunks=chunks).backward()
    names = [e.name for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::addmm_")]
    assert len(names) == 3 * chunks
    with torch.no_grad(), _MatmulFlops() as evaluation:
        chunked_causal_lm_loss(x, weight, labels, chunks=chunks)
    assert len(evaluation.matmuls) == chunks
    # float64: the weight gradient accumulates in place, one addmm_ per chunk
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    with _MatmulFlops() as counted:
        chunked_causal_lm_loss(x64, w64, labels, chunks=chunks).backward()
    assert [name for name, _, _ in counted.matmuls].count("addmm_") == chunks


def test_head_gradients_scale_with_the_incoming_gradient_and_survive_a_retained_graph():
    """Backward multiplies the gradients formed in forward by the loss's incoming gradient
    (a loss scaled for accumulation), into new tensors: a retained graph's second backward
    adds the same again."""
    hidden, weight, bias, labels = _head_case(300)
    ref = _reference(hidden, weight, bias, labels, 0.0, None, 7)
    got = chunked_causal_lm_loss(hidden, weight, labels, bias=bias, num_label_tokens=7, chunks=5)
    expected = torch.autograd.grad(ref * 0.25, (hidden, weight, bias))
    actual = torch.autograd.grad(got * 0.25, (hidden, weight, bias), retain_graph=True)
    assert max(rel(a, b) for a, b in zip(actual, expected)) <= TOL
    again = torch.autograd.grad(got * 0.25, (hidden, weight, bias))
    assert all(torch.equal(a, b) for a, b in zip(actual, again))


def test_a_simulated_bf16_head_plans_the_gpus_gemm_not_a_weight_sized_product(monkeypatch, recwarn):
    """On CUDA a half-precision head's weight gradient is one GEMM per chunk accumulating
    into the float32 buffer in place; the CPU forms the bf16 product (the weight's size, 1 GiB
    for Llama-3-8B) and adds it. A simulation plans a GPU: on fake tensors it takes the GEMM
    into the buffer, so no weight-sized bf16 product is formed — without running it: fake
    tensors in torch 2.11 (the GPU machines') fail that call, which warned and fell back to
    the CPU's product (emulated here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    addmm = torch.addmm

    def addmm_of_torch_2_11(*args, **kwargs):
        if kwargs.get("out_dtype") is not None and any(is_fake(t) for t in args):
            raise TypeError("unsupported operand type(s) for *: 'torch.dtype' and 'FakeTensor'")
        return addmm(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", addmm_of_torch_2_11)

    for fake in (False, True):
        with FakeTensorMode() if fake else contextlib.nullcontext():
            weight = torch.randn(512, 64, dtype=torch.bfloat16, requires_grad=True)
            hidden = torch.randn(1, 96, 64, dtype=torch.bfloat16, requires_grad=True)
            labels = torch.randint(0, 512, (1, 96))
            with _Products() as products:
                chunked_causal_lm_loss(hidden, weight, labels, chunks=3).backward()
        weight_sized = [p for p in products.shapes if p[1] == (512, 64)]
        # the CPU: three bf16 products added; a simulation: three GEMMs into the float32 buffer, which allocate nothing
        assert weight_sized == ([] if fake else [("mm", (512, 64), torch.bfloat16)] * 3)
    assert not [w for w in recwarn if "addmm" in str(w.message)]
