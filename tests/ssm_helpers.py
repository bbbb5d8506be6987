"""What the Mamba and Mamba-2 tests share: the tiny models with random biases, the padded
batch, the stock step, the adjoint step with its counters, and the comparisons with stock
under a strategy and with LoRA (their float64 patch is conftest's ``float64_throughout``)."""

from __future__ import annotations

import copy

import torch
from conftest import grads, max_rel_error, randomize_lora, third_padded_batch

import longtrain as lt
from longtrain.engines.adjoint import AdjointStats, adjoint_step
from longtrain.models.loading import add_lora, build_from_config
from longtrain.models.presets import preset_config
from longtrain.strategy import engine_context

VOCAB = 64


def ssm(preset: str, layers: int, dtype, seed: int, randomized: tuple[str, ...], **overrides):
    """The tiny ``preset`` with the parameters ending in ``randomized`` drawn at random
    (biases, D, norm weights start at constants that would hide their gradients' errors)."""
    config = preset_config(preset, **{"vocab_size": VOCAB, "num_hidden_layers": layers, **overrides})
    torch.manual_seed(seed)
    model = build_from_config(config, dtype).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(randomized):
                p.normal_(std=0.5)
    return model


def padded(length: int, left: bool = False, seed: int = 1):
    return third_padded_batch(VOCAB, length, left, seed)


def stock(model, batch):
    """Stock forward + autograd: the model's own loss and gradients."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    out.loss.backward()
    return out.loss.detach(), grads(model)


def rel(x, y) -> float:
    return float(abs(x - y) / abs(y))


def adjoint_grads(model, batch, **options):
    stats = AdjointStats()
    loss = adjoint_step(engine_context(model, lt.Strategy(engine="adjoint", engine_options=options)), batch, stats=stats)
    return loss, grads(model), stats


def split(length: int, size: int) -> list[int]:
    """``length`` tokens in pieces of ``size``, the last one shorter."""
    return [min(size, length - start) for start in range(0, length, size)]


def check_exact_adjoint(reference, length: int, left: bool, chunk: int | None = None, **options) -> None:
    """The adjoint engine with ``options`` on a copy of ``reference``, batch 2 padded to
    ``length``: the stock loss to 1e-12, every gradient to 1e-10, every (t, i) term and
    token VJP counted, the scan in chunks of ``chunk`` tokens (at least the convolution's
    window; None: whole) taken from the last, each in blocks of ``options["block"]``."""
    layers = reference.config.num_hidden_layers
    ours = copy.deepcopy(reference)
    batch = padded(length, left=left)
    loss_ref, expected = stock(reference, batch)
    loss, got, stats = adjoint_grads(ours, batch, chunk=chunk, **options)
    assert rel(loss, loss_ref) <= 1e-12
    assert got.keys() == expected.keys()
    assert max_rel_error(got, expected) <= 1e-10
    assert stats.adjoint_terms == layers * length * (length + 1) // 2 and stats.token_vjps == layers * length
    assert stats.vjp_calls > layers  # several blocks per layer
    chunks = split(length, max(chunk, reference.config.conv_kernel - 1)) if chunk else [length]
    assert stats.chunk_tokens == chunks[::-1] * layers
    if options.get("block"):
        assert stats.block_tokens == [b for c in chunks[::-1] for b in split(c, options["block"])] * layers


def check_equals_stock(reference, batch, strategy: lt.Strategy) -> None:
    """``strategy`` on a copy of ``reference``: the stock loss to 1e-12, every gradient to 1e-10."""
    ours = copy.deepcopy(reference)
    loss_ref, expected = stock(reference, batch)
    lt.apply(ours, strategy)
    assert rel(lt.step(ours, batch), loss_ref) <= 1e-12
    assert max_rel_error(grads(ours), expected) <= 1e-10


def check_lora_equals_stock(model, batch, strategy: str, unadapted: tuple[str, ...]) -> None:
    """LoRA (rank 4, random B so A's gradients count) on ``model`` under ``strategy``
    ("adjoint" or a technique list) against stock autograd; no adapters on ``unadapted``."""
    reference = add_lora(model, rank=4)
    randomize_lora(reference)
    assert not any(f"{name}.lora" in p for p, _ in reference.named_parameters() for name in unadapted)
    ours = copy.deepcopy(reference)
    loss_ref, expected = stock(reference, batch)
    engine = lt.Strategy(engine="adjoint", engine_options={"block": 5}) if strategy == "adjoint" else lt.Strategy.parse(strategy)
    lt.apply(ours, engine)
    assert rel(lt.step(ours, batch), loss_ref) <= 1e-12
    got = grads(ours)
    assert any("in_proj.lora_A" in name for name in got)
    assert max_rel_error(got, expected) <= 1e-10
