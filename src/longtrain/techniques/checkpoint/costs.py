"""What plans and simulations ask of ``checkpoint``: which layers are left whole, the share
of checkpointed layers whose attention output is kept within the host budget, and
:class:`CheckpointCosts` (what a step parks, recomputes and skips)."""

from __future__ import annotations

import dataclasses

from ...costs import StepWork, TechniqueCosts
from ...models.adapters import describe_model
from ...models.kept_attention import kept_layers_that_fit
from ...models.shapes import kept_output_bytes
from .options import CheckpointOptions


def whole_layers(strategy, layers: int) -> range:
    """Indices of the layers ``strategy``'s checkpointing leaves whole (``except_last``): no
    recomputation there, so MsT leaves their MLP untiled too."""
    options = strategy.techniques.get("checkpoint")
    keep = min(options.except_last, layers) if options is not None else 0
    return range(layers - keep, layers)


def kept_output_share(config, tokens: int, checkpoint) -> float:
    """The share of checkpointed layers whose attention output is kept (their recomputation
    skips attention's forward): all of them on the device; in host memory, as many as
    ``host_memory`` holds beside the parked inputs (``offload_inputs``), which come first —
    a budget not given is not this machine's default but unknown, taken as enough (a plan
    always gives one). ``tokens``: of the whole batch; activations in bf16."""
    if checkpoint is None or not checkpoint.keep_attention:
        return 0.0
    if not checkpoint.offload or checkpoint.host_memory is None:
        return 1.0
    layers = describe_model(config).layers - min(checkpoint.except_last, describe_model(config).layers)
    if layers <= 0:
        return 1.0
    item = 2
    output = tokens * (describe_model(config).attention_width * item + describe_model(config).heads * 4)  # and its float32 LSE
    inputs = describe_model(config).layer_inputs_bytes(tokens, item, layers) if checkpoint.offload_inputs else 0
    return kept_layers_that_fit(layers, checkpoint.host_memory, inputs, output) / layers


class CheckpointCosts(TechniqueCosts):
    """Checkpointing: every layer's input parked (in host memory with ``offload_inputs``,
    first in the host budget), each layer's forward once more in backward, attention's
    skipped where its output is kept; ``except_last`` top layers left whole."""

    host_budget_option = "host_memory"

    def budget_stops_layers(self, options, config, batch: int, tokens: int, item: int) -> bool:
        wanted, budget = options.host_bytes_wanted(config, batch, tokens, item), options.host_memory
        return budget is not None and wanted > budget

    def serves(self, adapter_class, options) -> bool:
        # Where kept outputs wait matters only to a model with attention (candidates() holds options as mappings).
        return adapter_class.has_attention or not (isinstance(options, dict) and options.get("offload") is False)

    def layers_apart_at_top(self, options: CheckpointOptions) -> int:
        return options.except_last

    def small_options(self, options: CheckpointOptions, layers: int, full: int):
        # Fewer layers than the whole model are simulated only where the budget stops none.
        return dataclasses.replace(options, host_memory=None) if layers < full else options

    def parked(self, config, seq_len, options: CheckpointOptions, item, batch, engine_offloads):
        inputs = describe_model(config).layer_inputs_bytes(batch * seq_len, item)
        # Kept outputs on the device (offload=false) are parked there too, every checkpointed layer's.
        layers = describe_model(config).layers - min(options.except_last, describe_model(config).layers)
        kept = layers * kept_output_bytes(config, batch, seq_len, item) if options.keep_attention and not options.offload else 0
        if options.offload_inputs:
            on_host = inputs if options.host_memory is None else min(inputs, options.host_memory)
            return inputs - on_host + kept, on_host
        return (0, inputs) if engine_offloads else (inputs + kept, 0)

    def with_host_budget(self, options: CheckpointOptions, room: int):
        return options if options.host_memory is None else dataclasses.replace(options, host_memory=max(1, room))

    def candidates(self, host_memory):
        budget = {"host_memory": host_memory} if host_memory else {}
        # Kept attention outputs wait in host memory within the budget; with offload_inputs the
        # checkpointed inputs too, first (whole-sequence layers past where their inputs fit the device);
        # offload=false keeps the outputs on the device (no host copies, where the device has room:
        # the selective checkpointing experts run).
        return {"checkpoint": budget or True, "checkpoint:offload_inputs": {"offload_inputs": True, **budget},
                "checkpoint:offload=false": {"offload": False}}

    def with_whole_layers(self, options: CheckpointOptions, count):
        return dataclasses.replace(options, except_last=count)

    def describe(self, work: StepWork, options: CheckpointOptions) -> None:
        n = work.layers
        work.recomputes_layers = True
        work.mlp_forward_charged = True
        # Layers left whole (except_last) recompute nothing, their MLP untiled.
        work.recomputed = 1.0 - (min(options.except_last, n) / n if n else 0.0)
        work.kept_attention = 0.0 if work.chunk else kept_output_share(work.config, work.tokens * work.batch, options)

    def add_work(self, work: StepWork, options: CheckpointOptions) -> None:
        # Kept outputs in host memory go there in the forward and come back in the backward, and
        # offload_inputs' parked inputs too; the share of those copies compute does not hide is
        # FPDT's (offload_exposed: the same side streams, fitted on its H100 rows).
        if work.chunk:
            return
        n = round(work.recomputed * work.layers)
        tokens = work.tokens * work.batch // work.sequence_parallel
        moved = 0.0
        if options.keep_attention and options.offload:
            moved += work.kept_attention * n * kept_output_bytes(work.config, 1, tokens, 2)
        if options.offload_inputs:
            moved += describe_model(work.config).layer_inputs_bytes(tokens, 2, n)
        work.exposed += work.sequence_parallel * work.rates.offload_exposed * 2 * moved / work.rates.host_bandwidth
