"""The ``backprop`` engine: one forward and one backward over the whole sequence.
:mod:`.schedule` runs a step, :mod:`.costs` says what it costs, :mod:`.options` holds its
(no) knobs."""

from ...registry import EngineSpec, register
from .costs import BackpropCosts
from .options import BackpropOptions
from .schedule import backprop_step, forward_loss

__all__ = ["BackpropOptions", "backprop_step", "forward_loss", "SPEC"]

SPEC = register(EngineSpec(
    "backprop", BackpropOptions, backprop_step, "plain autograd over the whole sequence",
    accepts=("checkpoint", "mst", "memo", "liger", "stream"), sequence_parallel=True, costs=BackpropCosts()))
