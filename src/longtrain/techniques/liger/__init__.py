"""``liger``: Liger's fused kernels for the elementwise ops of every layer (CUDA).

Hugging Face runs RMSNorm, the gated activation and the rotary embedding as chains of
PyTorch ops (RMSNorm alone: an upcast, a square, a mean, a reciprocal square root, two
products and a downcast), each a pass over a hidden-state-sized tensor in forward, again
in a checkpointed layer's recomputation, and more in backward. On an H100 at 32K tokens
of Llama-3-8B those passes take about a sixth of longtrain's step; Liger's Triton
kernels do each chain in one pass (docs/speed.md has the profile). This technique asks
liger-kernel to patch the model's norms, MLPs and rotary embedding — its own per-family
patcher, with its loss patches off: MsT's chunked head stays the loss.

The kernels compute the same function with fewer roundings (a float32 silu·up, for one);
they are Triton-only, so they run on CUDA and their exactness is checked there
(tests/test_cuda.py) against float64 stock autograd. Installed before MsT, so MsT tiles
Liger's MLP.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch._subclasses.fake_tensor import is_fake

from ... import validate
from ...costs import TechniqueCosts
from ...errors import LongtrainError
from ...registry import TechniqueSpec, register

__all__ = ["LigerOptions", "liger_available"]


@dataclass
class LigerOptions:
    """Which of Liger's kernels to use."""

    rms_norm: bool = True  # fused RMSNorm (forward and backward)
    mlp: bool = True  # fused gated activation: SwiGLU, or GeGLU for Gemma
    rope: bool = True  # fused rotary embedding of q and k

    def __post_init__(self):
        for name in ("rms_norm", "mlp", "rope"):
            validate.flag("liger", name, getattr(self, name))


def _require_cuda(model) -> None:
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise LongtrainError(f"the liger technique runs Triton kernels on a CUDA GPU, and the model is on {device.type}; "
                             "move the model to the GPU first, or leave 'liger' out of the strategy")


def _patchers() -> dict:
    """liger-kernel's patcher per model type, or one line saying why it cannot be used here."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] == "liger_kernel":
            raise LongtrainError("the liger technique needs liger-kernel: pip install 'longtrain[liger]' "
                                 "(or leave 'liger' out of the strategy)") from None
        raise LongtrainError(f"liger-kernel cannot be imported here ({error}); it needs a CUDA build of torch "
                             "with Triton: leave 'liger' out of the strategy on this machine") from None
    return MODEL_TYPE_TO_APPLY_LIGER_FN


def liger_available(model_type: str) -> bool:
    """Whether liger-kernel imports here and has kernels for ``model_type``."""
    try:
        return model_type in _patchers()
    except LongtrainError:
        return False


class LigerCosts(TechniqueCosts):
    """Liger: the same memory as the stock ops (the simulator counts those, which keep at
    least as much) in less elementwise time; added by ``--strategy auto`` where it runs."""

    def added_automatically(self, device_type: str, model_type: str) -> str | None:
        return "liger-kernel is installed" if device_type == "cuda" and liger_available(model_type) else None


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


register(TechniqueSpec("liger", LigerOptions, install_liger, "Liger's fused RMSNorm, gated-MLP and rotary kernels (CUDA)",
                    costs=LigerCosts()))
