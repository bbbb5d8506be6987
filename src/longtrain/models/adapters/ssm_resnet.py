"""longtrain's SSM-ResNet (:mod:`longtrain.models.ssm_resnet`): attention-free, so there
are no rotary tables and no attention sub-block; a layer reads the padding mask (padding
keeps the recurrent state)."""

from __future__ import annotations

import torch
from torch import nn

from ...errors import LongtrainError
from ...ops.recurrence import Recurrence
from ..description import ModelDescription
from .base import DecoderAdapter, register_adapter


class SSMRecurrence(Recurrence):
    """An :class:`~longtrain.models.ssm_resnet.SSMLayer` for the adjoint engine: token-wise
    maps (no window), its own readout and token map (:meth:`SSMLayer.local`)."""

    @torch.no_grad()
    def forward(self, z, mask):
        a, c, h = self.layer.states(z, mask)
        return z + self.layer.readout(c, h), a, (c,), h

    def readout(self, inputs, h):
        return self.layer.readout(inputs[0], h)

    def local(self, z, mask, context, h_prev, h):
        state, out = self.layer.local(z, h_prev, h, mask)
        return state, z + out

    def token_bytes(self, element_size: int) -> int:
        # What one token's map keeps for its VJP (norm, projections, gates) and the VJP's
        # cotangents: about 4 hidden-sized and 6 state-sized vectors (measured: 5 KiB per
        # token for P = N = 128 in float32).
        p, n = self.layer.out_proj.out_features, self.layer.out_proj.in_features
        return (4 * p + 6 * n) * element_size


__all__ = ["SSMResNetAdapter"]


@register_adapter
class SSMResNetAdapter(DecoderAdapter):
    families = ("ssm_resnet",)
    has_attention = False
    simulated_whole = True

    def mlp(self, layer: nn.Module) -> nn.Module | None:
        return None

    @classmethod
    def describe(cls, config) -> ModelDescription:
        """Attention-free and without a feed-forward block: layers, width and vocabulary."""
        return ModelDescription(layers=config.num_hidden_layers, hidden=config.hidden_size, vocab=config.vocab_size,
                                tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        return None

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, attention) -> torch.Tensor:
        return layer(hidden, attention.mask.key_valid)

    def run_attention(self, layer, hidden, position_embeddings, attention) -> None:
        raise LongtrainError("SSM-ResNet layers have no attention; chunked attention engines do not apply")

    def recurrence(self, layer: nn.Module) -> SSMRecurrence:
        return SSMRecurrence(layer)
