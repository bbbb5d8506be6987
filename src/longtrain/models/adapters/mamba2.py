"""Hugging Face Mamba-2 (``Mamba2ForCausalLM``): laid out as Mamba (the stack under
``backbone``: ``embeddings``, ``layers`` of ``Mamba2Block``, ``norm_f``), so it shares
:class:`~.mamba.MambaAdapter`: layers read the padding mask (the model zeroes padded
tokens' inputs and convolution outputs), packed documents are refused, the final norm
is cast to the head's dtype. Its torch path runs (no CUDA kernels are needed); the
``adjoint`` engine sees each block as a recurrence
(:class:`~.mamba2_recurrence.Mamba2Recurrence`)."""

from __future__ import annotations

import dataclasses

from torch import nn

from .base import AttentionFreeAdapter, register_adapter
from .mamba import MambaAdapter
from .mamba2_recurrence import Mamba2Recurrence

__all__ = ["Mamba2Adapter"]


@register_adapter
class Mamba2Adapter(MambaAdapter):
    families = ("mamba2",)
    title = "Mamba-2"
    untimed_work = "the selective scan (the stock model's runs in chunks; the adjoint engine's in log depth)"

    @classmethod
    def scan_per_token(cls, config) -> bool:
        # Its stock scan runs in chunks, vectorized, and forms a (chunks × chunks) decay matrix
        # per head: memory quadratic in the length, so no token blocks either (simulated whole).
        return False

    @classmethod
    def describe(cls, config):
        """As any SSM, with the mixer's projections: in (hidden → 2·I + 2·G·N + H) and out (I → hidden)."""
        inner = config.num_heads * config.head_dim
        projected = 2 * inner + 2 * config.n_groups * config.state_size + config.num_heads
        mixer = config.hidden_size * projected + inner * config.hidden_size
        return dataclasses.replace(AttentionFreeAdapter.describe(config), mixer_parameters=mixer)

    def recurrence(self, layer: nn.Module) -> Mamba2Recurrence:
        return Mamba2Recurrence(layer)
