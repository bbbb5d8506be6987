"""What plans and simulations ask of ``memo``: α by Memo's rule (:func:`memo_alpha`, which
also refuses a step whose inputs and attention outputs cannot all fit the host budget) and
:class:`MemoCosts` (what a step parks and recomputes, the copies left exposed)."""

from __future__ import annotations

import dataclasses

from ...costs import StepWork, TechniqueCosts
from ...errors import LongtrainError
from ...memory.units import format_bytes
from ...models.adapters import describe_model
from ...models.kept_attention import kept_layers_that_fit
from .options import MemoOptions


def memo_alpha(*, input_bytes: float, attention_bytes: float, other_bytes: float, bandwidth: float,
               layer_seconds: float, layers: int, host_budget: float, keep_last: int = 2) -> float:
    """Memo's α (the rule in :mod:`longtrain.techniques.memo`): the largest fraction of the
    other saved tensors' tokens that can go to host memory without exposing copies or
    exceeding the budget."""
    swapped_layers = max(1, layers - keep_last)
    always = input_bytes + attention_bytes
    # The inputs first (a layer needs its input to recompute), then the attention outputs: every one must fit.
    if kept_layers_that_fit(swapped_layers, host_budget, swapped_layers * input_bytes, attention_bytes) < swapped_layers:
        raise LongtrainError(
            f"memo keeps every layer's input and attention output in host memory: {swapped_layers} layers × "
            f"{format_bytes(always)} = {format_bytes(swapped_layers * always)}, over the host budget of "
            f"{format_bytes(host_budget)}; raise memo:host_memory, shorten the sequence, or use another strategy"
        )
    if other_bytes <= 0:
        return 1.0
    by_time = (bandwidth * layer_seconds - always) / other_bytes
    by_host = (host_budget / swapped_layers - always) / other_bytes
    return float(min(1.0, max(0.0, min(by_time, by_host))))


class MemoCosts(TechniqueCosts):
    """Memo: every layer's input and attention output in host memory, an α share of the
    rest; backward recomputes the (1 − α) share token-wise, never attention."""

    host_budget_option = "host_memory"

    decides_at_first_step = True  # α is chosen from the first step's sizes

    def layers_apart_at_top(self, options: MemoOptions) -> int:
        return options.keep_last

    def small_options(self, options: MemoOptions, layers: int, full: int):
        """The budget of the layers below ``keep_last`` scaled to those simulated, so α is the full model's."""
        budget, top = options.host_memory, options.keep_last
        share = None if budget is None else max(1, budget * max(1, layers - top) // max(1, full - top))
        return dataclasses.replace(options, host_memory=share)

    def full_notes(self, options: MemoOptions, notes: dict) -> None:
        if "memo_host_budget" in notes:
            notes["memo_host_budget"] = options.host_memory  # the small simulations' is a share of it

    def parked(self, config, seq_len, options: MemoOptions, item, batch, engine_offloads):
        shape = describe_model(config)
        return 0, shape.layers * batch * seq_len * shape.hidden * item  # inputs, with more

    def fragmentation(self, options: MemoOptions) -> str:
        return "offload"

    def with_host_budget(self, options: MemoOptions, room: int):
        return dataclasses.replace(options, host_memory=max(1, room))

    def candidates(self, host_memory):
        return {"memo": {"host_memory": host_memory}}

    def serves(self, adapter_class, options) -> bool:
        return adapter_class.has_attention  # it keeps attention outputs

    def describe(self, work: StepWork, options: MemoOptions) -> None:
        work.mlp_forward_charged = True

    def add_work(self, work: StepWork, options: MemoOptions) -> None:
        notes = work.notes
        alpha = notes.get("memo_alpha", options.alpha if options.alpha != "auto" else 0.0)
        # The (1 − α) share of the token-wise forward again; with tiled MLPs, the tiled
        # backward's forward once more (where a recomputation reads the MLP, as checkpointing's
        # third MLP forward): at α = 0 Memo is checkpointing with attention kept, predicted as such.
        work.add_layer_forwards(1 - alpha)
        if work.tiled_mlp:
            work.add_mlp_forwards(1)
        if "memo_input_bytes" in notes:
            moved = notes["memo_input_bytes"] + notes["memo_attention_bytes"] + alpha * notes["memo_other_bytes"]
            n = work.layers
            layer_seconds = (work.layer_fwd / n + work.attention_fwd / n) / work.rates.matmul
            work.exposed = n * max(0.0, moved / work.rates.host_bandwidth - layer_seconds)
