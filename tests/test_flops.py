import torch

import longtrain as lt
from longtrain.models.adapters import describe_model
from longtrain.models.flops import causal_lm_flops, count_flops, matmul_parameters, mfu, model_flops_per_sample
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config


def test_formula():
    # 6·s·P + 6·n·h·s²
    assert causal_lm_flops(1000, 10, 2, 8) == 6 * 1000 * 10 + 6 * 2 * 8 * 1000**2


def test_matmul_flops_match_the_counter():
    """FlopCounterMode's count of a training step is 6·s·P for the matmuls plus PyTorch's
    own formula for the flash-attention kernels (longtrain registers it for the CPU
    kernel, halved for causal calls); some transformers versions build rotary angles with
    a tiny matmul (a few thousand FLOPs)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    model = build_from_config(preset_config("tiny-llama"))
    s, batch = 256, 2
    flops, _ = count_flops(lambda: lt.step(model, {"input_ids": torch.randint(0, 300, (batch, s))}))
    config = model.config
    shape = (batch, config.num_attention_heads, s, config.hidden_size // config.num_attention_heads)
    attention = config.num_hidden_layers * (sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)) // 2
    expected = 6 * s * batch * matmul_parameters(model) + attention
    assert 0 <= flops - expected <= 1e-4 * expected


def test_tied_head_counts_once_and_gemma_attention_width():
    gemma = build_from_config(preset_config("tiny-gemma2"))
    matrices = sum(p.numel() for p in gemma.parameters() if p.dim() == 2)
    assert matmul_parameters(gemma) == matrices  # the tied head is the embedding, counted as a matmul
    assert describe_model(preset_config("gemma2-9b")).attention_width == 16 * 256  # not the hidden size 3584
    assert model_flops_per_sample(gemma, 10) > 0


def test_mfu():
    assert mfu(1e12, 1.0, 2e12) == 0.5
    assert mfu(1e12, 1.0, None) is None
