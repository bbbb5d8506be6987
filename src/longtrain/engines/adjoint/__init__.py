"""The ``adjoint`` engine: adjoint sharding for state-space models (SSM-ResNet, Mamba):
token-wise VJPs, no backpropagation-through-time graph; exact or truncated.
:mod:`.schedule` runs a step, :mod:`.costs` says what it costs, :mod:`.options` holds its
knobs."""

from ...parallel.layer_groups import shard_model
from ...registry import EngineSpec, register
from .costs import AdjointCosts
from .options import AdjointOptions
from .schedule import AdjointStats, adjoint_step, check_model, truncated_adjoint_states

__all__ = ["AdjointOptions", "AdjointStats", "adjoint_step", "truncated_adjoint_states", "SPEC"]

_OWN_MEMORY = "the adjoint engine keeps only each layer's input and runs its head in mini-sequences already"

SPEC = register(EngineSpec(
    "adjoint", AdjointOptions, adjoint_step,
    "adjoint sharding for state-space models (SSM-ResNet, Mamba): token-wise VJPs, no BPTT graph; exact or truncated",
    conflicts={"checkpoint": _OWN_MEMORY + "; drop 'checkpoint'", "mst": _OWN_MEMORY + "; drop 'mst'"},
    check=lambda context: check_model(context.model), costs=AdjointCosts(), layer_groups=shard_model))
