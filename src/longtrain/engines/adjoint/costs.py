"""What plans and simulations ask of the adjoint engine (:mod:`longtrain.costs`)."""

from __future__ import annotations

from ...costs import EngineCosts, StepWork
from ...models.adapters import describe_model
from .options import AdjointOptions

__all__ = ["AdjointCosts"]


class AdjointCosts(EngineCosts):
    """Layer by layer, each layer's VJPs token-wise: simulations extrapolate along the layers
    where the model's adapter allows (Mamba), whole where it says so (SSM-ResNet); not along
    tokens (its VJP blocks grow with one layer's input). Plans weigh it, exact, for models
    whose layers are recurrences: states recomputed layer by layer, and kept."""

    extends_along_tokens = False

    def serves(self, adapter_class, options) -> bool:
        return getattr(adapter_class, "recurrence", None) is not None

    def candidates(self, seq_len, host_memory, layers, every_chunk, chunks) -> dict[str, dict]:
        return {"adjoint": {}, "adjoint:offload_inputs": {"offload_inputs": True},
                "adjoint:recompute=false": {"recompute": False}}

    def parks_on_host(self, options: AdjointOptions) -> bool:
        return options.offload_inputs

    def fragmentation(self, options: AdjointOptions) -> str:
        return "whole"  # fetched inputs are allocated on the compute stream, as checkpointing's are

    def parked(self, config, seq_len, options: AdjointOptions, item, batch) -> tuple[int, int]:
        """Every layer's input (with ``offload_inputs`` all but the top one in host memory)."""
        shape = describe_model(config)
        inputs = shape.layer_inputs_bytes(batch * seq_len, item)
        host = shape.layer_inputs_bytes(batch * seq_len, item, shape.layers - 1) if options.offload_inputs else 0
        return inputs - host, host

    def describe(self, work: StepWork, options: AdjointOptions) -> None:
        work.recomputes_layers = True  # each VJP block runs its tokens' projections again
        work.chunked_head = True  # the loss in mini-sequences

    def add_work(self, work: StepWork, options: AdjointOptions) -> None:
        if options.recompute:  # and the layer's states rebuilt before its VJPs
            work.add_layer_forwards(1)
