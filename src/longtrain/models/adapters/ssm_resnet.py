"""longtrain's SSM-ResNet (:mod:`longtrain.models.ssm_resnet`): attention-free, so there
are no rotary tables and no attention sub-block; a layer reads the padding mask (padding
keeps the recurrent state)."""

from __future__ import annotations

import torch
from torch import nn

from ...ops.recurrence import Recurrence
from .base import AttentionFreeAdapter, register_adapter


class SSMRecurrence(Recurrence):
    """An :class:`~longtrain.models.ssm_resnet.SSMLayer` for the adjoint engine: its own
    token-wise maps (no window) and readout."""

    def maps(self, z, mask, context):
        a, b, c = self.layer.maps(z, mask)
        return z, a, b, (c,)

    def readout(self, inputs, h):
        return self.layer.readout(inputs[0], h)

    def stream_dtype(self) -> torch.dtype:
        return self.layer.out_proj.weight.dtype

    def state_size(self) -> int:
        return self.layer.out_proj.in_features

    def token_bytes(self, element_size: int) -> int:
        # What one token's map keeps for its VJP (norm, projections, gates) and the VJP's
        # cotangents: about 4 hidden-sized and 6 state-sized vectors (measured: 5 KiB per
        # token for P = N = 128 in float32).
        p, n = self.layer.out_proj.out_features, self.layer.out_proj.in_features
        return (4 * p + 6 * n) * element_size


__all__ = ["SSMResNetAdapter"]


@register_adapter
class SSMResNetAdapter(AttentionFreeAdapter):
    families = ("ssm_resnet",)
    title = "SSM-ResNet"
    simulated_whole = True

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, attention) -> torch.Tensor:
        return layer(hidden, attention.mask.key_valid)

    def recurrence(self, layer: nn.Module) -> SSMRecurrence:
        return SSMRecurrence(layer)
