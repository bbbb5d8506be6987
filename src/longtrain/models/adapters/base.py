"""What longtrain needs to know about one family of causal LMs, in one place.

Engines and techniques never reach into a model's internals: they ask its adapter for
the pieces of a forward pass — embed the tokens, compute the rotary tables for the
whole sequence, run a decoder layer (or only its attention sub-block), apply the final
norm — and for the parts techniques patch (each layer's MLP) and the LM head with its
logit scale and soft-cap. Each family's adapter is a few lines on top of
:class:`DecoderAdapter`; every model whose family is not registered is refused by
every technique and engine with the same one line (:func:`adapter_for`).

Adapters call the model's own modules; they never reimplement its math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ...errors import LongtrainError
from ..attention import KeysParked
from ..layers import unwrap

__all__ = ["DecoderAdapter", "Head", "adapter_class", "adapter_for", "register_adapter", "supported_families"]

_ADAPTERS: dict[str, type["DecoderAdapter"]] = {}

# Config fields that hold the dropout probability of attention weights.
_ATTENTION_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop")


@dataclass(frozen=True)
class Head:
    """The LM head: ``logits = softcap(module(hidden) · logit_scale)``."""

    module: nn.Module  # the output projection (a LoRA wrapper, if the head has adapters)
    logit_scale: float = 1.0
    softcap: float | None = None

    @property
    def linear(self) -> nn.Linear | None:
        """The head as a plain ``nn.Linear`` (what the fused chunked loss needs), or None."""
        return self.module if type(self.module) is nn.Linear else None


class DecoderAdapter:
    """A decoder-only transformer laid out as Hugging Face's Llama: ``model.embed_tokens``,
    ``model.rotary_emb``, ``model.layers`` (each with ``input_layernorm``, ``self_attn``
    and ``mlp``), ``model.norm`` and ``lm_head``."""

    families: ClassVar[tuple[str, ...]] = ()
    has_attention: ClassVar[bool] = True
    # Whether an op after the MLP saves its output (or something computed from it) for
    # backward, as Gemma-2's post-feed-forward norm does; where none does, the MLP output
    # only joins the residual stream and a recomputation that is only backpropagated
    # through need not compute it (ops.tiled_mlp.outputs_unread).
    mlp_output_saved: ClassVar[bool] = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.base = unwrap(model)
        self.config = self.base.config
        self.decoder = self.base.model

    # ---- structure -----------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    def embeddings(self) -> nn.Module:
        return self.decoder.embed_tokens

    def norm(self) -> nn.Module:
        return self.decoder.norm

    def mlp(self, layer: nn.Module) -> nn.Module | None:
        """The layer's token-wise feed-forward block (None if it has none)."""
        return layer.mlp

    def head(self) -> Head:
        return Head(self.base.get_output_embeddings())

    def attention_dropout(self) -> float:
        """The dropout probability the model applies to attention weights in training
        (longtrain's attention kernels apply none; other dropouts are replayed)."""
        return max((float(getattr(self.config, f, 0.0) or 0.0) for f in _ATTENTION_DROPOUT_FIELDS), default=0.0)

    # ---- the forward, piece by piece -------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings()(input_ids)

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        """Rotary tables for ``position_ids``; computed over the whole sequence at once,
        since some variants (dynamic NTK, longrope) depend on its length."""
        return self.decoder.rotary_emb(hidden, position_ids)

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, attention) -> torch.Tensor:
        """One decoder layer; ``attention`` is what the layer's attention hands q, k, v to
        (an :class:`~longtrain.models.attention.AttentionCall`)."""
        out = layer(hidden, attention_mask=attention, position_embeddings=position_embeddings, use_cache=False)
        return out[0] if isinstance(out, tuple) else out

    def run_attention(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, attention) -> None:
        """Only the layer's attention sub-block (its input norm and attention, no MLP):
        enough for ``attention`` to see the layer's keys and values; a call that raises
        :class:`~longtrain.models.attention.KeysParked` ends it there."""
        try:
            layer.self_attn(hidden_states=layer.input_layernorm(hidden), position_embeddings=position_embeddings,
                            attention_mask=attention)
        except KeysParked:
            pass

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm()(hidden)


def register_adapter(cls: type[DecoderAdapter]) -> type[DecoderAdapter]:
    for family in cls.families:
        _ADAPTERS[family] = cls
    return cls


def supported_families() -> list[str]:
    return sorted(_ADAPTERS)


def adapter_class(family: str | None) -> type[DecoderAdapter]:
    """The adapter class of ``family`` (a config's ``model_type``), or the Llama-layout
    base class for one not registered: what it knows without a model (e.g. for the planner)."""
    return _ADAPTERS.get(family, DecoderAdapter)


def adapter_for(model: nn.Module) -> DecoderAdapter:
    """The adapter of ``model``'s family, or one clear line naming the supported ones."""
    base = unwrap(model)
    family = getattr(getattr(base, "config", None), "model_type", None)
    cls = _ADAPTERS.get(family)
    if cls is None:
        what = f"{family} models" if family else f"{type(base).__name__} (not a Hugging Face causal LM)"
        raise LongtrainError(
            f"longtrain does not support {what}; supported model families: {', '.join(supported_families())}"
        )
    return cls(model)
