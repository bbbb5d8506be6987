"""What plans ask of ``liger``: whether liger-kernel imports here and covers a model type
(:func:`liger_available`, which ``--strategy auto`` reads) and :class:`LigerCosts`."""

from __future__ import annotations

from ...costs import StepWork, TechniqueCosts
from ...errors import LongtrainError
from .options import LigerOptions


def _patchers() -> dict:
    """liger-kernel's patcher per model type, or one line saying why it cannot be used here."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] == "liger_kernel":
            raise LongtrainError("the liger technique needs liger-kernel: pip install liger-kernel "
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
    least as much) in less elementwise time (its fused kernels move fewer bytes:
    :meth:`~longtrain.models.description.ModelDescription.elementwise_bytes`); added by
    ``--strategy auto`` where it runs."""

    def serves(self, adapter_class, options: LigerOptions) -> bool:
        return adapter_class.has_attention  # liger-kernel patches decoders (no state-space model)

    def describe(self, work: StepWork, options: LigerOptions) -> None:
        work.fused = frozenset(kernel for kernel, on in (("norm", options.rms_norm), ("rope", options.rope),
                                                         ("mlp", options.mlp)) if on)

    def added_automatically(self, device_type: str, model_type: str) -> str | None:
        return "liger-kernel is installed" if device_type == "cuda" and liger_available(model_type) else None
