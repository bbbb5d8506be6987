"""Shared helpers: tiny Hugging Face models built from configs, the batches every exactness
test uses (padding, labels on padding, packed documents), and the conditions the
comparisons run under (float64 everywhere, backward on another thread as on CUDA)."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import tempfile
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import longtrain as lt
from longtrain.models.attention import stock_attention
from longtrain.models.loading import build_from_config, default_dtype
from longtrain.models.presets import preset_config

ARCHITECTURES = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2"]

# `longtrain calibrate` stores rates per machine; tests never read or write the user's.
os.environ["LONGTRAIN_CACHE"] = tempfile.mkdtemp(prefix="longtrain-test-cache-")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one thread each (the tiny models gain
    # nothing from more, and two threads per worker oversubscribe the cores). The processes
    # tests start (benchmark smoke runs, torchrun ranks, the command line) inherit one
    # thread too: with two OpenMP threads each beside a busy worker, their spinning threads
    # made a 15-second smoke run take nearly three minutes.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the CUDA tier runs where one is present (python benchmarks/gpu_suite.py)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def stock_and_ours(preset, dtype=torch.float64, seed: int = 0):
    """The stock Hugging Face model and longtrain's build of the same config, holding
    identical weights. Stock attention is SDPA, or eager for models with attention logit
    soft-capping (Gemma-2), as Hugging Face recommends for training them, and for models
    without an SDPA path (gpt-oss). ``preset`` is a
    preset name or a config."""
    config = preset_config(preset) if isinstance(preset, str) else copy.deepcopy(preset)
    config.use_cache = False  # with a cache, stock transformers ignores packed position ids
    attention = stock_attention(config)
    with default_dtype(dtype):
        torch.manual_seed(seed)
        stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attention)
    ours = build_from_config(copy.deepcopy(config), dtype)
    ours.load_state_dict(stock.state_dict())
    return stock.train(), ours.train()


def randomize_lora(model, seed: int = 3) -> None:
    """LoRA's B starts at zero, which would hide errors in A's gradient: make it random."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def stock_lora_and_ours(preset: str, rank: int = 4, head: bool = False):
    """LoRA-wrapped stock model and ours with identical weights and random adapters;
    ``head``: the LM head gets adapters too."""
    from longtrain.models.loading import add_lora

    stock, ours = stock_and_ours(preset)
    if head:
        from peft import LoraConfig, get_peft_model

        def wrap(model):
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0)
            return get_peft_model(model, config)
    else:
        def wrap(model):
            return add_lora(model, rank=rank)
    stock, ours = wrap(stock), wrap(ours)
    randomize_lora(stock)
    ours.load_state_dict(stock.state_dict())
    return stock, ours


