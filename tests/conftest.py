"""Shared helpers: tiny Hugging Face models built from configs, and padded batches."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from longtrain.models.loading import build_from_config, default_dtype
from longtrain.models.presets import preset_config

ARCHITECTURES = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2"]


def stock_and_ours(preset: str, dtype=torch.float64, seed: int = 0):
    """The stock Hugging Face model and longtrain's build of the same config, holding
    identical weights. Stock attention is SDPA, or eager for models with attention logit
    soft-capping (Gemma-2), as Hugging Face recommends for training them."""
    config = preset_config(preset)
    attention = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    with default_dtype(dtype):
        torch.manual_seed(seed)
        stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attention)
    ours = build_from_config(copy.deepcopy(config), dtype)
    ours.load_state_dict(stock.state_dict())
    return stock.train(), ours.train()


def stock_lora_and_ours(preset: str, rank: int = 4):
    """LoRA-wrapped stock model and ours with identical weights; the adapters' B matrices
    are random (not zero), so adapter gradients flow through every path."""
    from longtrain.models.loading import add_lora

    stock, ours = stock_and_ours(preset)
    stock, ours = add_lora(stock, rank=rank), add_lora(ours, rank=rank)
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ours.load_state_dict(stock.state_dict())
    return stock, ours


def stock_loss(model, batch) -> torch.Tensor:
    """The stock model's token-mean next-token loss (plain autograd, full logits)."""
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)


def padded_batch(vocab: int, lengths=(37, 29), seed: int = 1) -> dict:
    """Batch of len(lengths) right-padded rows; padding has attention 0 and label -100."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, "gradient sets differ"
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-300)) for k in a)


@pytest.fixture(params=ARCHITECTURES)
def architecture(request):
    return request.param


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
def gemma2_computes_in_float64():
    """Gemma-2's RMSNorm and eager softmax compute in float32 whatever the input dtype.
    Where a float64 check changes the order of a reduction (chunking the sequence), that
    float32 rounding (~1e-7) would hide the method's own error, so within this block
    they compute in float64 for float64 inputs — for the stock model and ours alike."""
    from unittest import mock

    import torch.nn.functional as F
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    softmax = F.softmax

    def softmax_in_input_precision(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype)

    def norm_forward(self, x):
        if x.dtype != torch.float64:
            return norm_original(self, x)
        return self._norm(x) * (1.0 + self.weight)

    norm_original = Gemma2RMSNorm.forward
    with mock.patch.object(F, "softmax", softmax_in_input_precision), mock.patch.object(Gemma2RMSNorm, "forward", norm_forward):
        yield
