"""What the simulator, the time model and the planner ask of an engine or a technique.

Each engine and technique registers a costs object with :mod:`longtrain.registry` — a
subclass of :class:`EngineCosts` or :class:`TechniqueCosts` that overrides what differs
from plain autograd over the whole sequence. :mod:`longtrain.plan` asks only these
objects, so a new engine or technique is simulated, timed and planned without a change
there. Every hook receives the options dataclass of its own engine or technique.

Sizes are in bytes; ``item`` is the activation dtype's element size; ``seq_len`` and
``tokens`` count one sequence, ``batch`` sequences per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from .models.adapters import describe_model
from .ops.attention_blocks import cudnn_takes

__all__ = ["EngineCosts", "HostBudgetKnob", "TechniqueCosts", "StepWork", "PARKED_NOTHING"]

PARKED_NOTHING = (0, 0)  # (device bytes, host bytes)


@dataclass
class StepWork:
    """One step's work as the time model counts it (``longtrain.plan.time_model``).

    Sizes in forward FLOPs (``*_fwd``: one forward pass over the batch's tokens); the
    hooks add to ``matmul`` (FLOPs), ``attention_passes`` (in units of attention's
    forward) and ``exposed`` (seconds of host copies compute does not hide), and count the
    layers' and MLPs' forwards run again with :meth:`add_layer_forwards` and
    :meth:`add_mlp_forwards` (their matmuls and their elementwise kernels). The facts below
    are set by the ``describe`` hooks before any ``add_work`` hook runs, so no hook depends
    on another's order.
    """

    config: Any
    tokens: int  # per sequence
    batch: int
    rates: Any  # longtrain.plan.time_model.MachineRates
    notes: dict  # what the simulation noted (Memo's α and sizes)
    sequence_parallel: int = 1  # ranks the sequence is split over
    # shapes
    layers: int = 0
    attention_params: int = 0  # q, k, v, o projection weights of one layer
    mlp_params: int = 0
    head_params: int = 0
    layer_fwd: float = 0.0
    mlp_fwd: float = 0.0
    head_fwd: float = 0.0
    attention_fwd: float = 0.0
    # accumulators
    matmul: float = 0.0
    attention_passes: float = 3.0  # forward + backward
    exposed: float = 0.0
    layer_passes: float = 3.0  # the layers' elementwise work, in forwards (a backward counts two)
    mlp_passes: float = 0.0  # the MLPs' forwards run beyond those
    # facts (describe hooks)
    recomputes_layers: bool = False  # backward runs each layer's forward again (checkpointing, chunked engines)
    recomputed: float = 1.0  # share of the layers not left whole (they recompute and tile)
    kept_attention: float = 0.0  # share of recomputed layers whose attention output is kept (skips attention)
    recompute_reads_mlp: bool = True  # a recomputed layer's MLP output is read, so its MLP runs again
    mlp_forward_charged: bool = False  # some strategy part already charges the tiled MLP's extra forward
    tiled_mlp: bool = False
    chunked_head: bool = False
    chunk: int | None = None  # tokens per chunk of a chunked engine
    chunk_major: bool = False  # the engine runs every layer for one chunk before the next chunk (SeCO, SpaCO)
    inner: float = 0.0  # share of layers whose input backward recomputes inside a segment
    attention_rate: float = 0.0  # FLOP/s of the engine's attention kernels (where cuDNN takes the head dimension)
    attention_kernel_share: float = 1.0  # the share of that rate the head dimension's kernel reaches
    fused: frozenset = frozenset()  # elementwise kernels fused ("norm", "rope", "mlp": ModelDescription.elementwise_bytes)

    @classmethod
    def of(cls, config, tokens: int, batch: int, rates, notes: dict | None, sequence_parallel: int) -> "StepWork":
        """The plain step's work: forward 2, backward 4 FLOPs per matmul parameter and token;
        causal attention 2·w·s² forward per layer."""
        shape = describe_model(config)
        n, width = shape.layers, shape.attention_width
        attn = shape.attention_parameters + shape.mixer_parameters  # q, o and k, v projections (an SSM's instead)
        mlp = shape.mlp_parameters(active_only=True)  # a mixture of experts: the experts a token runs
        head = shape.vocab * shape.hidden
        s = tokens * batch
        work = cls(config, tokens, batch, rates, dict(notes or {}), sequence_parallel, n, attn, mlp, head,
                   layer_fwd=2.0 * s * (attn + mlp) * n, mlp_fwd=2.0 * s * mlp * n, head_fwd=2.0 * s * head,
                   attention_fwd=2.0 * width * tokens * tokens * n * batch, attention_rate=rates.fused_attention)
        work.matmul = 3 * (work.layer_fwd + work.head_fwd)
        if shape.has_attention and not cudnn_takes(shape.head_dim):  # FlashAttention-2 runs those
            work.attention_kernel_share = rates.flash_attention_share
        return work

    def add_layer_forwards(self, count: float) -> None:
        """``count`` more forwards of every layer (recomputation), elementwise kernels included."""
        self.matmul += count * self.layer_fwd
        self.layer_passes += count

    def add_mlp_forwards(self, count: float) -> None:
        """``count`` more forwards of every layer's MLP (a tiled backward's), activation included."""
        self.matmul += count * self.mlp_fwd
        self.mlp_passes += count

    @property
    def model_flops(self) -> float:
        return 3 * (self.layer_fwd + self.head_fwd) + 3 * self.attention_fwd


class HostBudgetKnob:
    """The host budget an engine's or a technique's options may name, as plans and
    simulations read and set it (a machine's host memory fills a budget left to its default;
    small simulations lift an engine's). ``host_budget_option``: the options field that holds
    it; None where the options have no host budget."""

    host_budget_option: str | None = None

    def host_budget(self, options) -> int | str | None:
        """The budget the options name (bytes or a size such as ``"64GiB"``); None where they
        leave it to its default or have none."""
        return None if self.host_budget_option is None else getattr(options, self.host_budget_option)

    def with_host_budget_named(self, options, budget: int | str | None):
        """The options naming ``budget`` (None: the default); unchanged where they have no budget."""
        if self.host_budget_option is None:
            return options
        return dataclasses.replace(options, **{self.host_budget_option: budget})


class EngineCosts(HostBudgetKnob):
    """An engine's costs; these defaults describe plain autograd over the whole sequence."""

    repeats_layers = True  # a step repeats layer by layer (simulations extrapolate along layers)
    # The step is the model's own forward and backward: where the model's memory is affine
    # in whole blocks of tokens (DecoderAdapter.token_block), simulations extend along them.
    extends_along_tokens = True

    def serves(self, adapter_class, options) -> bool:
        """Whether a plan weighs this variant for models of ``adapter_class`` (a variant the
        engine would refuse for every such model is left out, not listed as refused)."""
        return True

    def chunk(self, options) -> int | None:
        """Tokens per chunk where the engine runs the sequence in chunks (simulations then
        extrapolate along chunks too, and plans search whole chunks); None otherwise."""
        return None

    def fewest_chunks(self, options) -> int:
        """The fewest chunks a small simulation may hold (beyond the ends' own)."""
        return 0

    def layer_period(self, options) -> int:
        """Layers per repeat of the engine's own schedule (e.g. checkpoint segments)."""
        return 1

    def small_options(self, options, config, sequence_parallel):
        """The options for a simulation with a few of ``config``'s layers (host budgets are
        lifted by the simulator itself)."""
        return options

    def kept_outputs_apart(self, config, options, batch: int, item: int, sequence_parallel) -> Callable | None:
        """Where a few layers cannot stand for the model (some layers keep what others do
        not): ``correction(tokens) -> (device bytes, host bytes, count)`` to add at full
        scale to small simulations run with :meth:`small_options`. None: nothing to correct."""
        return None

    def parks_on_host(self, options) -> bool:
        """Whether what the step parks (a technique's layer inputs too) waits in host memory."""
        return False

    def parked(self, config, seq_len: int, options, item: int, batch: int) -> tuple[int, int]:
        """(device, host) bytes the engine parks at its fullest, counted from the config: a
        lower bound of its step beside the model states."""
        return PARKED_NOTHING

    def fragmentation(self, options) -> str:
        """The allocator margin kind (``longtrain.plan.planner.FRAGMENTATION``) its steps see."""
        return "whole"

    def candidates(self, seq_len: int, host_memory: int | None, layers: int, every_chunk: bool,
                   chunks: tuple[int, ...]) -> dict[str, dict]:
        """The engine's variants a plan weighs: label -> options (a mapping)."""
        return {}

    def fit_to_host(self, config, seq_len: int, options, item: int, batch: int, room: int, sequence_parallel):
        """Options whose host-dependent choices are made for ``room`` bytes of host memory
        (the options themselves where none are); None where the candidate is redundant then."""
        return options

    def in_longest_search(self, options) -> bool:
        """Whether the longest-context search weighs this variant (it may park more than
        another at the same chunk)."""
        return True

    def describe(self, work: StepWork, options) -> None:
        """Set the facts of ``work`` the engine decides (recomputation, chunks, attention rate)."""

    def add_work(self, work: StepWork, options) -> None:
        """Add what the engine's schedule costs beyond the plain step."""


class TechniqueCosts(HostBudgetKnob):
    """A technique's costs; these defaults describe a technique that changes nothing a
    plan weighs."""

    decides_at_first_step = False  # it measures the model in its first step (no warm start of a simulation)
    in_every_candidate = False  # a plan adds it to every candidate whose engine accepts it
    needs_frozen_layers = False  # it serves only layers whose weights do not train (LoRA's base)

    def serves(self, adapter_class, options) -> bool:
        """Whether a plan weighs this variant for models of ``adapter_class``."""
        return True

    def layers_apart_at_top(self, options) -> int:
        """Top layers that run differently from the others."""
        return 0

    def small_options(self, options, layers: int, full: int):
        """The options for a simulation of ``layers`` of the model's ``full`` layers."""
        return options

    def budget_stops_layers(self, options, config, batch: int, tokens: int, item: int) -> bool:
        """Whether its host budget stops it partway up the model at ``batch`` × ``tokens``
        tokens (``item`` bytes per element): some layers park or keep what the others
        cannot, so a few layers cannot stand for the model."""
        return False

    def full_notes(self, options, notes: dict) -> None:
        """Correct in place what small simulations noted to the full model's figures."""

    def parked(self, config, seq_len: int, options, item: int, batch: int, engine_offloads: bool) -> tuple[int, int]:
        """(device, host) bytes the technique parks at its fullest, counted from the config."""
        return PARKED_NOTHING

    def held_at_once(self, config, tokens: int, options, item: int, batch: int) -> int:
        """Device bytes one of its ops holds at once beside what the step parks, where a
        layer runs ``tokens`` tokens of each sequence at a time: a lower bound of the peak."""
        return 0

    def fragmentation(self, options) -> str | None:
        """An allocator margin kind its steps need (the planner takes the largest)."""
        return None

    def with_host_budget(self, options, room: int):
        """The options with their host budget cut to ``room`` bytes (what the optimizer
        state leaves when it lives in host memory)."""
        return options

    def candidates(self, host_memory: int | None) -> dict[str, Any]:
        """The technique's variants a plan weighs on the default engine: label -> options."""
        return {}

    def variants_on_default_engine(self) -> tuple:
        """For a technique in every candidate: options also weighed, beside its defaults, with
        each technique's candidate on the default engine (MsT's untiled MLP: faster where the
        device holds a layer's whole MLP activations)."""
        return ()

    def weighed_with_each(self, config, device_memory: int, item: int, frozen: bool) -> bool:
        """Whether a plan weighs every candidate also with this technique added, for a model
        of ``config`` on ``device_memory`` bytes (``item``: the weights' element size;
        ``frozen``: the layers' weights do not train)."""
        return False

    def weights_moved(self, config, options, item: int) -> tuple[int, int]:
        """(bytes of weights it takes off the device, bytes they then hold in host memory)."""
        return PARKED_NOTHING

    def with_whole_layers(self, options, count: int):
        """The options leaving the top ``count`` layers whole; None where the technique cannot."""
        return None

    def added_automatically(self, device_type: str, model_type: str) -> str | None:
        """Why ``--strategy auto`` adds it (same memory, faster) on this device; None: it does not."""
        return None

    def describe(self, work: StepWork, options) -> None:
        """Set the facts of ``work`` the technique decides."""

    def add_work(self, work: StepWork, options) -> None:
        """Add what the technique costs beyond the plain step."""

