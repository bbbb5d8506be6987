"""Shared helpers: tiny Hugging Face models built from configs, and padded batches."""

from __future__ import annotations

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
