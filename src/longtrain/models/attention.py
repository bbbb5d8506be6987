"""Hugging Face attention backend ``longtrain_attn``: SDPA with flash-kernel memory on every device.

Registered through transformers' ``AttentionInterface`` (no model files are edited).
It computes what the stock ``sdpa`` backend computes, but grouped K/V heads never
force the s×s math kernel on CPU (see :mod:`longtrain.ops.sdpa`), so CPU training and
the simulator show the memory a GPU flash kernel would use.
"""

from __future__ import annotations

import contextlib
import contextvars

from transformers import AttentionInterface

from ..ops.sdpa import sdpa_gqa
from . import hf_compat

# The name must not contain "sdpa": transformers applies its SDPA support checks to any
# backend whose name does, and refuses models (Gemma-2) that our backend handles.
NAME = "longtrain_attn"
# The chunked pipeline's backend: inside a pipeline run, attention goes to the run
# (one query chunk against stored earlier chunks); outside one (evaluation,
# generation) it behaves like ``longtrain_attn`` (or eager, for soft-capping).
CHUNKED_NAME = "longtrain_chunked"
_ACTIVE_RUN: contextvars.ContextVar = contextvars.ContextVar("longtrain_chunked_run", default=None)


@contextlib.contextmanager
def chunked_run(run):
    """Route ``longtrain_chunked`` attention calls to ``run.attend(module, q, k, v, **kwargs)``."""
    token = _ACTIVE_RUN.set(run)
    try:
        yield run
    finally:
        _ACTIVE_RUN.reset(token)


def longtrain_attn_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    if kwargs.get("softcap") is not None:
        raise ValueError("longtrain_attn does not support attention logit soft-capping; use attn_implementation='eager'")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]
    out = sdpa_gqa(
        query, key, value, attn_mask=attention_mask, is_causal=is_causal, scale=scaling,
        dropout_p=dropout if module.training else 0.0,
    )
    return out.transpose(1, 2).contiguous(), None


def longtrain_chunked_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    run = _ACTIVE_RUN.get()
    if run is None:
        if kwargs.get("softcap") is not None:  # Gemma-2 outside a run: its own eager attention
            from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

            return eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return longtrain_attn_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout and module.training:
        raise ValueError("the chunked pipeline does not support attention dropout; set attention_dropout=0")
    out = run.attend(module, query, key, value, scaling=scaling, **kwargs)
    return out.transpose(1, 2).contiguous(), None


def _chunked_mask(*args, **kwargs):
    # Inside a pipeline run masks come from positions and the padding mask the run
    # holds, so none is built; outside one, the mask the fallback attention expects.
    from transformers.masking_utils import eager_mask, sdpa_mask

    if _ACTIVE_RUN.get() is not None:
        return None
    config = kwargs.get("config")
    return eager_mask(*args, **kwargs) if getattr(config, "attn_logit_softcapping", None) else sdpa_mask(*args, **kwargs)


def _register() -> None:
    AttentionInterface.register(NAME, longtrain_attn_forward)
    AttentionInterface.register(CHUNKED_NAME, longtrain_chunked_forward)
    try:  # transformers builds masks per backend; ours takes the same masks as sdpa
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

        for name, mask in ((NAME, sdpa_mask), (CHUNKED_NAME, _chunked_mask)):
            AttentionMaskInterface.register(name, mask)
            if name not in ALL_MASK_ATTENTION_FUNCTIONS:
                ALL_MASK_ATTENTION_FUNCTIONS[name] = mask
    except ImportError:  # pragma: no cover - older transformers
        pass


def use_chunked_backend(model) -> None:
    """Route ``model``'s attention through ``longtrain_chunked`` (no model files change)."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter(CHUNKED_NAME)
            return
        except (ValueError, TypeError):  # older transformers refuse unknown names here
            pass
    model.config._attn_implementation = CHUNKED_NAME


def attention_backend(config) -> str:
    """The backend longtrain builds a model with: ours, or eager where the model needs
    attention logit soft-capping (Gemma-2), which no SDPA kernel implements."""
    if getattr(config, "attn_logit_softcapping", None):
        return "eager"
    return NAME


_register()
hf_compat.install()
