"""What plans and simulations ask of the chunked engines (:mod:`longtrain.costs`), and the
byte formulas their runs share: what a chunked step parks in host memory
(:func:`parked_host_bytes`) and how many layers keep their attention outputs
(:func:`outputs_that_fit`). Each engine's own costs subclass :class:`ChunkedCosts`."""

from __future__ import annotations

from typing import Callable

from ...costs import EngineCosts, StepWork
from ...models.adapters import describe_model
from ...models.kept_attention import kept_layers_that_fit
from ...models.shapes import head_dim, kept_output_bytes, kv_bytes_per_token
from .settings import ChunkSettings

__all__ = ["ChunkedCosts", "outputs_that_fit", "parked_host_bytes", "planned_kept_outputs"]


def parked_host_bytes(config, batch: int, length: int, item: int, settings: ChunkSettings, kept_outputs: int, *,
                      kv_heads: int | None = None, kv_length: int | None = None, position_rows: int = 1) -> int:
    """:func:`~longtrain.engines.chunked.run.host_bytes_needed` from the model's config and the batch's shape (what the
    planner knows): ``item`` bytes per element, ``kv_heads``/``kv_length`` this rank's
    K/V heads and their sequence length (default: the model's, ``length``)."""
    n = describe_model(config).layers
    kv = batch * (kv_length or length) * kv_bytes_per_token(config, item, kv_heads)
    # With segments: the parked segment inputs, plus one segment's inner inputs in backward.
    parked_layers = n if settings.segment <= 1 else -(-n // settings.segment) + settings.segment - 1
    inputs = parked_layers * batch * length * describe_model(config).hidden * item + 2 * position_rows * length * head_dim(config) * item
    # K/V of every layer (one with recompute_kv), and in backward the K/V-gradient sums of the
    # layer running (layer-major) or of every layer (chunk-major: each chunk's backward reaches them all).
    kv_layers = (1 if settings.recompute_kv else n) + (n if settings.chunk_major else 1)
    inputs += kept_outputs * kept_output_bytes(config, batch, length, item)
    return kv_layers * kv * settings.offload + inputs * settings.offload_inputs


def outputs_that_fit(keep_output: bool | int | str, layers: int, offload_inputs: bool, budget: int | None,
                     parked_with: Callable[[int], int]) -> int:
    """How many layers (the lowest) park their attention output: none (False), every one
    (True), N (an integer), or for ``"fit"`` as many as ``budget`` holds — ``parked_with(k)``
    being what the step parks with k layers' outputs — in host memory only (none with the
    inputs on the device: FPDT's point is device memory); every layer where the budget is
    unbounded (None)."""
    if keep_output != "fit":
        return layers if keep_output is True else min(int(keep_output), layers)
    if not offload_inputs:
        return 0
    if budget is None:
        return layers
    parked = parked_with(0)
    return kept_layers_that_fit(layers, budget, parked, max(1, parked_with(1) - parked))


def planned_kept_outputs(config, length: int, settings: ChunkSettings, item: int, batch: int = 1) -> int:
    """:func:`~longtrain.engines.chunked.run.kept_output_layers` from the model's config (the planner's and the time
    model's view of a step of ``batch`` × ``length`` tokens, ``item`` bytes per element): a
    ``"fit"`` without ``host_budget`` keeps every layer, as a simulation does."""
    return outputs_that_fit(settings.keep_output, describe_model(config).layers, settings.offload_inputs,
                            settings.host_budget, lambda kept: parked_host_bytes(config, batch, length, item, settings, kept))


class ChunkedCosts(EngineCosts):
    """An engine that runs the sequence in chunks of ``options.chunk`` tokens and recomputes
    every layer's forward in backward, chunk by chunk (as checkpointing does)."""

    attention_rate = "block_attention"  # the MachineRates field its attention kernels run at
    extends_along_tokens = False  # along its chunks instead (chunk())
    host_budget_option = "host_memory"

    def parks_on_host(self, options) -> bool:
        return options.settings().offload

    def fragmentation(self, options) -> str:
        settings = options.settings()
        return "offload" if settings.offload or settings.offload_inputs else "chunked"

    def serves(self, adapter_class, options) -> bool:
        return adapter_class.has_attention  # chunked attention

    def chunk(self, options) -> int | None:
        return options.chunk

    def describe(self, work: StepWork, options) -> None:
        work.chunk = options.chunk
        work.recomputes_layers = True
        work.mlp_forward_charged = True  # the recomputed chunk's MLP output is read by the next layer
        work.attention_rate = getattr(work.rates, self.attention_rate)
