"""Model presets: published architectures as configs only (no weights).

Presets feed the simulator (full-scale memory without allocating anything) and let
``longtrain train`` build a randomly initialized model for experiments. The numbers
are those of the published ``config.json`` files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LongtrainError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["packaged_checkpoint", "preset_config", "preset_fields", "preset_names", "resolve_preset"]

# name -> (model_type, config fields)
_PRESETS: dict[str, tuple[str, dict]] = {
    "llama2-7b": ("llama", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)),
    "llama3-70b": ("llama", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen2-7b": ("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)),
    "mistral-7b": ("mistral", dict(  # Mistral-7B-v0.3
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False)),
    "gemma2-9b": ("gemma2", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma3-12b": ("gemma3_text", dict(  # five sliding layers (1,024 tokens) to one global, two rotary bases
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=1024, sliding_window_pattern=6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    # Mixtures of experts: every expert's weights are held, a token runs its active ones.
    "qwen3-30b-a3b": ("qwen3_moe", dict(  # 128 experts, 8 per token: 30.5B parameters, 3.3B active
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)),
    "mixtral-8x7b": ("mixtral", dict(  # 8 experts, 2 per token: 46.7B parameters, 12.9B active
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        tie_word_embeddings=False)),
    "gpt-oss-20b": ("gpt_oss", dict(  # 32 experts, 4 per token: 20.9B parameters, 3.6B active; a sink per head
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0})),
    # State-space models (Hugging Face Mamba, state-spaces/mamba-*-hf): attention-free.
    "mamba-130m": ("mamba", dict(
        vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24, conv_kernel=4, expand=2,
        time_step_rank=48, residual_in_fp32=True, tie_word_embeddings=True)),
    "mamba-1.4b": ("mamba", dict(
        vocab_size=50280, hidden_size=2048, state_size=16, num_hidden_layers=48, conv_kernel=4, expand=2,
        time_step_rank=128, residual_in_fp32=True, tie_word_embeddings=True)),
    "mamba-2.8b": ("mamba", dict(
        vocab_size=50280, hidden_size=2560, state_size=16, num_hidden_layers=64, conv_kernel=4, expand=2,
        time_step_rank=160, residual_in_fp32=True, tie_word_embeddings=True)),
    # Tiny variants for tests: the same architectures at toy widths. Vocabularies hold
    # the byte tokenizer's 259 ids; head counts exercise GQA.
    "tiny-llama": ("llama", dict(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        rope_theta=10000.0, tie_word_embeddings=False)),
    "tiny-qwen2": ("qwen2", dict(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        rope_theta=10000.0, tie_word_embeddings=False)),
    "tiny-mistral": ("mistral", dict(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False)),
    "tiny-gemma2": ("gemma2", dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=16384, sliding_window=64, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "tiny-qwen3": ("qwen3", dict(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=16384,
        rope_theta=10000.0, tie_word_embeddings=True)),
    "tiny-granite": ("granite", dict(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        rope_theta=10000.0, embedding_multiplier=6.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=4.0, tie_word_embeddings=False)),
    "tiny-cohere": ("cohere", dict(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        rope_theta=10000.0, logit_scale=0.25, use_qk_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True)),
    "tiny-phi3": ("phi3", dict(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        rope_theta=10000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)),
    # SSM-ResNet (longtrain's own model, models/ssm_resnet.py) at the adjoint-sharding
    # paper's sizes (Fig. 1: 32M, 63M, 127M, 225M, 1.27B parameters; the paper gives
    # only the counts, so widths and depths are ours), a GPT-2-sized vocabulary.
    "ssm-32m": ("ssm_resnet", dict(vocab_size=32000, hidden_size=384, state_size=384, num_hidden_layers=12)),
    "ssm-63m": ("ssm_resnet", dict(vocab_size=32000, hidden_size=640, state_size=640, num_hidden_layers=13)),
    "ssm-127m": ("ssm_resnet", dict(vocab_size=32000, hidden_size=1024, state_size=1024, num_hidden_layers=15)),
    "ssm-225m": ("ssm_resnet", dict(vocab_size=32000, hidden_size=1280, state_size=1280, num_hidden_layers=22)),
    "ssm-1.27b": ("ssm_resnet", dict(vocab_size=32000, hidden_size=2560, state_size=2560, num_hidden_layers=42)),
    "tiny-ssm": ("ssm_resnet", dict(vocab_size=320, hidden_size=32, state_size=24, num_hidden_layers=3)),
    "tiny-gemma3": ("gemma3_text", dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=16384,
        sliding_window=24, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "tiny-qwen3-moe": ("qwen3_moe", dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=16384, tie_word_embeddings=False)),
    "tiny-gpt-oss": ("gpt_oss", dict(  # sliding and full layers, a sink per head, 4 experts, 2 per token
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
        max_position_embeddings=16384, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0})),
    "tiny-mixtral": ("mixtral", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16384,
        sliding_window=None, tie_word_embeddings=False)),
    # Hugging Face Mamba (its pure-PyTorch path) at a toy width, for tests; attention-free.
    "tiny-mamba": ("mamba", dict(vocab_size=320, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4,
                                 expand=2)),
    # Hugging Face Mamba-2 at a toy width: 8 heads of 8 channels in 2 groups; chunks of 8
    # tokens, so the torch path's chunked scan (SSD) spans several chunks at test lengths.
    "tiny-mamba2": ("mamba2", dict(
        vocab_size=320, hidden_size=32, num_heads=8, head_dim=8, state_size=8, n_groups=2, num_hidden_layers=2,
        conv_kernel=4, expand=2, chunk_size=8, tie_word_embeddings=True)),
    # state-spaces/mamba2-2.7b (its vocabulary of 50277 padded to a multiple of 16).
    "mamba2-2.7b": ("mamba2", dict(
        vocab_size=50288, hidden_size=2560, num_heads=80, head_dim=64, state_size=128, n_groups=1,
        num_hidden_layers=64, conv_kernel=4, expand=2, chunk_size=256, residual_in_fp32=True,
        tie_word_embeddings=True)),
    # The SSM the adjoint engine trains on the pass-key task in `longtrain train --model ssm-demo`.
    "ssm-demo": ("ssm_resnet", dict(vocab_size=260, hidden_size=128, state_size=128, num_hidden_layers=4)),
    # The embedded default of `longtrain train`: small enough to train at 8K tokens on
    # two CPU cores in minutes.
    "demo": ("llama", dict(
        vocab_size=260, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        # A large base leaves 7 of a head's 16 rotary pairs turning less than once in 8K tokens:
        # the pretrained demo can match the pass key by content at any distance (docs/demo.md).
        rope_theta=1_000_000.0, tie_word_embeddings=False)),
}


def _normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_NORMALIZED = {_normalize(name): name for name in _PRESETS}


# Presets longtrain ships trained weights for, as package data: `longtrain train` starts
# from them instead of a random initialization (--from-scratch for random weights). The
# demo's were made by scripts/pretrain_demo.py; docs/demo.md says how and what they know.
_PACKAGED = {"demo": "demo_checkpoint"}


def packaged_checkpoint(name: str) -> str | None:
    """The directory of the weights longtrain ships for preset ``name``, or None."""
    folder = _PACKAGED.get(resolve_preset(name) or "")
    path = Path(__file__).resolve().parent.parent / folder if folder else None
    return str(path) if path is not None and (path / "model.safetensors").is_file() else None


def preset_names() -> list[str]:
    return list(_PRESETS)


def resolve_preset(name: str) -> str | None:
    """Canonical preset name for ``name`` (case and punctuation ignored), or None."""
    return _BY_NORMALIZED.get(_normalize(name))


def preset_fields(name: str) -> tuple[str, dict]:
    """The model type and config fields of preset ``name``, straight from the table
    (``longtrain presets`` lists them without importing transformers)."""
    canonical = resolve_preset(name)
    if canonical is None:
        raise LongtrainError(
            f"unknown model preset {name!r}; presets: {', '.join(_PRESETS)} "
            "(or pass a local Hugging Face model directory)"
        )
    model_type, fields = _PRESETS[canonical]
    return model_type, dict(fields)


def preset_config(name: str, **overrides) -> PretrainedConfig:
    """A fresh Hugging Face config for preset ``name`` (e.g. ``"Llama-3-8B"``)."""
    from transformers import AutoConfig

    from . import ssm_resnet  # noqa: F401  (registers model_type "ssm_resnet" with AutoConfig)

    model_type, fields = preset_fields(name)
    canonical = resolve_preset(name)
    config = AutoConfig.for_model(model_type, **{**fields, **overrides})
    config.name_or_path = canonical
    return config
