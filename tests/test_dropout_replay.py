"""Dropout under recomputation (LoRA's ``lora_dropout``): every engine and technique that
recomputes — a tile of the MLP, a checkpointed layer, a chunk of FPDT or SeCO, Memo's token
subset — draws the masks its forward drew. Proof: the gradient a step leaves is the
derivative of the loss it reports (a central finite difference of that loss along random
directions, the generator seeded the same way for every evaluation), in float64 on real
Hugging Face architectures; where the forward draws in stock's order, the loss and
gradients also equal stock autograd's with the same seed."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import (
    check_step,
    computes_in_float64,
    llama_norm_in_float64,
    packed_batch,
    padded_batch,
    randomize_lora,
    stock_and_ours,
)

import longtrain as lt
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config

P = 0.1  # lora_dropout of most published recipes is 0.05-0.1

RECOMPUTING = {
    "mst": lambda: lt.Strategy(mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=37)),
    "checkpoint": lambda: lt.Strategy(checkpoint=True),
    "checkpoint+mst": lambda: lt.Strategy(checkpoint=True, mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=37)),
    "memo(0.3)": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=0.3, keep_last=0)),
    "memo(0.6)+mst": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=0.6, keep_last=1), mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=37)),
    "memo(0)+mst": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=0.0, keep_last=0), mst=lt.MsTOptions(mlp_chunk=37)),
    "fpdt": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 23}),
    "fpdt+offload+mst": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "offload": True}, mst=lt.MsTOptions(loss_chunks=3)),
    "fpdt,output-kept+mst": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "offload": True, "keep_output": 1},
                                                mst=lt.MsTOptions(loss_chunks=3)),
    "fpdt,segment": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "offload": True, "segment": 2}),
    "fpdt,kv-kept": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40, "recompute_kv": False}),
    "seco": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 23}),
    "seco+checkpoint+mst": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 40, "offload": True},
                                               checkpoint=True, mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=29)),
    "spaco(every chunk)": lambda: lt.Strategy(engine="spaco", engine_options={"chunk": 40, "budget": 8}),
}
# Whose forward draws every mask as stock's does (the tiled MLP draws tile by tile: stock's
# order only where its MLP draws nothing, here LoRA on attention only).
STOCK_ORDER = {
    "backprop": lambda: lt.Strategy(),
    "checkpoint": RECOMPUTING["checkpoint"],
    "memo(1)": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=1.0, keep_last=0)),
    "mst(attention adapters)": RECOMPUTING["mst"],
    "checkpoint+mst(attention adapters)": RECOMPUTING["checkpoint+mst"],
}


def lora_with_dropout(model, targets="all-linear"):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=P, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def models(preset: str, targets="all-linear"):
    stock, ours = stock_and_ours(preset)
    stock, ours = lora_with_dropout(stock, targets), lora_with_dropout(ours, targets)
    randomize_lora(stock)
    ours.load_state_dict(stock.state_dict())
    return stock.train(), ours.train()


@contextlib.contextmanager
def in_float64():
    """Every norm and softmax in float64: a finite difference sees float32 rounding otherwise."""
    from unittest import mock

    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm

    def phi3_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    with computes_in_float64(), llama_norm_in_float64(), mock.patch.object(Phi3RMSNorm, "forward", phi3_norm):
        yield


def reported_loss(model, batch, seed: int) -> float:
    torch.manual_seed(seed)
    return float(lt.step(model, batch))


def check_directional_derivatives(model, batch, seed: int = 11, directions: int = 2, step: float = 2e-4) -> None:
    """⟨gradient, d⟩ against the derivative of the reported loss L along d (same seed): central
    differences (L(θ + hd) − L(θ − hd)) / 2h at h and h/2, Richardson-extrapolated (error O(h⁴))."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    loss = reported_loss(model, batch, seed)
    assert reported_loss(model, batch, seed + 1) != loss, "dropout should change the loss with the seed"
    model.zero_grad(set_to_none=True)
    reported_loss(model, batch, seed)
    gradient = [p.grad.detach().clone() for p in params]
    g = torch.Generator().manual_seed(5)

    def loss_at(direction, t: float) -> float:
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(d, alpha=t)
        try:
            return reported_loss(model, batch, seed)
        finally:
            with torch.no_grad():
                for p, d in zip(params, direction):
                    p.sub_(d, alpha=t)

    for _ in range(directions):
        direction = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
        norm = sum(float(d.square().sum()) for d in direction) ** 0.5
        direction = [d / norm for d in direction]
        along = sum(float((gr * d).sum()) for gr, d in zip(gradient, direction))
        central = [(loss_at(direction, h) - loss_at(direction, -h)) / (2 * h) for h in (step, step / 2)]
        difference = (4 * central[1] - central[0]) / 3
        assert abs(difference - along) <= 1e-6 * abs(along), (difference, along)


