"""``mst``: mini-sequence MLP and LM-head + loss (Mini-Sequence Transformer).

In long-sequence training the MLP and the LM head create intermediates far larger than
their inputs (2·I/d ≈ 7× and V/d ≈ 32× for Llama-3). MsT processes both in
mini-sequences so only one chunk's intermediates are alive, in forward and backward:

- every decoder layer's MLP (the adapter names it) is patched to run through
  :func:`~longtrain.ops.tiled_mlp.tiled_mlp`, in chunks of ``mlp_chunk`` tokens —
  by default the hidden size (the paper's rule), or half the chunk of a chunked engine
  (FPDT's rule, which keeps attention the memory peak); layers that checkpointing leaves
  whole (``checkpoint:except_last``) keep their MLP whole, since a tiled MLP recomputes its
  forward and those layers are there to recompute nothing;
- the head and the loss run through
  :func:`~longtrain.ops.chunked_loss.chunked_causal_lm_loss` in ``loss_chunks``
  mini-sequences (default V/d, the paper's rule), so the logits never exist in full.
  That is a choice of loss head every engine reads from the strategy
  (:meth:`~longtrain.engines.base.EngineContext.head_loss`); it needs the head as a
  plain linear layer, which is checked here, once.

The package: ``options.py`` (:class:`MsTOptions`), ``install.py`` (the tiled MLP forward),
``costs.py`` (:class:`MsTCosts`).
"""

from __future__ import annotations

from ...registry import TechniqueSpec, register
from .costs import MsTCosts
from .install import default_mlp_chunk, install_mst  # noqa: F401
from .options import MsTOptions

__all__ = ["MsTOptions"]

register(TechniqueSpec(
    name="mst",
    options=MsTOptions,
    install=install_mst,
    summary="mini-sequence MLP and LM-head + loss (exact)",
    costs=MsTCosts(),
))
