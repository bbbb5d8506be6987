"""The longest context a strategy trains on a machine: a search over whole-length
simulations (``longtrain plan --longest``, :func:`max_context`, docs/results/max_context.md).

A step's device and host peaks are convex in the length: each place of the step's
repeating pattern peaks at an affine function of the number of chunks (and, in the
unchunked engines, of tokens), and the peak is the largest of them. So the set of lengths
that fit is an interval from zero, and its end is found by bracketing and refining:

- **chunked engines (FPDT)**: :func:`~longtrain.plan.steps.chunk_curve_of` gives the
  whole-length simulation at every length of whole chunks from one set of small
  simulations, so the search is a bisection over the number of chunks, exact to the chunk;
- **the others (checkpointing, Memo)**: each length is simulated (:func:`simulate_step`,
  seconds to a minute); the bracket is refined where the chord through its ends crosses
  the limit — for a convex overflow the chord's root lies at or below the true one, so
  it usually fits, and one more simulation a step beyond usually closes the bracket —
  to within 1/64 of the length (1,024 tokens at least).

The length reported always fits by a whole-length simulation, and one step beyond does
not. (A line through two short simulations would overestimate: the peak moves between
places as the length grows, each growing faster than the last; docs/planner.md has an
example.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .. import registry
from ..errors import LongtrainError
from ..models.adapters import adapter_class, describe_model
from ..models.loading import load_config, parse_dtype
from ..strategy import Strategy
from .bounds import Budget, budget_under, budgets_for, parked_bytes, parked_split, reserved_bytes
from .candidates import CHUNKS, added_techniques, candidates, host_budgets_beside_optimizer
from .extrapolate import chunk_of
from .fake_model import with_4bit_base
from .steps import chunk_curve_of, simulate_step
from .time_model import H100, MachineRates, step_time

__all__ = ["ContextLimit", "GRANULE", "LIMIT", "longest_context", "max_context", "overflow", "search"]

GRANULE = 1024  # unchunked lengths are searched in multiples of this many tokens
LIMIT = 2**31  # no search goes beyond this many tokens
_INFEASIBLE = float("inf")


def overflow(strategy: Strategy, budget: Budget, device: int, host: int) -> tuple[int, str]:
    """(bytes over the tighter of the device and host limits — negative: to spare — and
    which one) of a simulated step (``device`` without on-device optimizer state)."""
    over_device = reserved_bytes(strategy, budget, device) - budget.device_memory
    over_host = host - budget.host_memory
    return (over_device, "device memory") if over_device >= over_host else (over_host, "host memory")


def search(over: Callable[[int], tuple[float, str]], start: int, granule: int, limit: int = LIMIT,
           exact: bool = False) -> tuple[int, str]:
    """The largest multiple of ``granule`` at which ``over`` (convex in the length: bytes
    over the limit, and what binds) is at most zero — to within 1/64 of it, or exactly
    with ``exact`` (for an ``over`` that costs nothing) — and what binds at the next length
    tried beyond it; (0, what binds) where even ``granule`` does not fit. Starts at
    ``start``."""
    seen: dict[int, tuple[float, str]] = {}

    def f(length: int) -> float:
        if length not in seen:
            seen[length] = over(length)
        return seen[length][0]

    def up(x: float) -> int:
        return -(-int(math.ceil(x)) // granule) * granule

    def step(lo: int) -> int:
        return granule if exact else max(granule, lo // 64 // granule * granule)

    def beyond_line(a: int, b: int) -> int | None:
        """Where the line through two fitting lengths a < b crosses zero (rounded up): by
        convexity nothing fits there."""
        if f(b) <= f(a):
            return None
        return up(b + (b - a) * -f(b) / (f(b) - f(a)))

    fitting: list[int] = []
    length = min(limit, max(granule, start // granule * granule))
    lo, hi = (length, None) if f(length) <= 0 else (None, length)
    while lo is None:  # halve until something fits
        length = max(granule, hi // 2 // granule * granule)
        if length == hi:
            return 0, seen[hi][1]
        lo, hi = (length, hi) if f(length) <= 0 else (None, length)
    fitting.append(lo)
    while hi is None:  # out until something does not fit
        if lo >= limit:
            return lo, f"no limit below {limit:,} tokens"
        crossing = beyond_line(*fitting[-2:]) if len(fitting) > 1 else None
        length = min(limit, max(lo + granule, min(16 * lo, crossing) if crossing else 2 * lo))
        if f(length) <= 0:
            lo = length
            fitting.append(lo)
        else:
            hi = length
    while hi - lo > step(lo):
        # Alternately from above (the line through the last two fitting lengths) and from
        # below (the chord of the bracket, whose root lies at or below the true one).
        crossing = beyond_line(*fitting[-2:]) if len(fitting) > 1 else None
        if crossing is not None and lo + step(lo) <= crossing < hi:
            x = crossing
        else:
            f_lo, f_hi = f(lo), f(hi)
            chord = lo + (hi - lo) * (-f_lo / (f_hi - f_lo) if f_hi != _INFEASIBLE else 0.5)
            x = min(max(int(chord) // granule * granule, lo + granule), hi - granule)
        if f(x) <= 0:
            lo = x
            fitting.append(lo)
        else:
            hi = x
    return lo, seen[hi][1]


def longest_context(config, strategy: Strategy, budget: Budget, dtype: str, *, batch: int = 1,
                    lora_rank: int | None = None, start: int | None = None, label: str | None = None,
                    progress: Callable[[str], None] | None = None) -> tuple[int, str]:
    """(the longest context ``strategy`` trains within ``budget``, what binds one step
    beyond it) — module docstring. ``start``: a length to begin near (default: half
    the bound from what the strategy parks)."""
    say = progress or (lambda _: None)
    label = label or strategy.name
    item = torch.tensor([], dtype=parse_dtype(dtype)).element_size()
    chunk = chunk_of(strategy)
    curve = None
    if chunk:
        say(f"simulating {label} at every length of whole {chunk:,}-token chunks")
        curve = chunk_curve_of(config, strategy, dtype, batch, budget.optimizer, lora_rank)

    def over(length: int) -> tuple[float, str]:
        if curve is not None and length // chunk >= curve.fewest:
            return overflow(strategy, budget, *curve.peaks(length // chunk))
        say(f"simulating {label} at {length:,} tokens")
        try:
            device, host, _ = simulate_step(config, length, strategy, dtype, batch, budget.optimizer, lora_rank)
        except LongtrainError as exc:  # e.g. Memo: what it must swap exceeds the host budget
            return _INFEASIBLE, str(exc)
        return overflow(strategy, budget, device, host)

    granule = chunk or GRANULE
    if start is None:
        start = _parked_bound(config, strategy, budget, item, batch) // 2
        if curve is not None:
            start = max(start, curve.fewest * chunk)
    return search(over, start, granule, exact=curve is not None)


def _parked_bound(config, strategy: Strategy, budget: Budget, item: int, batch: int) -> int:
    """The length at which what ``strategy`` parks alone fills its side (device or host):
    an upper bound of the longest context."""
    per_token = parked_bytes(config, 2**20, strategy, item, batch) / 2**20
    on_device, on_host = parked_split(config, 2**20, strategy, item, batch)
    room = (budget.host_memory - budget.host_state if on_host else 0) + \
        (budget.device_memory - budget.persistent if on_device else 0)
    if per_token <= 0:
        return 2**20
    return int(max(GRANULE, min(LIMIT, room / per_token)))


@dataclass
class ContextLimit:
    name: str  # the strategy as --strategy reads it; AdamW's place is optimizer_offload
    tokens: int  # the longest context that fits (whole chunks for FPDT), 0 if none
    binds: str  # what stops it one step beyond
    step_seconds: float | None  # predicted at that length
    optimizer_offload: bool


def max_context(model, *, device_memory: int, host_memory: int, optimizer: str = "adamw", dtype: str = "bfloat16",
                rates: MachineRates = H100, lora_rank: int | None = None, optimizer_offload: bool | None = None,
                chunks: tuple[int, ...] = CHUNKS[:2], progress: Callable[[str], None] | None = None,
                four_bit: bool = False) -> list[ContextLimit]:
    """The longest context each candidate strategy of :func:`~longtrain.plan.planner.plan`
    reaches on this machine (:func:`longest_context`), longest first. FPDT runs with
    checkpoint segments only (the other variants park more) at ``chunks``-token chunks
    (larger chunks have larger working sets: never the longer context). ``four_bit``: with
    ``lora_rank``, the base held in 4 bits (bitsandbytes NF4, as ``plan --lora --4bit``)."""
    say = progress or (lambda _: None)
    if four_bit and not lora_rank:
        raise LongtrainError("a 4-bit base trains LoRA adapters only: pass lora_rank with four_bit")
    config = load_config(model)
    if four_bit:
        with_4bit_base(config)
    adapter_class(config.model_type).allow_positions(config, LIMIT)
    params, budgets = budgets_for(config, device_memory=device_memory, host_memory=host_memory, optimizer=optimizer,
                                  dtype=parse_dtype(dtype), lora_rank=lora_rank, optimizer_offload=optimizer_offload)
    limits = []
    item = parse_dtype(dtype).itemsize
    added = added_techniques(config, device_memory, item, frozen=bool(lora_rank) and not four_bit)
    for label, strategy in candidates(LIMIT, host_memory, describe_model(config).layers, every_chunk=True,
                                      chunks=chunks, adapter=adapter_class(config.model_type), added=added).items():
        if not registry.engine(strategy.engine).costs.in_longest_search(strategy.engine_options):
            continue  # parks more than another variant at the same chunk: never the longer context
        for budget in budgets:
            budget = budget_under(strategy, budget, config, item)  # weights a technique streams from the host
            offloaded = budget.optimizer == "adamw-offload"
            # As the planner does: technique host budgets within what the host keeps beside
            # the optimizer's state or the streamed weights.
            weighed = host_budgets_beside_optimizer(strategy, host_memory - budget.host_state) if budget.host_state \
                else strategy
            shown = label + (" --optimizer-offload" if offloaded else "")
            say(f"longest context of {shown}")
            tokens, binds = longest_context(config, weighed, budget, dtype, lora_rank=lora_rank, label=shown, progress=say)
            seconds = step_time(config, tokens, weighed, rates, optimizer_offload=offloaded,
                                trainable=params).seconds if tokens else None
            limits.append(ContextLimit(label, tokens, binds, seconds, offloaded))
    return sorted(limits, key=lambda r: -r.tokens)
