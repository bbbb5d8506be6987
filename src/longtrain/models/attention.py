"""Hugging Face attention backend ``longtrain_attn``: how longtrain's engines reach attention.

Registered through transformers' ``AttentionInterface`` (no model files are edited).
A Hugging Face attention module computes q, k, v (projections, norms, rotary tables)
and hands them, with whatever its layer received as ``attention_mask``, to the backend.
longtrain's engines run layers through the model's adapter and pass an
:class:`AttentionCall` in place of the mask; the backend gives it q, k, v, the module's
scale, window and soft-cap, and it answers with the attention output. So the call
travels as an argument: a checkpointed layer replays with the same call, and the
backward — which CUDA runs on autograd's own device thread — needs no state of the
thread that ran the forward.

Called by Hugging Face's own forward (evaluation, generation) with a tensor mask, the
backend computes what the stock ``sdpa`` backend computes (or Gemma-2's eager attention
where logits are soft-capped), with flash-kernel memory on CPU too (:mod:`longtrain.ops.sdpa`).
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface

from ..errors import LongtrainError
from ..ops.causal_attention import (
    UNREAD,
    attention_plan,
    causal_attention,
    causal_attention_backward,
    causal_attention_forward,
    needs_blocks,
    read_spans,
)
from ..ops.masking import BlockPlanner, SequenceMask
from ..ops.sdpa import sdpa_gqa

# The name must not contain "sdpa": transformers applies its SDPA support checks to any
# backend whose name does, and refuses models (Gemma-2) that our backend handles.
NAME = "longtrain_attn"


class KeysParked(Exception):
    """Raised by a call that wanted only the layer's keys and values (a chunked engine
    parking them again in backward): the rest of the attention sub-block — the output
    projection of an output nobody reads — is skipped (caught by the adapter's
    ``run_attention``)."""


class AttentionCall:
    """What an engine passes to a layer as its ``attention_mask``: it receives the layer's
    q (B, H, S, D), k, v (B, H_kv, S, D) and returns the output (B, H, S, D). ``sink``:
    the layer's (H,) attention sinks where it has them (gpt-oss; :mod:`longtrain.ops.attention_sinks`)."""

    mask: SequenceMask
    # (B, T) of the tokens of the layer this call serves: 1 for a real token, 0 for padding
    # (what statistics over real tokens count: a router's balancing loss); None: all real.
    rows: torch.Tensor | None = None

    def attend(self, module, q, k, v, *, scale: float | None, window: int | None, softcap: float | None,
               sink: torch.Tensor | None = None):
        raise NotImplementedError

    def attend_keeping_output(self, module, q, k, v, *, scale, window, softcap, sink=None):
        """``(out, lse, backward)``: the output and log-sum-exp computed once without
        autograd, and ``backward(grad_out, q, k, v, out, lse) -> (dq, dk, dv)``. For
        techniques that keep attention's output instead of recomputing it (Memo);
        calls that cannot give it raise :class:`NotImplementedError`."""
        raise NotImplementedError


class WholeSequenceAttention(AttentionCall):
    """Causal attention over the whole sequence (the ``backprop`` engine's call)."""

    def __init__(self, mask: SequenceMask, rows: torch.Tensor | None = None):
        self.mask, self.rows = mask, rows
        # Read from the mask once per step and shared by every layer: the documents (fused
        # calls per document) and the block decisions (masked blocks), each made when first needed.
        self._spans = UNREAD
        self._block_planner: BlockPlanner | None = None

    def _plan(self, q, window, softcap):
        if not needs_blocks(self.mask, window, softcap, q.shape[2]):
            return attention_plan(q, self.mask, window, softcap)
        if self._spans is UNREAD:
            self._spans = read_spans(q, self.mask, softcap)
        plan = attention_plan(q, self.mask, window, softcap, spans=self._spans, planner=self._block_planner)
        if isinstance(plan, BlockPlanner):
            self._block_planner = plan
        return plan

    def attend(self, module, q, k, v, *, scale, window, softcap, sink=None):
        return causal_attention(q, k, v, mask=self.mask, window=window, scale=scale, softcap=softcap,
                                plan=self._plan(q, window, softcap), sink=sink)

    def attend_keeping_output(self, module, q, k, v, *, scale, window, softcap, sink=None):
        settings = dict(mask=self.mask, window=window, scale=scale, softcap=softcap, plan=self._plan(q, window, softcap))
        out, lse = causal_attention_forward(q, k, v, sink=sink, **settings)
        return out, lse, functools.partial(causal_attention_backward, **settings)


def _autocast_inputs(*tensors):
    """q, k, v as autocast would hand them to stock SDPA: in autocast's dtype where it is on
    (rotary tables in float32 leave q and k in float32 while v is in bfloat16); float64 stays."""
    kind = tensors[0].device.type
    if kind not in ("cpu", "cuda") or not torch.is_autocast_enabled(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def longtrain_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, softcap=None, s_aux=None, **kwargs):
    query, key, value = _autocast_inputs(query, key, value)
    if isinstance(attention_mask, AttentionCall):
        if dropout and module.training:
            raise LongtrainError("longtrain's engines do not support attention dropout; set attention_dropout=0 in the model config")
        out = attention_mask.attend(module, query, key, value, scale=scaling, window=sliding_window, softcap=softcap,
                                    sink=s_aux)
        return out.transpose(1, 2).contiguous(), None
    return _stock_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                            s_aux=s_aux, **kwargs)


def _stock_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, s_aux=None,
                     **kwargs):
    """What transformers' own backends compute, for Hugging Face's own forward."""
    if s_aux is not None:  # gpt-oss's sinks: its eager attention (no SDPA kernel takes them)
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

        return eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       sliding_window=sliding_window, **kwargs)
    if softcap is not None:  # Gemma-2: its eager attention (no SDPA kernel soft-caps)
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

        return eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       sliding_window=sliding_window, softcap=softcap, **kwargs)
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]
    out = sdpa_gqa(query, key, value, attn_mask=attention_mask, is_causal=is_causal, scale=scaling,
                   dropout_p=dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def _mask_for_stock_forward(*args, **kwargs):
    # Hugging Face builds the mask the fallback expects: additive for eager
    # (soft-capped Gemma-2), boolean as for sdpa otherwise.
    from transformers.masking_utils import eager_mask, sdpa_mask

    eager = stock_attention(kwargs.get("config")) == "eager"
    return eager_mask(*args, **kwargs) if eager else sdpa_mask(*args, **kwargs)


def stock_attention(config) -> str:
    """The attention Hugging Face trains ``config``'s model with: ``"eager"`` where logits are
    soft-capped (Gemma-2) or the model has no SDPA path (gpt-oss's sinks), else ``"sdpa"``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None) if config is not None else None
    sdpa = getattr(model_class, "_supports_sdpa", True)
    return "eager" if getattr(config, "attn_logit_softcapping", None) or not sdpa else "sdpa"


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, longtrain_attention)
    AttentionMaskInterface.register(NAME, _mask_for_stock_forward)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS[NAME] = _mask_for_stock_forward


def use_longtrain_attention(model) -> None:
    """Route ``model``'s attention through ``longtrain_attn`` (no model files change)."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter(NAME)
            return
        except (ValueError, TypeError):
            pass
    model.config._attn_implementation = NAME


_register()
