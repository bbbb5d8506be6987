"""Hugging Face Mamba-2 (``Mamba2ForCausalLM``): laid out as Mamba (the stack under
``backbone``: ``embeddings``, ``layers`` of ``Mamba2Block``, ``norm_f``), so it shares
:class:`~.mamba.MambaAdapter`: layers read the padding mask (the model zeroes padded
tokens' inputs and convolution outputs), packed documents are refused, the final norm
is cast to the head's dtype. Its torch path runs (no CUDA kernels are needed); the
``adjoint`` engine sees each block as a recurrence
(:class:`~.mamba2_recurrence.Mamba2Recurrence`)."""

from __future__ import annotations

from torch import nn

from .base import register_adapter
from .mamba import MambaAdapter
from .mamba2_recurrence import Mamba2Recurrence

__all__ = ["Mamba2Adapter"]


@register_adapter
class Mamba2Adapter(MambaAdapter):
    families = ("mamba2",)
    title = "Mamba-2"

    def recurrence(self, layer: nn.Module) -> Mamba2Recurrence:
        return Mamba2Recurrence(layer)
