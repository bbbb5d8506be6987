"""``liger``'s options: which of Liger's kernels replace the stock ops (validated when built)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import validate


@dataclass
class LigerOptions:
    """Which of Liger's kernels to use."""

    rms_norm: bool = True  # fused RMSNorm (forward and backward)
    mlp: bool = True  # fused gated activation: SwiGLU, or GeGLU for Gemma
    rope: bool = True  # fused rotary embedding of q and k

    def __post_init__(self):
        for name in ("rms_norm", "mlp", "rope"):
            validate.flag("liger", name, getattr(self, name))