@pytest.mark.parametrize("strategy", list(RECOMPUTING))
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma2"])
def test_gradient_is_the_derivative_of_the_reported_loss(preset, strategy):
    _, ours = models(preset)
    batch = padded_batch(ours.config.vocab_size, lengths=(101, 80))
    lt.apply(ours, RECOMPUTING[strategy]())
    with in_float64():
        check_directional_derivatives(ours, batch)


@pytest.mark.parametrize("strategy", ["fpdt+offload+mst", "memo(0.6)+mst", "seco"])
def test_packed_documents_with_dropout(strategy):
    _, ours = models("tiny-llama")
    lt.apply(ours, RECOMPUTING[strategy]())
    with in_float64():
        check_directional_derivatives(ours, packed_batch(ours.config.vocab_size), directions=1)


@pytest.mark.parametrize("strategy", list(STOCK_ORDER))
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma2"])
def test_drawn_in_stock_order_equals_stock_autograd_with_the_same_seed(preset, strategy):
    attention_only = "attention adapters" in strategy
    stock, ours = models(preset, ["q_proj", "k_proj", "v_proj", "o_proj"] if attention_only else "all-linear")
    batch = padded_batch(stock.config.vocab_size, lengths=(101, 80))
    check_step(stock, ours, STOCK_ORDER[strategy](), batch, seed=7)


def test_a_recomputation_leaves_the_generators_where_the_step_left_them():
    """The step's draws are its forward's: the generators after a recomputing step are where
    they are after plain backprop's (the recomputations' draws are undone)."""
    states = []
    for strategy in (lt.Strategy(), RECOMPUTING["checkpoint+mst"](), RECOMPUTING["memo(0.3)"]()):
        _, ours = models("tiny-llama", ["q_proj", "v_proj"])
        lt.apply(ours, strategy)
        torch.manual_seed(3)
        lt.step(ours, padded_batch(ours.config.vocab_size, lengths=(101, 80)))
        states.append(torch.get_rng_state())
    assert all(torch.equal(states[0], s) for s in states[1:])


@pytest.mark.parametrize("strategy", ["mst", "checkpoint+mst", "memo(0.3)", "fpdt+offload+mst", "seco"])
def test_dropout_in_the_model_config_is_replayed(strategy):
    """Phi-3's residual dropout (resid_pdrop), full fine-tuning."""
    config = preset_config("tiny-phi3")
    config.resid_pdrop = 0.1
    _, ours = stock_and_ours(config)
    lt.apply(ours, RECOMPUTING[strategy]())
    with in_float64():
        check_directional_derivatives(ours, padded_batch(config.vocab_size, lengths=(101, 80)), directions=1)


def test_attention_dropout_and_dropout_under_the_adjoint_engine_are_refused_in_one_line():
    config = preset_config("tiny-llama")
    config.attention_dropout = 0.1
    with pytest.raises(lt.LongtrainError, match="attention_dropout=0.1; set it to 0") as error:
        lt.apply(stock_and_ours(config)[1], lt.Strategy(checkpoint=True))
    assert "\n" not in str(error.value)
    ssm = lora_with_dropout(build_from_config(preset_config("tiny-ssm")), ["input_proj", "out_proj"])
    with pytest.raises(lt.LongtrainError, match="adjoint engine .* dropout \\(p=0.1"):
        lt.apply(ssm, lt.Strategy(engine="adjoint"))


def test_the_command_line_trains_lora_with_dropout_under_recomputation(tmp_path):
    from longtrain.cli import main

    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    out = tmp_path / "run"
    code = main(["train", "--model", "tiny-llama", "--data", str(data), "--seq-len", "64", "--steps", "2", "--lora",
                 "--lora-dropout", "0.1", "--strategy", "checkpoint,mst:mlp_chunk=16", "--eval-samples", "1",
                 "--no-progress", "--out", str(out)])
    assert code == 0
    import json
    assert json.loads((out / "final" / "adapter" / "adapter_config.json").read_text())["lora_dropout"] == 0.1


@pytest.mark.parametrize("strategy", ["fpdt+offload+mst", "fpdt,output-kept+mst", "memo(0.6)+mst"])
def test_a_dropout_after_a_tiled_mlp_that_draws(strategy):
    """LoRA dropout inside the MLP and Phi-3's residual dropout after it: where FPDT's
    recomputation would leave the MLP's output unread, the MLP still runs (its draws
    come before the residual dropout's)."""
    config = preset_config("tiny-phi3")
    config.resid_pdrop = 0.1
    _, ours = stock_and_ours(config)
    ours = lora_with_dropout(ours)
    randomize_lora(ours)
    lt.apply(ours, lt.Strategy(engine=RECOMPUTING[strategy]().engine, engine_options=RECOMPUTING[strategy]().engine_options,
                               **{**RECOMPUTING[strategy]().techniques, "mst": lt.MsTOptions(loss_chunks=3, mlp_chunk=16)}))
    with in_float64():
        check_directional_derivatives(ours, padded_batch(config.vocab_size, lengths=(101, 80)), directions=1)
