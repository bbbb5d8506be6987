"""``mst``: mini-sequence MLP and LM-head + loss (Mini-Sequence Transformer).

In long-sequence training the MLP and the LM head create intermediates far larger than
their inputs (2·I/d ≈ 7× and V/d ≈ 32× for Llama-3). MsT processes both in
mini-sequences so only one chunk's intermediates are alive, in forward and backward:

- every decoder block's MLP runs through :func:`~longtrain.ops.tiled_mlp.tiled_mlp`
  (chunks of ``mlp_chunk`` tokens; default the hidden size, the paper's rule);
- the head and the loss run through
  :func:`~longtrain.ops.chunked_loss.chunked_causal_lm_loss` (``loss_chunks``
  mini-sequences; default V/d, the paper's rule), so the logits never exist in full.

The model's own modules are patched on the instance (``mlp.forward``) and the engine
asks for the loss through :func:`~longtrain.models.head.lm_loss`; no model file changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import LongtrainError
from ..models.head import set_head_loss
from ..models.layers import decoder_layers, unwrap
from ..ops.chunked_loss import chunked_causal_lm_loss
from ..ops.tiled_mlp import tiled_mlp
from ..registry import register_technique
from .chunked_attention import PIPELINE_ATTR

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "ssm_resnet")


@dataclass
class MsT:
    """Knobs of the mini-sequence technique."""

    mlp_chunk: int | None = None  # tokens per MLP chunk; default: the hidden size
    loss_chunks: int | None = None  # LM-head mini-sequences; default: vocab / hidden
    mlp: bool = True  # tile the MLPs
    head: bool = True  # chunk the LM head + loss

    def __post_init__(self):
        for name in ("mlp_chunk", "loss_chunks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise LongtrainError(f"mst {name} must be a positive integer, got {value!r}")


def _tiled_forward(original, module: nn.Module, chunk: int, x: torch.Tensor) -> torch.Tensor:
    params = [p for p in module.parameters() if p.requires_grad]
    return tiled_mlp(original, x, params, chunk)


def _check_supported(model) -> nn.Module:
    base = unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in SUPPORTED:
        raise LongtrainError(
            f"mst does not support {model_type or type(base).__name__} models; supported: {', '.join(SUPPORTED)}"
        )
    return base


def _install_head(model, base: nn.Module, options: MsT) -> None:
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise LongtrainError(f"mst needs a plain linear LM head, found {type(head).__name__}; leave the head out of LoRA targets")
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    softcap = getattr(base.config, "final_logit_softcapping", None)

    def head_loss(input_ids, attention_mask, labels, num_label_tokens):
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return chunked_causal_lm_loss(
            hidden, head.weight, labels, bias=head.bias, num_label_tokens=num_label_tokens,
            chunks=options.loss_chunks, softcap=softcap,
        )

    set_head_loss(model, head_loss)


@register_technique("mst", MsT, "mini-sequence MLP and LM-head + loss (exact)", order=40)
def install_mst(model, options: MsT) -> None:
    base = _check_supported(model)
    attention_chunk = getattr(getattr(model, PIPELINE_ATTR, None), "chunk", None)
    object.__setattr__(model, "_longtrain_mst", options)  # the chunked pipeline reads loss_chunks
    if options.mlp and not getattr(base.config, "attention_free", False):  # SSM-ResNet layers have no MLP
        # Under chunked attention each MLP call sees one attention chunk; FPDT runs the
        # FFN in twice as many chunks as attention, which keeps attention the memory peak.
        default = base.config.hidden_size if attention_chunk is None else max(1, attention_chunk // 2)
        chunk = options.mlp_chunk or default
        for layer in decoder_layers(model):
            mlp = layer.mlp
            mlp.forward = functools.partial(_tiled_forward, mlp.forward, mlp, chunk)
    if options.head and attention_chunk is None:  # the chunked pipeline computes the head itself
        _install_head(model, base, options)
