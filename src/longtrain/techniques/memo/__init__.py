"""``memo``: token-wise activation swapping and recomputation (the Memo paper, §4.1).

Each decoder layer keeps its input and its attention output (and the attention's
log-sum-exp) in host memory; of every other tensor it saves for backward, a fraction
``alpha`` of the tokens goes to host memory too and the rest is recomputed in backward
— by running the layer on those tokens alone with the kept attention output standing
in for attention (:mod:`longtrain.memory.token_swap`). So attention runs once per layer
forward whatever ``alpha`` is, and with ``alpha = 1`` no layer op runs twice. The last
``keep_last`` layers keep what they save on the device: their backward starts at once.

``alpha="auto"`` is Memo's rule (DESIGN.md): the largest α whose copies hide under one
layer's forward and whose host bytes fit the host budget,

    α = min( (B·T_layer − S_in − S_attn) / S_others,
             (M_host / (n − keep_last) − S_in − S_attn) / S_others )  clipped to [0, 1],

with the sizes S measured on the second layer of the first step (both run with α = 0),
one layer's forward time T_layer by one more forward of that layer with nothing saved
or parked (the first layer has paid the kernels' one-time costs, and the training
forward's time would include page-locking its host buffers), and the host bandwidth B
measured by one copy of that layer's input. Under the simulator (fake tensors) nothing can be timed: the
layer time comes from its FLOPs at :data:`DEFAULT_FLOPS_PER_S` and the bandwidth is
:data:`DEFAULT_HOST_BANDWIDTH`. The chosen α and what it came from are reported in the
engine context's notes (the trainer's summary shows them).

The package: ``options.py`` (:class:`MemoOptions`), ``install.py`` (the patched layer
forward), ``layers.py`` (:class:`MemoLayers`: the hooks, the token-wise recomputation and
the measurement of α), ``costs.py`` (:func:`memo_alpha`, :class:`MemoCosts`).
"""

from __future__ import annotations

from ...registry import TechniqueSpec, register
from .costs import MemoCosts, memo_alpha  # noqa: F401
from .install import install_memo
from .layers import DEFAULT_FLOPS_PER_S, DEFAULT_HOST_BANDWIDTH, MemoLayers  # noqa: F401
from .options import MemoOptions

register(TechniqueSpec(
    name="memo",
    options=MemoOptions,
    install=install_memo,
    summary="token-wise activation swapping to host + recomputation without attention (exact)",
    excludes={
        "checkpoint": "memo already recomputes what it does not swap; drop 'checkpoint'",
        "liger": "memo learns what a layer saves from a run on fake tensors, which Liger's Triton kernels "
                 "cannot take; drop 'liger' or use checkpoint,mst,liger"},
    costs=MemoCosts(),
    sequence_parallel=False,
))
