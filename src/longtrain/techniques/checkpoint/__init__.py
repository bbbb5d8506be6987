"""``checkpoint``: per-layer activation checkpointing (non-reentrant).

Each decoder block keeps only its input during the forward pass and recomputes its
internals in the backward pass. We patch the block's ``forward`` on the instance rather
than wrapping the module, so parameter names (and therefore checkpoints and LoRA
targets) are unchanged. Everything a block's attention needs arrives as an argument
(the engine's attention call), so the recomputation — which CUDA runs on autograd's
device thread — sees exactly what the forward saw.

Attention is not recomputed (``keep_attention``, on by default): the forward keeps each
layer's attention output and log-sum-exp — one hidden-state-sized tensor per layer, in
pinned host memory with ``offload`` — and the recomputation reads them back instead of
running attention's forward again; the previous layer's are fetched while this one's
backward runs. Attention is the one op of a layer whose cost grows with the sequence
squared, so at long context this saves much of the step (the forward, the recomputation
and the backward's two passes become forward and backward).
Layers whose outputs would pass ``host_memory`` recompute as before; attention calls
that cannot give their output (chunked engines' calls) recompute too.

``offload_inputs`` parks each checkpointed layer's input in pinned host memory too (what
Hugging Face runs as ``save_on_cpu`` around checkpointing), fetched a layer ahead in
backward: device memory no longer grows by one hidden state per layer, which is what
lets whole-sequence checkpointing run where only chunked attention did. Inputs come
first in the host budget — a layer needs its input to recompute, its attention output
only saves time — so outputs are kept while the inputs of the layers still to run would
fit beside them; an input past the budget stays on the device.

``except_last`` leaves the top layers whole: not checkpointed, their MLP not tiled by MsT
(a tiled MLP recomputes its forward), nothing of theirs recomputed. Each costs one
layer's activations in device memory and saves its recomputation. Where the device has
room beside the checkpointed inputs — short and medium contexts — that is the fastest
exact schedule; ``longtrain plan`` (and ``--strategy auto``) sizes it by simulating the
step. The top layers rather than the bottom ones: their backward runs first, so their
activations are freed before any recomputation needs room (bottom layers' would sit
under every one).

The package: ``options.py`` (:class:`CheckpointOptions`), ``install.py`` (the patched
forward, :class:`CheckpointLayers`), ``costs.py`` (:class:`CheckpointCosts`,
:func:`kept_output_share`, :func:`whole_layers`).
"""

from __future__ import annotations

from ...registry import TechniqueSpec, register
from .costs import CheckpointCosts, kept_output_share, whole_layers  # noqa: F401
from .install import CheckpointLayers, install_checkpoint  # noqa: F401
from .options import CheckpointOptions

register(TechniqueSpec(
    name="checkpoint",
    options=CheckpointOptions,
    install=install_checkpoint,
    summary="per-layer activation checkpointing (attention kept, not recomputed)",
    costs=CheckpointCosts(),
))
