"""Hugging Face Mamba (``MambaForCausalLM``): attention-free, the stack under
``backbone`` (``embeddings``, ``layers`` of ``MambaBlock``, ``norm_f``). Layers read the
padding mask (the model zeroes padded tokens' inputs); they cannot reset their state at
document boundaries, so packed documents are refused. Its torch path runs (no CUDA
kernels are needed); the ``adjoint`` engine sees each block as a recurrence
(:class:`~.mamba_recurrence.MambaRecurrence`)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...errors import LongtrainError
from ..layers import unwrap
from .base import AttentionFreeAdapter, register_adapter
from .mamba_recurrence import MambaRecurrence

__all__ = ["MambaAdapter"]


@register_adapter
class MambaAdapter(AttentionFreeAdapter):
    families = ("mamba",)
    title = "Mamba"
    # The mixer multiplies by dt_proj.weight itself, and its fused CUDA kernel (mamba_ssm,
    # where installed) by x_proj.weight and out_proj.weight: adapters there would go unused
    # (peft refuses out_proj on Mamba). LoRA adapts in_proj.
    lora_exclude = ("dt_proj", "x_proj", "out_proj")
    untimed_work = ("the selective scan's arithmetic; the stock PyTorch path's Python step per token and layer, "
                    "which every engine but adjoint runs, is charged at an estimated token_step (not measured on a GPU; "
                    "on CPU those steps were 3-18x slower than the adjoint engine's, 256 to 1,024 tokens)")

    @classmethod
    def describe(cls, config):
        """As any SSM, with the mixer's projections: in (hidden → 2·I), x (I → rank + 2·N),
        Δ (rank → I) and out (I → hidden)."""
        inner, rank, state = config.intermediate_size, config.time_step_rank, config.state_size
        mixer = config.hidden_size * 2 * inner + inner * (rank + 2 * state) + rank * inner + inner * config.hidden_size
        return dataclasses.replace(super().describe(config), mixer_parameters=mixer)

    @classmethod
    def scan_per_token(cls, config) -> bool:
        # Without the mamba_ssm kernels, the stock torch path; with use_mambapy, mambapy's
        # parallel scan (padded to a power of two).
        return not getattr(config, "use_mambapy", False)

    @classmethod
    def token_block(cls, config) -> int | None:
        # A step per token: any block; small, as a simulation runs a Python step per token.
        return 16 if cls.scan_per_token(config) else None

    def __init__(self, model: nn.Module):  # the stack is ``backbone``, not ``model``
        self.model = model
        self.base = unwrap(model)
        self.config = self.base.config
        self.decoder = self.base.backbone

    def embeddings(self) -> nn.Module:
        return self.decoder.embeddings

    def norm(self) -> nn.Module:
        return self.decoder.norm_f

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        # As the model does before its head: with residual_in_fp32 the stream (and the
        # norm's output) is float32 under half precision, the head is not.
        return self.norm()(hidden).to(self.base.lm_head.weight.dtype)

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, attention) -> torch.Tensor:
        mask = attention.mask
        if mask.segments is not None:
            raise LongtrainError(f"{self.title} does not reset its state at document boundaries; pass batches without "
                                 "position resets (no packed documents)")
        return layer(hidden, attention_mask=mask.key_valid)

    def recurrence(self, layer: nn.Module) -> MambaRecurrence:
        return MambaRecurrence(layer)
