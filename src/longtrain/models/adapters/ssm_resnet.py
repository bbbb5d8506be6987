"""longtrain's SSM-ResNet (:mod:`longtrain.models.ssm_resnet`): attention-free, so there
are no rotary tables and no attention sub-block; a layer reads the padding mask (padding
keeps the recurrent state)."""

from __future__ import annotations

import torch
from torch import nn

from ...errors import LongtrainError
from .base import DecoderAdapter, register_adapter


@register_adapter
class SSMResNetAdapter(DecoderAdapter):
    families = ("ssm_resnet",)
    has_attention = False

    def mlp(self, layer: nn.Module) -> nn.Module | None:
        return None

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        return None

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, attention) -> torch.Tensor:
        return layer(hidden, attention.mask.key_valid)

    def run_attention(self, layer, hidden, position_embeddings, attention) -> None:
        raise LongtrainError("SSM-ResNet layers have no attention; chunked attention engines do not apply")
