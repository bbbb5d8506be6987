"""Find the parts of a causal LM that techniques patch, whatever wraps the model."""

from __future__ import annotations

from torch import nn

from ..errors import LongtrainError

# Attribute paths, from the task model, to the stack of decoder blocks.
_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "backbone.layers", "layers")


def unwrap(model: nn.Module) -> nn.Module:
    """The underlying task model (strips a PEFT wrapper)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks, or a clear error if there is none."""
    base = unwrap(model)
    for path in _LAYER_PATHS:
        node = base
        for attr in path.split("."):
            node = getattr(node, attr, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList) and len(node) > 0:
            return node
    raise LongtrainError(
        f"cannot find the decoder layers of {type(base).__name__} (looked for "
        f"{', '.join(_LAYER_PATHS)}); layer techniques need a standard causal LM"
    )
