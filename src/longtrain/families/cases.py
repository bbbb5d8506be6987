"""What the family check builds and runs: tiny configs, the batches, the strategies and the
tolerances (the float64 kept through stock models' float32 casts: :mod:`.float64`)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["BATCHES", "DROPOUT", "FD_TOLERANCE", "MASKS_WITHOUT_POSITIONS", "ROUTER_AUX_LOSS_COEF", "STRATEGIES",
           "TOLERANCE", "causal_families", "tiny_config"]

TOLERANCE = 1e-10

# Families whose model builds its masks without the position ids, so that stock would attend
# across packed documents: the stock reference gets their document masks built with them.
MASKS_WITHOUT_POSITIONS = ("gpt_oss",)

VOCAB = 320

# Small enough to run every family in seconds; heads ≠ K/V heads (grouped K/V), a
# sliding window shorter than the sequence, two experts of four per token.
_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, moe_intermediate_size=32,
             num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4,
             shared_expert_intermediate_size=48, shared_intermediate_size=48, sliding_window=24,
             attention_chunk_size=24, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             output_router_logits=False, use_cache=False)

def causal_families() -> list[str]:
    """Every decoder-only ``model_type`` transformers maps to a causal-LM class (not the
    decoders of encoder-decoder models, nor encoder families with a causal-LM head)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    families = []
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = AutoConfig.for_model(family)
        except Exception:  # noqa: BLE001 - a family whose default config does not build is no candidate
            continue
        if not getattr(config, "is_encoder_decoder", False) and family not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            families.append(family)
    return families

def tiny_config(family: str):
    """``family``'s default config shrunk to :data:`_TINY` (fields it has), every dropout 0;
    its sub-configs too (a multimodal config's text and vision towers)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family)
    _shrink(config)
    return config


def _shrink(config) -> None:
    layers = getattr(config, "num_hidden_layers", None)
    for key, value in _TINY.items():
        if hasattr(config, key):  # fields it has, under their own names or the attribute map's
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, value)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
        elif isinstance(value, list) and layers and len(value) == layers and key != "architectures":
            setattr(config, key, value[:config.num_hidden_layers])
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _shrink(sub)

def _padded(left: bool) -> dict:
    generator = torch.Generator().manual_seed(1)
    lengths, width = (37, 26), 37
    ids = torch.randint(3, VOCAB, (2, width), generator=generator)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if left:
            mask[row, width - n:] = 1
        else:
            mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    if left:  # a left-padded row's first token is predicted by a position that sees no key
        labels[1, width - lengths[1]] = -100
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels}

def _packed() -> dict:
    generator = torch.Generator().manual_seed(2)
    documents = ((15, 13, 9), (37,))
    ids = torch.randint(3, VOCAB, (2, 37), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    return {"input_ids": ids, "labels": ids.masked_fill(positions == 0, -100), "position_ids": positions}

def _rows(length: int) -> dict:
    """One unpadded row of ``length`` tokens: a chunk of 11 leaves a last chunk that one
    MLP tile holds (37 = 3 × 11 + 4), and 6 tokens are one tile and one chunk in all."""
    ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}

BATCHES = {"right-padded": lambda: _padded(False), "left-padded": lambda: _padded(True), "packed": _packed,
           "one row": lambda: _rows(37), "one tile": lambda: _rows(6)}

def _strategies() -> dict:
    import longtrain as lt

    # Chunks of 11 and 14 tokens divide neither 37 nor a document; MsT's 7-token tiles neither.
    mst = lt.MsTOptions(loss_chunks=3, mlp_chunk=7)
    return {
        "backprop": lambda: lt.Strategy(),
        "checkpoint": lambda: lt.Strategy(checkpoint=True),
        "mst": lambda: lt.Strategy(mst=mst),
        "checkpoint,mst": lambda: lt.Strategy(checkpoint=True, mst=mst),
        "memo": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=0.3, keep_last=1)),
        "memo:alpha=1,mst": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=1.0, keep_last=1), mst=mst),
        "fpdt": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 11}),
        "fpdt,mst": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 11}, mst=lt.MsTOptions(loss_chunks=3)),
        "fpdt:offload,keep_output,mst": lambda: lt.Strategy(
            engine="fpdt", engine_options={"chunk": 14, "offload": True, "keep_output": 1}, mst=lt.MsTOptions(loss_chunks=3)),
        "seco,checkpoint,mst": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 11}, checkpoint=True, mst=mst),
        "spaco(every chunk),mst": lambda: lt.Strategy(engine="spaco", engine_options={"chunk": 14, "budget": 8}, mst=mst),
    }

STRATEGIES = tuple(["backprop", "checkpoint", "mst", "checkpoint,mst", "memo", "memo:alpha=1,mst", "fpdt", "fpdt,mst",
                    "fpdt:offload,keep_output,mst", "seco,checkpoint,mst", "spaco(every chunk),mst"])

# Dropout probabilities of the second pass (every dropout but attention's, LoRA's, a router's
# jitter), and how far the gradient may be from the derivative of the reported loss.
DROPOUT = 0.1

FD_TOLERANCE = 1e-6

ROUTER_AUX_LOSS_COEF = 0.02  # a mixture of experts is checked with its load-balancing loss on
