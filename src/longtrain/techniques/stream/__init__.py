"""``stream``: frozen layer weights kept in host memory, a layer's brought to the device
while it computes.

Under LoRA (or with frozen experts) most of a model's bytes do not train: Qwen3-30B-A3B's
54 GiB of expert matrices sit on an 80 GB card beside a long context that no longer fits.
``stream`` keeps every decoder layer's frozen parameters in pinned host memory and on the
device only the layer computing and the next ``ahead`` (default 1), copied on a side
stream while this one runs — in the forward, in checkpointing's recomputation and in the
backward (up the model, then down). The autograd graph keeps references to the weights,
not the weights (:mod:`longtrain.memory.weight_stream`), so nothing pins a layer's copy
past its turn. The step is bit for bit the unstreamed one: the same values meet the same
ops. What it costs is host-to-device traffic: each layer's frozen bytes once per forward
and once per backward (per chunk under SeCO/SpaCO, which run layer by layer in each).

The package: ``options.py`` (:class:`StreamOptions`), ``install.py`` (the hooks),
``costs.py`` (:class:`StreamCosts`).
"""

from __future__ import annotations

from ...registry import TechniqueSpec, register
from .costs import StreamCosts
from .install import frozen_groups, install_stream  # noqa: F401
from .options import StreamOptions

__all__ = ["StreamOptions"]

register(TechniqueSpec(
    name="stream",
    options=StreamOptions,
    install=install_stream,
    summary="frozen layer weights in host memory, each layer's fetched ahead of use (exact)",
    costs=StreamCosts(),
    sequence_parallel=False,
))
