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

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ...errors import LongtrainError
from ..attention import KeysParked
from ..description import Attention, FeedForward, ModelDescription
from ..layers import unwrap

__all__ = ["AttentionFreeAdapter", "DecoderAdapter", "Head", "adapter_class", "adapter_for", "describe_model", "register_adapter", "supported_families"]

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
    # Weight matrices of the MLP: 3 when gated (gate, up, down), 2 otherwise (up, down).
    mlp_matrices: ClassVar[int] = 3
    # Simulated whole, never extrapolated along its layers (models small enough to).
    simulated_whole: ClassVar[bool] = False
    # Linear layers LoRA leaves alone: those the model's forward reads as weights, not calls.
    lora_exclude: ClassVar[tuple[str, ...]] = ()
    # Work of the model's own step the time model does not count (plans say so; None: none).
    untimed_work: ClassVar[str | None] = None

    @classmethod
    def scan_per_token(cls, config) -> bool:
        """Whether the model's own step runs a Python step per token and layer (the time
        model charges ``token_step`` for each)."""
        return False

    @classmethod
    def mlp_output_saved(cls, config) -> bool:
        """Whether an op after the MLP saves its output (or something computed from it) for
        backward, as a norm after the MLP does; where none does, a recomputation that is
        only backpropagated through skips the MLP's output. The time model's reading: the
        engines learn it from each layer's graph (:mod:`longtrain.ops.unread_outputs`), and
        ``longtrain families`` checks the two agree."""
        return False

    @classmethod
    def token_block(cls, config) -> int | None:
        """Tokens per block such that the model's own step (forward and backward) takes
        memory affine in the number of whole blocks, so simulations run a few blocks and
        extend: attention-free layers, whose every token saves alike. None: attention."""
        return None

    def __init__(self, model: nn.Module):
        self.model = model
        self.base = unwrap(model)
        self.config = self.base.config
        self.decoder = self.base.model

    # ---- shape and cost facts ------------------------------------------------------------
    @classmethod
    def describe(cls, config) -> ModelDescription:
        """The model's :class:`~longtrain.models.description.ModelDescription`, read from its config."""
        n, heads = config.num_hidden_layers, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return ModelDescription(
            layers=n, hidden=config.hidden_size, vocab=config.vocab_size, heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
            rotary_dim=int(head_dim * _partial_rotary_factor(config)),
            attention=tuple(cls.layer_attention(config, i) for i in range(n)),
            feed_forward=tuple(cls.layer_feed_forward(config, i) for i in range(n)),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_positions=getattr(config, "max_position_embeddings", None))

    @classmethod
    def layer_attention(cls, config, index: int) -> Attention:
        """Layer ``index``'s attention: ``layer_types`` where the config lists them, else a
        sliding window on every layer where the config sets one."""
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types:
            if types[index] == "sliding_attention" and window:
                return Attention("sliding", int(window))
            if types[index] == "chunked_attention":
                return Attention("chunked", int(config.attention_chunk_size))
            return Attention()
        if window and getattr(config, "use_sliding_window", True) is not False:
            return Attention("sliding", int(window))
        return Attention()

    @classmethod
    def layer_feed_forward(cls, config, index: int) -> FeedForward:
        """Layer ``index``'s feed-forward block: a dense MLP of ``intermediate_size``."""
        return FeedForward(config.intermediate_size, cls.mlp_matrices)

    @classmethod
    def with_layers(cls, config, layers: int):
        """A copy of ``config`` with its first ``layers`` layers (per-layer lists cut to them)."""
        small = copy.deepcopy(config)
        n = config.num_hidden_layers
        for key, values in vars(config).items():
            if isinstance(values, (list, tuple)) and len(values) == n and key != "architectures":
                setattr(small, key, type(values)(values[:layers]))
        small.num_hidden_layers = layers
        return small

    @classmethod
    def base_bits(cls, config) -> int | None:
        """4 where the config says bitsandbytes holds its linear weights in 4 bits (its
        ``quantization_config``: a 4-bit checkpoint's config.json, or ``--4bit``), else None."""
        return 4 if _quantization(config).get("load_in_4bit") else None

    @classmethod
    def double_quantized(cls, config) -> bool:
        """Whether a 4-bit base's block scales are themselves quantized (bitsandbytes'
        ``bnb_4bit_use_double_quant``)."""
        return bool(_quantization(config).get("bnb_4bit_use_double_quant", False))

    @classmethod
    def allow_positions(cls, config, length: int) -> None:
        """Let ``config``'s rotary tables reach ``length`` positions (simulations and plans
        of lengths beyond the pretrained context)."""
        if hasattr(config, "max_position_embeddings"):
            config.max_position_embeddings = max(config.max_position_embeddings or 0, length)

    def check_trainable(self) -> None:
        """Refuse, in one line, what no engine trains exactly for this model: attention
        that sees later tokens (Gemma's ``use_bidirectional_attention``, for embedding
        models), which longtrain's causal kernels would train as causal."""
        if not self.has_attention:
            return
        if any(getattr(module, "is_causal", True) is False for layer in self.layers for module in layer.modules()):
            flag = " (use_bidirectional_attention=True)" if getattr(self.config, "use_bidirectional_attention", False) else ""
            raise LongtrainError(f"this {self.config.model_type} model's attention is bidirectional{flag}; longtrain trains "
                                 "causal language models: set use_bidirectional_attention=False in its config, or train "
                                 "it without longtrain")

    @functools.cached_property
    def description(self) -> ModelDescription:
        """This model's :class:`~longtrain.models.description.ModelDescription` (read once)."""
        return type(self).describe(self.config)

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

    def routers(self) -> list[tuple[nn.Module, nn.Module]]:
        """``(layer, router)`` for every router of a mixture of experts: the modules whose
        output (logits, routing weights, expert indices) the model records as its
        ``router_logits`` (empty for a dense model)."""
        recorder = (getattr(self.base, "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        if target is None or getattr(recorder, "index", 0) != 0:
            return []
        return [(layer, module) for layer in self.layers for module in layer.modules() if isinstance(module, target)]

    def mlp_writes_input(self) -> bool:
        """Whether the MLP changes its input in place in training (a tiled MLP then hands
        each tile a copy: its input is kept for the backward)."""
        return False

    def mlp_returns_pair(self) -> bool:
        """Whether the MLP returns ``(output, router scores)`` and its layer reads the first
        (gpt-oss): a tiled MLP then returns ``(output, None)``."""
        return False

    def attention_dropout(self) -> float:
        """The dropout probability the model applies to attention weights in training
        (longtrain's attention kernels apply none; other dropouts are replayed)."""
        return max((float(getattr(self.config, f, 0.0) or 0.0) for f in _ATTENTION_DROPOUT_FIELDS), default=0.0)

    # ---- the forward, piece by piece -------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings()(input_ids)

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        """Rotary tables for ``position_ids``; computed over the whole sequence at once,
        since some variants (dynamic NTK, longrope) depend on its length. Families with one
        table per kind of layer (Gemma-3's local and global layers) get a dict by layer type;
        families without rotary embeddings get None."""
        rotary = getattr(self.decoder, "rotary_emb", None)
        if rotary is None:
            return None
        types = self._rotary_layer_types()
        if types:
            return {kind: rotary(hidden, position_ids, kind) for kind in types}
        return rotary(hidden, position_ids)

    def _rotary_layer_types(self) -> tuple[str, ...]:
        rotary = self.decoder.rotary_emb
        if "layer_type" not in inspect.signature(rotary.forward).parameters:
            return ()
        return tuple(sorted(set(self.config.layer_types)))

    def layer_index(self, layer: nn.Module) -> int:
        """``layer``'s index in the decoder (what its attention module calls ``layer_idx``)."""
        index = getattr(getattr(layer, "self_attn", None), "layer_idx", None)
        if index is None:
            index = next(i for i, candidate in enumerate(self.layers) if candidate is layer)
        return index

    def layer_tables(self, layer: nn.Module, position_embeddings):
        """The rotary tables ``layer`` reads out of :meth:`position_embeddings`."""
        if isinstance(position_embeddings, dict):
            return position_embeddings[self.config.layer_types[self.layer_index(layer)]]
        return position_embeddings

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, attention) -> torch.Tensor:
        """One decoder layer; ``attention`` is what the layer's attention hands q, k, v to
        (an :class:`~longtrain.models.attention.AttentionCall`)."""
        out = layer(hidden, attention_mask=attention, position_embeddings=self.layer_tables(layer, position_embeddings),
                    use_cache=False)
        return out[0] if isinstance(out, tuple) else out

    def run_attention(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, attention) -> None:
        """The layer up to its attention: enough for ``attention`` to see the layer's keys
        and values; the call raises :class:`~longtrain.models.attention.KeysParked`, which
        ends the layer there (before its output projection and MLP)."""
        try:
            self.run_layer(layer, hidden, position_embeddings, attention)
        except KeysParked:
            pass

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm()(hidden)


class AttentionFreeAdapter(DecoderAdapter):
    """A state-space model: no attention, no rotary tables, no feed-forward block for MsT
    to tile; its layers are recurrences the adjoint engine trains (``recurrence``)."""

    has_attention = False
    title: ClassVar[str] = "SSM"  # how a refusal names the model's layers
    untimed_work = "the selective scan (the time model counts the projections and the head)"

    @classmethod
    def describe(cls, config) -> ModelDescription:
        """Attention-free and without a feed-forward block: layers, width and vocabulary."""
        return ModelDescription(layers=config.num_hidden_layers, hidden=config.hidden_size, vocab=config.vocab_size,
                                tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                                stream_item=4 if getattr(config, "residual_in_fp32", False) else None)

    def mlp(self, layer: nn.Module) -> nn.Module | None:
        return None

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        return None

    def run_attention(self, layer, hidden, position_embeddings, attention) -> None:
        raise LongtrainError(f"{self.title} layers have no attention; chunked attention engines do not apply")


def _quantization(config) -> dict:
    """The config's ``quantization_config`` as a mapping (a dict, or transformers' object), or {}."""
    settings = getattr(config, "quantization_config", None)
    settings = settings.to_dict() if hasattr(settings, "to_dict") else settings
    return settings if isinstance(settings, dict) else {}


def _partial_rotary_factor(config) -> float:
    """The share of a head that rotary embeddings rotate (rope parameters may be per layer type)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(value, dict) for value in rope.values()):
        rope = next(iter(rope.values()))
    return float(rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0)


def describe_model(config) -> ModelDescription:
    """The description of a model with ``config``, from its family's adapter (the
    Llama-layout reading for a family without one; one line where that cannot read it)."""
    family = getattr(config, "model_type", None)
    try:
        return adapter_class(family).describe(config)
    except (AttributeError, TypeError, KeyError, IndexError):
        raise LongtrainError(_unsupported(f"{family} models" if family else "this model")) from None


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
        raise LongtrainError(_unsupported(f"{family} models" if family else f"{type(base).__name__} (not a Hugging Face causal LM)"))
    try:
        return cls(model)
    except AttributeError as error:  # e.g. LlamaModel: the decoder without the causal LM around it
        raise LongtrainError(f"{type(base).__name__} is not laid out as a {family} causal language model ({error}); "
                             f"pass the model with its LM head (the ...ForCausalLM class)") from None


def _unsupported(what: str) -> str:
    return f"longtrain does not support {what}; supported model families: {', '.join(supported_families())}"