def third_padded_batch(vocab: int, length: int, left: bool = False, seed: int = 1) -> dict:
    """Batch 2: row 0 full, row 1 padded by a third (right or left), no labels on padding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, length), generator=generator)
    mask = torch.ones_like(ids)
    pad = length // 3
    if left:
        mask[1, :pad] = 0
    else:
        mask[1, length - pad:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def stock_loss(model, batch) -> torch.Tensor:
    """Plain PyTorch: the stock model's logits (its own masks, position ids, soft-caps and
    logit scales) and F.cross_entropy in the logits' dtype (the Hugging Face loss would
    round float64 through float32)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                   position_ids=batch.get("position_ids"), use_cache=False).logits
    labels = batch.get("labels", batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def padded_batch(vocab: int, lengths=(37, 29), seed: int = 1, left: bool = False, labels_on_pads: bool = False) -> dict:
    """Batch of len(lengths) rows padded to the longest (at the end, or at the front with
    ``left``); padding has attention 0 and label -100, unless ``labels_on_pads``."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if left:
            mask[row, width - n:] = 1
        else:
            mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.clone() if labels_on_pads else ids.masked_fill(mask == 0, -100)
    if left and not labels_on_pads:
        # The first real token of a left-padded row would be predicted by a padding
        # position that sees no key at all: longtrain gives such a row 0 (as SDPA does),
        # stock Gemma-2's eager attention an average over the masked keys. No loss there.
        labels[torch.arange(len(lengths)), width - torch.tensor(lengths)] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(vocab: int, documents=((40, 35, 26), (101,)), seed: int = 2) -> dict:
    """Rows of packed documents: position ids restart at each document, whose first token
    has no label (nothing in its document predicts it)."""
    g = torch.Generator().manual_seed(seed)
    width = sum(documents[0])
    assert all(sum(row) == width for row in documents)
    ids = torch.randint(3, vocab, (len(documents), width), generator=g)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    return {"input_ids": ids, "labels": ids.masked_fill(positions == 0, -100), "position_ids": positions}


BATCHES = {
    "right-padded": lambda vocab: padded_batch(vocab, lengths=(100, 77)),
    "labels-on-pads": lambda vocab: padded_batch(vocab, lengths=(100, 77), labels_on_pads=True),
    # Padding stays shorter than tiny-gemma2's 64-token window: a query whose window is
    # all padding gets 0 from longtrain and NaN from stock Gemma-2's eager attention.
    "left-padded": lambda vocab: padded_batch(vocab, lengths=(100, 70), left=True),
    "packed": lambda vocab: packed_batch(vocab),
}


# Chunks of 23 and 40 tokens divide none of the lengths (101, 100, 77, 70; documents of
# 40, 35 and 26 tokens); MsT's 37-token MLP chunks leave remainders too.
STRATEGIES = {
    "backprop": lambda: lt.Strategy(),
    "checkpoint": lambda: lt.Strategy(checkpoint=True),
    "mst": lambda: lt.Strategy(mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=37)),
    "checkpoint+mst": lambda: lt.Strategy(checkpoint=True, mst=lt.MsTOptions(loss_chunks=3)),
    "fpdt": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 23}),
    "fpdt+offload+mst": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "offload": True, "prefetch": 2},
                                            mst=lt.MsTOptions(loss_chunks=3)),
    "fpdt+offload,kv-kept": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "offload": True, "recompute_kv": False}),
    # Attention outputs kept per chunk in the lowest layer (keep_output=1 of the 2): its
    # recomputation never attends again, the layer above's does.
    "fpdt+offload,output-kept+mst": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "offload": True,
                                                                                       "keep_output": 1},
                                                        mst=lt.MsTOptions(loss_chunks=3)),
    # Segments of two layers: only layer 0's input (its embeddings) parked; backward recomputes layer 1's.
    "fpdt+segment+offload": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "offload": True, "segment": 2}),
    "seco": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 23}),
    "seco+offload+checkpoint+mst": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 40, "offload": True, "prefetch": 2},
                                                       checkpoint=True, mst=lt.MsTOptions(loss_chunks=3)),
    "seco+checkpoint": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 23}, checkpoint=True),
    # Memo: 30% of the tokens swapped (layer 0 to host; the last layer keeps them on the device).
    "memo+mst": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=0.3, keep_last=1), mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=37)),
    # SpaCO with a budget of at least the chunk count backpropagates every chunk: exact.
    "spaco(every chunk)": lambda: lt.Strategy(engine="spaco", engine_options={"chunk": 40, "budget": 8}),
}


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, "gradient sets differ"
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-300)) for k in a)


@pytest.fixture(params=ARCHITECTURES)
def architecture(request):
    return request.param


@contextlib.contextmanager
def backward_on_another_thread():
    """Run every ``torch.autograd.backward`` (``Tensor.backward`` included) on a fresh
    thread, as CUDA's autograd runs backward — and checkpoint recomputation — on its
    device thread: state kept per thread (thread-locals, context variables) by the
    forward is invisible there."""
    original = torch.autograd.backward

    def on_another_thread(*args, **kwargs):
        outcome = {}

        def run():
            try:
                original(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                outcome["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]

    torch.autograd.backward = on_another_thread
    try:
        yield
    finally:
        torch.autograd.backward = original


@contextlib.contextmanager
def llama_norm_in_float64():
    """Llama's RMSNorm computes in float32 even for float64 inputs. Identical inputs round
    identically, so comparisons with the stock model are unaffected; but a check that
    *combines* several runs (SpaCO's expectation over chunk selections) sees float32
    rounding (~1e-7) unless the norm computes in the input's precision, as here."""
    from unittest import mock

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    original = LlamaRMSNorm.forward

    def forward(self, x):
        if x.dtype != torch.float64:
            return original(self, x)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    with mock.patch.object(LlamaRMSNorm, "forward", forward):
        yield


@contextlib.contextmanager
def computes_in_float64():
    """Gemma-2's RMSNorm, Cohere's LayerNorm and eager softmax compute in float32
    whatever the input dtype (Cohere's norm weight too). Where a float64 check changes
    the order of a reduction (chunking the sequence), that float32 rounding (~1e-7)
    would hide the method's own error, so within this block they compute in float64 for
    float64 inputs — for the stock model and ours alike."""
    from unittest import mock

    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    softmax = F.softmax

    def softmax_in_input_precision(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype)

    def gemma_norm(self, x):
        if x.dtype != torch.float64:
            return gemma_original(self, x)
        return self._norm(x) * (1.0 + self.weight)

    def cohere_norm(self, x):
        if x.dtype != torch.float64:
            return cohere_original(self, x)
        centered = x - x.mean(-1, keepdim=True)
        return self.weight * centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    gemma_original, cohere_original = Gemma2RMSNorm.forward, CohereLayerNorm.forward
    with mock.patch.object(F, "softmax", softmax_in_input_precision), \
            mock.patch.object(Gemma2RMSNorm, "forward", gemma_norm), mock.patch.object(CohereLayerNorm, "forward", cohere_norm):
        yield


gemma2_computes_in_float64 = computes_in_float64  # the name older tests use


def check_step(stock, ours, strategy, batch, tol: float = 1e-10, another_thread: bool = False,
               seed: int | None = None, reference=None):
    """Apply ``strategy`` to ``ours`` (a no-op where it is applied already), step once on
    ``batch`` and require the stock model's loss and every gradient, in float64, within
    ``tol`` (relative). ``seed``: both steps start from it (models that draw dropout).
    ``reference(stock, batch)``: stock's loss (default :func:`stock_loss`)."""
    with computes_in_float64():
        if seed is not None:
            torch.manual_seed(seed)
        ref = (reference or stock_loss)(stock, batch)
        ref.backward()
        lt.apply(ours, strategy)
        if seed is not None:
            torch.manual_seed(seed)
        with backward_on_another_thread() if another_thread else contextlib.nullcontext():
            loss = lt.step(ours, batch)
    ref = ref.detach()
    assert abs(float(loss) - float(ref)) <= tol * abs(float(ref)), (float(loss), float(ref))
    error = max_rel_error(grads(ours), grads(stock))
    assert error <= tol, error
    return error


class AttentionKernelCalls(TorchDispatchMode):
    """Counts the attention kernels (forward and backward) a block of code runs."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "attention" in name:
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def cli(*argv) -> tuple[int, str, str]:
    """``longtrain ARGV`` in this process: exit code, stdout, stderr."""
    from longtrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def float64_throughout():
    """The torch paths' float32 casts (norms, softmaxes, routers, Mamba's scan) keep float64
    tensors float64, for the stock model and longtrain alike: otherwise no two computations
    could agree to 1e-10."""
    from longtrain import families

    with families.float64_throughout():
        yield
