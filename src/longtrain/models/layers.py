"""See through wrappers (the task model under a PEFT wrapper) and find what draws random numbers."""

from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The underlying task model (strips a PEFT wrapper)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def active_dropout(module: nn.Module) -> float:
    """The largest probability of the dropout modules in ``module`` that draw masks now
    (in training mode): LoRA's ``lora_dropout``, say; 0 where none does."""
    return max((m.p for m in module.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training),
               default=0.0)
