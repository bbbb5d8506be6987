"""The language-model loss of a model: full logits by default, or the head-and-loss
function a technique installed (MsT installs one that never materializes logits)."""

from __future__ import annotations

from ..ops.loss import causal_lm_loss

_HEAD_LOSS_ATTR = "_longtrain_head_loss"


def set_head_loss(model, fn) -> None:
    """Install ``fn(input_ids, attention_mask, labels, num_label_tokens) -> loss`` on ``model``."""
    object.__setattr__(model, _HEAD_LOSS_ATTR, fn)


def lm_loss(model, input_ids, attention_mask, labels, num_label_tokens):
    """Sum of next-token losses divided by ``num_label_tokens``."""
    head_loss = getattr(model, _HEAD_LOSS_ATTR, None)
    if head_loss is not None:
        return head_loss(input_ids, attention_mask, labels, num_label_tokens)
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return causal_lm_loss(out.logits, labels, num_label_tokens)
