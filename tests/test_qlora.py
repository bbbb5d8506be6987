"""QLoRA: LoRA adapters over a base quantized to 4 bits by bitsandbytes (NF4, what
``BitsAndBytesConfig(load_in_4bit=True)`` loads) train under every engine and technique as
the same quantized model trains stock. bitsandbytes computes in float32 at best, so the
comparison is to float32 rounding (relative 1e-5), not float64's 1e-10: one step's LoRA
gradients and loss against stock autograd, on padded rows, in chunks that do not divide
them; and one LongtrainTrainer step against the stock Trainer's."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import padded_batch, stock_and_ours
from test_hf import Batches, training_args

import longtrain as lt
from longtrain.models.presets import preset_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed (pip install bitsandbytes)")

VOCAB = 320
STRATEGIES = [None, "checkpoint", "mst", "checkpoint,mst", "fpdt:chunk=16", "fpdt:chunk=16:offload=true,mst",
              "seco:chunk=16", "memo,mst"]


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """A function building the quantized tiny Llama with seeded LoRA adapters, in train mode
    (bitsandbytes repacks a CPU layer's weights for inference on a call in eval mode without
    gradients, after which the layer passes no gradient back)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = preset_config("tiny-llama")
    config.intermediate_size = 192  # bitsandbytes' CPU kernels want output features in multiples of 32
    stock, _ = stock_and_ours(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("base")
    stock.save_pretrained(folder)
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    adapters = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def build():
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantized, dtype=torch.float32)
        torch.manual_seed(0)
        model = get_peft_model(model, adapters)
        for name, p in model.named_parameters():  # B = 0 would leave A without gradient: both random
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        return model.train()

    return build


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def stock_step(load):
    model = load()
    batch = padded_batch(VOCAB, lengths=(40, 29))
    loss = model(**batch).loss
    loss.backward()
    return batch, float(loss), grads(model)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s or "backprop")
def test_a_4bit_base_trains_as_the_same_quantized_model_stock(strategy, load, stock_step):
    batch, stock_loss, expected = stock_step
    model = load()
    lt.apply(model, lt.Strategy.parse(strategy))
    loss = float(lt.step(model, batch))
    got = grads(model)
    assert abs(loss - stock_loss) <= 1e-6 * abs(stock_loss)
    assert got.keys() == expected.keys() and len(got) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_qlora_trainer_step_equals_the_stock_trainers(load, tmp_path):
    """LongtrainTrainer with `checkpoint,mst` on the 4-bit model: each adapter's change over
    one SGD step of two accumulated micro-batches equals the stock Trainer's (SGD: AdamW's
    first step, g/(|g| + eps), would magnify float32 rounding where a gradient is near 0)."""
    from transformers import Trainer

    from longtrain.hf import LongtrainTrainer

    data = Batches([padded_batch(VOCAB, lengths=(40, 29), seed=3), padded_batch(VOCAB, lengths=(33, 21), seed=4)])
    changes = []
    for cls, extra in ((Trainer, {}), (LongtrainTrainer, {"strategy": "checkpoint,mst"})):
        model = load()
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        trainer = cls(model=model, args=training_args(tmp_path / cls.__name__), train_dataset=data,
                      data_collator=data.collate, **extra)
        trainer.train()
        changes.append({n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if p.requires_grad})
    stock, ours = changes
    for name, expected in stock.items():
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-7, msg=name)


def test_the_simulated_4bit_base_is_what_bitsandbytes_holds_and_computes(tmp_path):
    """`simulate --lora --4bit` against the exact CPU tracker of the same tiny Llama loaded in
    NF4 by bitsandbytes with LoRA adapters (checkpoint,mst): activations, temporaries (each
    layer's weight dequantized whole for its call), gradients, optimizer state and the
    packed weights equal to the byte. The simulator also counts the block scales bitsandbytes
    keeps beside each packed weight (a float32 per 64 values), which the tracker cannot see:
    they are no parameter, allocated as the model loads."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from longtrain.models.loading import add_lora, build_from_config
    from longtrain.plan.fake_model import build_fake_model, with_4bit_base
    from longtrain.plan.simulate import run_training_steps

    config = preset_config("tiny-llama", intermediate_size=192)
    build_from_config(config, torch.float32).save_pretrained(tmp_path)
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)

    def real():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantized, dtype=torch.float32)
        return add_lora(model, rank=4).train()

    settings = dict(seq_len=256, strategy="checkpoint,mst", dtype=torch.float32)
    measured, _ = run_training_steps(real, fake=False, **settings)
    simulated, represented = run_training_steps(lambda: build_fake_model(with_4bit_base(config), torch.float32, 4),
                                                **settings)
    linear_values = sum(m.in_features * m.out_features for m in build_from_config(config, torch.float32).modules()
                        if type(m) is torch.nn.Linear and m.out_features != config.vocab_size)
    for category in measured.by_category:
        scales = 4 * linear_values // 64 if category == "parameters" else 0
        assert simulated.device_bytes(category) == measured.device_bytes(category) + scales, category
    assert simulated.peak_device_bytes == measured.peak_device_bytes + 4 * linear_values // 64
    assert represented == sum(p.numel() for p in build_from_config(config, torch.float32).parameters()) + \
        sum(p.numel() for n, p in add_lora(build_from_config(config, torch.float32), rank=4).named_parameters()
            if "lora_" in n)
