"""The optimizers longtrain trains and simulates with, built in one place so that the
simulator models exactly what the trainer runs."""

from __future__ import annotations

import torch

from .errors import LongtrainError

__all__ = ["make_optimizer"]

OPTIMIZERS = ("adamw", "adamw-offload", "sgd", "none")


def make_optimizer(name: str, params, lr: float = 1e-4, weight_decay: float = 0.0, model=None):
    """``adamw`` (fused on CUDA, per-parameter elsewhere: no whole-model temporaries),
    ``adamw-offload`` (state and fp32 master weights in host memory, gradients streamed
    there during backward: :class:`~longtrain.optimizer_offload.HostAdamW`; ``model``, the
    parameters' model, tells it the layers' backward order), ``sgd`` (momentum 0.9) or
    ``none`` (returns ``None``)."""
    # Meta parameters belong to another rank (layer groups): no state here.
    params = [p for p in params if p.requires_grad and not p.is_meta]
    if name == "none":
        return None
    if not params:
        raise LongtrainError("the model has no trainable parameters; enable LoRA or unfreeze some weights")
    if name == "adamw":
        on_cuda = all(p.is_cuda for p in params)
        # foreach=False off CUDA: the foreach path would allocate a transient copy of the
        # whole optimizer state, which neither the fused CUDA kernel nor this path needs.
        extra = {"fused": True} if on_cuda else {"foreach": False}
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), **extra)
    if name == "adamw-offload":
        from .optimizer_offload import HostAdamW, parameter_groups

        groups = parameter_groups(model, params) if model is not None else None
        return HostAdamW(params, groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay, foreach=False)
    raise LongtrainError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
