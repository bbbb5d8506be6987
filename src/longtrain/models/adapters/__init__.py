"""One adapter per model family (see :mod:`.base`); importing this package registers them."""

from . import cohere, gemma2, granite, llama, mamba, mamba2, moe, ssm_resnet  # noqa: F401  (register the families)
from .base import (
                   AttentionFreeAdapter,
                   DecoderAdapter,
                   Head,
                   adapter_class,
                   adapter_for,
                   describe_model,
                   register_adapter,
                   supported_families,
)

__all__ = ["AttentionFreeAdapter", "DecoderAdapter", "Head", "adapter_class", "adapter_for", "describe_model", "register_adapter", "supported_families"]
