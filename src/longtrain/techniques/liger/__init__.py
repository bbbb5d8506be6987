"""``liger``: Liger's fused kernels for the elementwise ops of every layer (CUDA).

Hugging Face runs RMSNorm, the gated activation and the rotary embedding as chains of
PyTorch ops (RMSNorm alone: an upcast, a square, a mean, a reciprocal square root, two
products and a downcast), each a pass over a hidden-state-sized tensor in forward, again
in a checkpointed layer's recomputation, and more in backward; at long context those
passes are a noticeable share of the step. Liger's Triton kernels do each chain in one
pass (docs/speed.md has a profile). This technique asks liger-kernel to patch the model's
norms, MLPs and rotary embedding — its own per-family patcher, with its loss patches off:
MsT's chunked head stays the loss.

The kernels compute the same function with fewer roundings (a float32 silu·up, for one);
they are Triton-only, so they run on CUDA and their exactness is checked there
(tests/test_cuda.py) against float64 stock autograd. Installed before MsT, so MsT tiles
Liger's MLP.

The package: ``options.py`` (:class:`LigerOptions`), ``install.py`` (the patching),
``costs.py`` (:func:`liger_available`, :class:`LigerCosts`).
"""

from __future__ import annotations

from ...registry import TechniqueSpec, register
from .costs import LigerCosts, liger_available  # noqa: F401
from .install import install_liger
from .options import LigerOptions

__all__ = ["LigerOptions", "liger_available"]

register(TechniqueSpec(
    name="liger",
    options=LigerOptions,
    install=install_liger,
    summary="Liger's fused RMSNorm, gated-MLP and rotary kernels (CUDA)",
    costs=LigerCosts(),
))
