"""What ``liger`` runs: liger-kernel's own per-family patcher on the model, its loss patches
off (the simulator's fake tensors keep the stock ops)."""

from __future__ import annotations

import inspect

from torch._subclasses.fake_tensor import is_fake

from ...errors import LongtrainError
from .costs import _patchers
from .options import LigerOptions


def _require_cuda(model) -> None:
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise LongtrainError(f"the liger technique runs Triton kernels on a CUDA GPU, and the model is on {device.type}; "
                             "move the model to the GPU first, or leave 'liger' out of the strategy")


def install_liger(context, options: LigerOptions) -> None:
    model = context.adapter.base
    if is_fake(next(model.parameters())):  # the simulator: Liger's kernels cannot run on fake tensors
        context.notes["liger"] = "simulated with the stock ops, whose saved tensors Liger's kernels do not exceed"
        return
    _require_cuda(model)
    apply = _patchers().get(model.config.model_type)
    if apply is None:
        raise LongtrainError(f"liger-kernel has no kernels for model type {model.config.model_type!r}; "
                             "leave 'liger' out of the strategy")
    accepted = inspect.signature(apply).parameters
    wanted = {"rms_norm": options.rms_norm, "swiglu": options.mlp, "geglu": options.mlp, "rope": options.rope,
              # the loss stays longtrain's (MsT's chunked head, or the engine's)
              "cross_entropy": False, "fused_linear_cross_entropy": False}
    apply(model=model, **{name: value for name, value in wanted.items() if name in accepted})
