"""Full-scale figures of a step from a few small simulations.

**Extrapolation** (:func:`~longtrain.plan.simulate.simulate`'s default; ``exact=True``
runs the whole model at the whole length). A step repeats itself layer by layer — and in
the chunked engines (fpdt, seco, spaco) chunk by chunk — so every figure of the report (the peaks, and each
category at the device peak) is an affine function of the number of layers, and of the
number of chunks, once there are a few of each: parameters, gradients, optimizer state
and saved activations grow by one layer's worth per layer, parked K/V and layer inputs
by one chunk's worth per chunk (and one layer-chunk's worth per both), and the peak is
reached at the same place of the repeating pattern. So the model is simulated with a
few layers (whole repeats of the config's per-layer pattern, e.g. Gemma-2's
sliding/global pairs, and of FPDT's checkpoint segments, plus the same partial repeat
at the top) and, for chunked engines, a few whole chunks (plus the same last, possibly
partial, chunk): at ``a`` and ``a + 1`` repeats of each, the bilinear function is fitted
exactly (integer bytes), and checked against a third simulation one repeat beyond on
each axis. Should a check miss (the pattern has not settled yet), the sizes move one
repeat up, twice at most, and then the whole model is simulated after all.
tests/test_simulate_fast.py compares this with the full simulation for every engine.
:mod:`longtrain.plan.simulate` runs the simulations; this module chooses their sizes,
labels their peaks by place, fits and checks them, and extends them to the whole model
(:class:`ChunkCurve`: to every length of whole chunks).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import registry
from ..errors import LongtrainError
from ..memory.tracker import CATEGORIES, DEVICE, HOST, MemoryReport, MemoryTracker
from ..memory.units import format_bytes, parse_bytes
from ..models.adapters import adapter_class, describe_model
from ..strategy import Strategy
from .bounds import _engine_costs

__all__ = [
    "Axis",
    "CHECK_TOLERANCE",
    "ChunkCurve",
    "chunk_axis",
    "chunk_of",
    "layer_axis",
    "scaled_strategy",
]


CHECK_TOLERANCE = 1e-3  # a check simulation further than this (relative) from the extrapolated peak: not settled
_SHIFTS = 2  # times the sizes move one repeat up after a missed check, before the full simulation


@dataclass
class _Simulated:
    report: MemoryReport
    parameters: int
    trainable: int
    notes: dict
    method: str = "exact: every layer at the whole length"
    phases: dict | None = None  # stable place label -> (device peak, its time, host peak) (_stable_phases)
    tracker: MemoryTracker | None = None  # for breakdowns at a phase's peak
    tokens: int | None = None  # the sequence length simulated (set by _fit)


@dataclass(frozen=True)
class Axis:
    """Sizes ``value(u) = u * unit + offset`` for ``u`` whole repeats; ``target`` repeats at
    full scale; simulated at ``first``, ``first + 1`` (the fit) and ``first + 2`` (the check)."""

    name: str
    unit: int
    offset: int
    target: int
    first: int

    def value(self, units: int) -> int:
        return units * self.unit + self.offset

    @property
    def extrapolated(self) -> bool:
        return self.target > self.first + 2

    def shifted(self) -> "Axis":
        return dataclasses.replace(self, first=self.first + 1)


def _layers(config) -> int:
    return describe_model(config).layers


def _adapter(config):
    return adapter_class(getattr(config, "model_type", None))


def _period(values) -> int:
    """The smallest p with ``values[i] == values[i % p]`` for every i."""
    n = len(values)
    return next(p for p in range(1, n + 1) if all(values[i] == values[i % p] for i in range(n)))


def _layer_period(config, strategy: Strategy) -> int:
    """Layers per repeat: of what tells the model's layers apart (Gemma-2's sliding and
    global attention, a mixture's dense and sparse layers) and of FPDT's checkpoint segments."""
    period = _period(describe_model(config).per_layer())
    return math.lcm(period, _engine_costs(strategy).layer_period(strategy.engine_options))


def _depth(strategy: Strategy) -> int:
    """Repeats at each end of the model (and of a chunk sequence) that may differ from the
    ones between them: the first and the last, and the next ones, which bound the uniform
    middle; Memo's layers kept on the device, and the layers checkpointing leaves whole, are
    more special ones at the top."""
    top = max((registry.technique(name).costs.layers_apart_at_top(options)
               for name, options in strategy.techniques.items()), default=0)
    return max(2, top + 1)


def layer_axis(config, strategy: Strategy) -> Axis | None:
    """Layers in whole repeats (:func:`_layer_period`); the partial repeat at the top is kept
    in every size. At least ``2 · depth`` repeats, so that both ends are told apart."""
    n = _layers(config)
    if not isinstance(n, int) or n < 1 or not _repeats_layers(config, strategy):
        return None
    period = _layer_period(config, strategy)
    offset = n % period
    first = 2 * _depth(strategy) - (1 if offset else 0)  # a partial repeat at the top counts as one
    axis = Axis("layers", period, offset, n // period, max(1, first))
    return axis if axis.extrapolated else None


def _repeats_layers(config, strategy: Strategy) -> bool:
    return not _adapter(config).simulated_whole and _engine_costs(strategy).repeats_layers


def chunk_of(strategy: Strategy) -> int | None:
    """Tokens per chunk of ``strategy``'s engine where it runs in chunks and its figures
    extend along them (not under sequence parallelism: its padded layouts); else None."""
    if strategy.sequence_parallel is not None:
        return None
    return _engine_costs(strategy).chunk(strategy.engine_options)


def chunk_axis(config, seq_len: int, strategy: Strategy) -> Axis | None:
    """Tokens in whole chunks of a chunked engine; the last (possibly partial) chunk is kept
    in every size. At least ``2 · depth`` chunks past the sliding window, if any (until a
    chunk sees a whole window, each sees more than the one before); SpaCO backpropagates
    its last ``budget`` chunks when simulated, so its sizes start two chunks above that.
    Not under sequence parallelism (its padded layouts). An engine without chunks that runs
    the model's own step extends along the model's token blocks where it has them
    (:func:`token_axis`)."""
    chunk = chunk_of(strategy)
    if chunk is None:
        return token_axis(config, seq_len, strategy)
    count = -(-seq_len // chunk)
    last = seq_len - (count - 1) * chunk
    window = describe_model(config).sliding_window
    first = 2 * _depth(strategy) + (-(-window // chunk) + 1 if window else 0)
    first = max(first, _engine_costs(strategy).fewest_chunks(strategy.engine_options))
    axis = Axis("chunks", chunk, last - chunk, count, first)
    return axis if axis.extrapolated else None


def token_axis(config, seq_len: int, strategy: Strategy) -> Axis | None:
    """Tokens in whole blocks of :meth:`~longtrain.models.adapters.base.DecoderAdapter.token_block`
    (a state-space model's own step: each token's memory alike), the last, possibly partial,
    block kept in every size; for engines that run that step (``extends_along_tokens``).
    The fit's check simulation catches a step that is not affine after all."""
    if strategy.sequence_parallel is not None or not _engine_costs(strategy).extends_along_tokens:
        return None
    block = _adapter(config).token_block(config)
    if block is None:
        return None
    count = -(-seq_len // block)
    axis = Axis("chunks", block, seq_len - count * block, count, 2 * _depth(strategy))
    return axis if axis.extrapolated else None


def _end(i: int, total: int, depth: int):
    """Where ``i`` of ``total`` repeats sits: ("first", i) or ("last", total - 1 - i) within
    ``depth`` of an end, else None (the uniform middle)."""
    if i < depth:
        return "first", i
    if total - 1 - i < depth:
        return "last", total - 1 - i
    return None


def _stable_phases(phases: dict, period: int, depth: int) -> dict:
    """The peaks of each place (:class:`~longtrain.plan.simulate._PhaseMarks`), labelled so that the same place
    carries the same label at any number of layers and chunks: a layer by its distance from
    the bottom or the top (in repeats of ``period``) and its offset in the repeat, the
    how-many-th call or loop repeat by its distance from the first or the last. Places in a
    uniform middle are dropped: what happens there grows or shrinks evenly from one layer
    (chunk, block) to the next, so its peak is at one of the places next to the ends, which
    are kept."""
    n, calls = phases["layers"], phases["calls"]
    repeats = -(-n // period)

    def stable(part: tuple, outer: tuple | None):
        if part[0] == "layer":
            _, event, kind, j, count, micro = part
            where = _end(j // period, repeats, depth)
            when = _end(count, calls[("layer", event, kind, j, micro)], depth)
            return None if where is None or when is None else ("layer", event, kind, where, j % period, when, micro)
        if part[0] == "repeat":
            _, kind, count = part
            when = _end(count, calls[(outer, kind)], depth)
            return None if when is None else ("repeat", kind, when)
        return part

    labelled = {}
    for label, peaks in phases["peaks"].items():
        parts = tuple(stable(part, label[0]) for part in label)
        if None not in parts:
            labelled[parts] = peaks
    return labelled


def _with_layers(config, layers: int):
    return _adapter(config).with_layers(config, layers)


def scaled_strategy(strategy: Strategy, config, layers: int) -> Strategy:
    """The strategy for a simulation with ``layers`` of the model's layers: an engine's host
    budget, which bounds a whole step, is lifted (checked on the extrapolated host peak
    instead); the engine and each technique then adjust their options to a few layers
    (``small_options``: Memo's budget scaled to the layers it covers, so that its α is the
    full model's; checkpointing's lifted, fewer layers than the whole model being simulated
    only where it stops none of them, :func:`_budget_stops_layers`). Budgets left to their
    default stay unbounded."""
    costs = _engine_costs(strategy)
    options = strategy.engine_options
    if costs.host_budget(options) is not None:
        options = costs.with_host_budget_named(options, None)
    options = costs.small_options(options, config, strategy.sequence_parallel)
    full = _layers(config)
    techniques = {name: registry.technique(name).costs.small_options(technique, layers, full)
                  for name, technique in strategy.techniques.items()}
    return Strategy(strategy.engine, options, strategy.sequence_parallel, **techniques)


def _kept_outputs_apart(config, strategy: Strategy, batch_size: int, dtype: torch.dtype):
    """Where a few layers cannot stand for the model (FPDT keeping the outputs of its lowest
    N layers), the engine's ``correction(tokens)``: (device bytes, host bytes, count) to add at
    full scale (:meth:`~longtrain.costs.EngineCosts.kept_outputs_apart`; checked against
    whole-model simulations in tests/test_simulate_fast.py). None where there is nothing to correct."""
    item = torch.tensor([], dtype=dtype).element_size()
    return _engine_costs(strategy).kept_outputs_apart(config, strategy.engine_options, batch_size, item,
                                                      strategy.sequence_parallel)


def _budget_stops_layers(config, seq_len: int, strategy: Strategy, batch: int, item: int) -> bool:
    """Whether a technique's host budget stops it partway up the model — some layers park or
    keep what the others cannot (:meth:`~longtrain.costs.TechniqueCosts.budget_stops_layers`). Which ones is
    a count of whole layers, not a share, so a few layers cannot stand for the model: it is
    simulated whole (where nothing stops, the small simulations run without the budget)."""
    return any(registry.technique(name).costs.budget_stops_layers(options, config, batch, seq_len, item)
               for name, options in strategy.techniques.items())


def _bilinear(values: dict, a: int, b: int, u: int, v: int) -> tuple:
    """The function through ``values`` at (a, b), (a + 1, b), (a, b + 1), (a + 1, b + 1) —
    the points that exist: an axis not extrapolated has only ``a`` (``b``) — at (u, v).
    Tuples of integers, computed exactly."""
    du, dv = u - a, v - b
    f00 = values[(a, b)]
    out = list(f00)
    if du:
        out = [o + du * (x - y) for o, x, y in zip(out, values[(a + 1, b)], f00)]
    if dv:
        out = [o + dv * (x - y) for o, x, y in zip(out, values[(a, b + 1)], f00)]
    if du and dv:
        f10, f01, f11 = values[(a + 1, b)], values[(a, b + 1)], values[(a + 1, b + 1)]
        out = [o + du * dv * (w - x - y + z) for o, w, x, y, z in zip(out, f11, f10, f01, f00)]
    return tuple(out)


def _peaks_at(sims: dict, fit: list, a: int, b: int, u: int, v: int):
    """(device peak, host peak, label of the device peak) at (u, v): each place's peaks
    extrapolated, and the largest taken."""
    labels = set.intersection(*(set(sims[p].phases) for p in fit))
    device, host, where = None, 0, None
    for label in labels:
        d, h = _bilinear({p: (sims[p].phases[label][0], sims[p].phases[label][2]) for p in fit}, a, b, u, v)
        if device is None or d > device:
            device, where = d, label
        host = max(host, h)
    return device, host, where


def _close(x: int, y: int) -> bool:
    return abs(x - y) <= CHECK_TOLERANCE * max(abs(x), abs(y))


@dataclass
class _Fitted:
    """The small simulations a step's figures are extrapolated from (:func:`_fit`): the
    places' peaks through the ``fit`` points at (``a``, ``b``) repeats of each axis,
    checked one repeat beyond on each."""

    sims: dict
    fit: list
    a: int
    b: int
    layers: Axis | None
    chunks: Axis | None
    seq_len: int = 0
    kept: Callable[[int], tuple[int, int, int]] | None = None  # :func:`_kept_outputs_apart`
    checked: bool = True  # one repeat beyond the fit simulated on each axis, and matched

    def peaks(self, u: int, v: int):
        """(device peak, host peak, label of the device peak) at ``u`` layer and ``v`` chunk repeats."""
        device, host, where = _peaks_at(self.sims, self.fit, self.a, self.b, u, v)
        if self.kept is not None and device is not None:
            more_device, more_host, _ = self.kept(self.chunks.value(v) if self.chunks is not None else self.seq_len)
            device, host = device + more_device, host + more_host
        return device, host, where

    def simulated(self, strategy: Strategy, chunks: int | None = None) -> _Simulated:
        """The figures of the whole model, at the target number of chunks or at ``chunks``."""
        sims, fit, a, b, layers = self.sims, self.fit, self.a, self.b, self.layers
        if chunks is not None and self.chunks is None:
            raise ValueError("only a chunked engine's figures extend to another number of chunks")
        axis = dataclasses.replace(self.chunks, target=chunks) if chunks is not None else self.chunks
        target = (layers.target if layers is not None else 0, axis.target if axis is not None else 0)
        device, host, where = self.peaks(*target)
        # The breakdown of the device peak: each category at the winning place, extrapolated.
        breakdowns = {p: sims[p].tracker.report(at=sims[p].phases[where][1]) for p in fit}
        figures = _bilinear({p: (*_categories(r), r.host_bytes_at_peak, sims[p].parameters, sims[p].trainable)
                             for p, r in breakdowns.items()}, a, b, *target)
        by_category, rest = {}, list(figures)
        for category in CATEGORIES:
            by_category[category] = {DEVICE: rest.pop(0), HOST: rest.pop(0)}
        host_at_peak, parameters, trainable = rest
        notes = dict(sims[max(fit)].notes)
        if layers is not None and notes.get("kept_attention_outputs"):  # the small models keep every layer's
            notes["kept_attention_outputs"] = layers.value(layers.target)
        if self.kept is not None:  # what the kept-output count adds (device) or leaves out (host)
            more_device, _, notes["kept_attention_outputs"] = self.kept(
                axis.value(axis.target) if axis is not None else self.seq_len)
            by_category["activations"][DEVICE] += more_device
            fewer_host = max(0, host_at_peak - host)
            by_category["activations"][HOST] = max(0, by_category["activations"][HOST] - fewer_host)
            host_at_peak -= fewer_host
        largest = breakdowns[max(fit)]
        report = MemoryReport(device, host_at_peak, max(host, host_at_peak), by_category, largest.largest)
        for name, options in strategy.techniques.items():
            registry.technique(name).costs.full_notes(options, notes)
        seq_len = axis.value(axis.target) if axis is not None else sims[max(fit)].tokens
        _check_host_budget(strategy, report, seq_len)
        parts = []
        if layers is not None:
            parts.append(f"{layers.value(a)}, {layers.value(a + 1)} layers"
                         + (f" (checked at {layers.value(a + 2)})" if self.checked else ""))
        if axis is not None:
            parts.append(f"{axis.value(b):,}, {axis.value(b + 1):,} tokens ("
                         + (f"checked at {axis.value(b + 2):,}; " if self.checked else "")
                         + f"{'chunks' if chunk_of(strategy) else 'blocks'} of {axis.unit:,})")
        method = f"extrapolated from {len(sims)} small simulations: " + " × ".join(parts) + "; --exact: the whole model"
        return _Simulated(report, parameters, trainable, notes, method)


def _fit(config, seq_len: int, strategy: Strategy, run, say, kept=None, whole_layers: bool = False,
         planning: bool = False) -> _Fitted | None:
    """The small simulations the full-scale figures are extrapolated from, fitted and
    checked (module docstring), or None when there is nothing to extrapolate or the
    pattern never settled. ``kept``: :func:`_kept_outputs_apart`'s correction.
    ``whole_layers``: every layer in every simulation (:func:`_budget_stops_layers`).
    ``planning`` (the planner's simulations): the fit simulations alone, without the
    check one repeat beyond on each axis — the figures come from the fit simulations
    either way (tests/test_planner.py compares both) — and None, the whole model to be
    simulated, where along layers alone the small simulations would hold more layers than
    the model (the cheaper simulation then, and the reference)."""
    layers = None if whole_layers else layer_axis(config, strategy)
    chunks = chunk_axis(config, seq_len, strategy)
    if layers is None and chunks is None:
        return None
    if planning and chunks is None and layers.value(layers.first) + layers.value(layers.first + 1) >= _layers(config):
        say("the small simulations would hold more layers than the model: simulating the whole model")
        return None
    check = not planning
    places = (_layer_period(config, strategy), _depth(strategy))
    sims: dict[tuple[int, int], _Simulated] = {}

    def size(u, v):
        return (layers.value(u) if layers is not None else _layers(config),
                chunks.value(v) if chunks is not None else seq_len)

    def simulate_at(points):
        todo = sorted((p for p in dict.fromkeys(points) if p not in sims), key=lambda p: size(*p))
        for n, (u, v) in enumerate(todo, 1):
            n_layers, tokens = size(u, v)
            started = time.perf_counter()
            say(f"[{n}/{len(todo)}] simulating {n_layers} layers at {tokens:,} tokens")
            sims[(u, v)] = run(_with_layers(config, n_layers) if layers is not None else config, tokens,
                               scaled_strategy(strategy, config, n_layers), places=places)
            sims[(u, v)].tokens = tokens
            say(f"[{n}/{len(todo)}] {n_layers} layers at {tokens:,} tokens: {time.perf_counter() - started:.1f} s")

    for attempt in range(_SHIFTS + 1):
        a = layers.first if layers is not None else 0
        b = chunks.first if chunks is not None else 0
        fit = [(a + i, b + j) for i in (0, 1) for j in (0, 1)
               if (i == 0 or layers is not None) and (j == 0 or chunks is not None)]
        layer_check = (a + 2, b + (chunks is not None)) if layers is not None and check else None
        chunk_check = (a + (layers is not None), b + 2) if chunks is not None and check else None
        try:
            simulate_at(fit + [p for p in (layer_check, chunk_check) if p is not None])
        except LongtrainError:
            # A refusal speaks of the small model (its layers, its share of a host budget):
            # the whole model is simulated, refused in its own figures (or not at all).
            say("a small simulation was refused: simulating the whole model")
            return None
        # The places kept (the ends, shared by every fit simulation) must hold each fit
        # simulation's own peaks — none in the middle — and, extrapolated, the check
        # simulations' peaks.
        unsettled = {p for p in fit + [layer_check, chunk_check]
                     if p is not None and not _reproduces(sims, fit, a, b, p, exactly=p in fit)}
        if not unsettled:
            return _Fitted(sims, fit, a, b, layers, chunks, seq_len, kept, check)
        fit_failed = any(p in fit for p in unsettled)
        shift_layers = layers is not None and (layer_check in unsettled or fit_failed)
        shift_chunks = chunks is not None and (chunk_check in unsettled or fit_failed)
        if attempt == _SHIFTS or (shift_layers and not layers.extrapolated) or (shift_chunks and not chunks.extrapolated):
            break
        say("the repeating pattern has not settled yet: simulating one repeat more")
        layers = layers.shifted() if shift_layers else layers
        chunks = chunks.shifted() if shift_chunks else chunks
    say("the repeating pattern did not settle in the small simulations: simulating the whole model")
    return None


def _categories(report: MemoryReport) -> tuple[int, ...]:
    return tuple(report.by_category.get(c, {}).get(loc, 0) for c in CATEGORIES for loc in (DEVICE, HOST))


def _reproduces(sims: dict, fit: list, a: int, b: int, point: tuple, exactly: bool) -> bool:
    """Whether the places' peaks, extrapolated from the fit simulations, give the device and
    host peaks simulated at ``point`` (to the byte at the fit points themselves)."""
    device, host, _ = _peaks_at(sims, fit, a, b, *point)
    if device is None:
        return False
    simulated = sims[point].report
    if exactly:
        return device == simulated.peak_device_bytes and host == simulated.peak_host_bytes
    return _close(device, simulated.peak_device_bytes) and _close(host, simulated.peak_host_bytes)


def _check_host_budget(strategy: Strategy, report: MemoryReport, seq_len: int) -> None:
    """The host budget of a chunked engine's options, lifted for the small simulations,
    against the extrapolated host peak."""
    budget = _engine_costs(strategy).host_budget(strategy.engine_options)
    if budget is None or report.peak_host_bytes <= 0:
        return
    budget = parse_bytes(budget)
    if report.peak_host_bytes > budget:
        raise LongtrainError(
            f"the {strategy.engine} engine needs {format_bytes(report.peak_host_bytes)} of host memory for {seq_len:,} "
            f"tokens (simulated), the host budget is {format_bytes(budget)}; raise host_memory, shorten the sequence, "
            "or offload less"
        )


@dataclass
class ChunkCurve:
    """A chunked engine's simulated step as a function of its length in whole chunks
    (:func:`~longtrain.plan.simulate.chunk_curve`): at ``chunks`` ≥ :attr:`fewest` the figures
    :func:`~longtrain.plan.simulate.simulate` gives at ``chunks × chunk`` tokens, without simulating again —
    both come from the same small simulations (module docstring). Each place's peak is
    affine in the number of chunks, so the device and host peaks (the largest of them)
    are convex piecewise-linear functions of the length."""

    chunk: int
    fewest: int  # below this many chunks simulate() simulates the length itself
    strategy: Strategy
    _fitted: _Fitted = field(repr=False)

    def peaks(self, chunks: int) -> tuple[int, int]:
        """(device peak, host peak) in bytes of a step of ``chunks`` whole chunks."""
        if chunks < self.fewest:
            raise ValueError(f"the curve starts at {self.fewest} chunks, got {chunks}")
        layers = self._fitted.layers
        device, host, _ = self._fitted.peaks(layers.target if layers is not None else 0, chunks)
        return device, host

    @property
    def notes(self) -> dict:
        """What the techniques chose (memo's α), as in :attr:`SimulationReport.notes`; not
        FPDT's kept-output count, which depends on the length."""
        fitted = self._fitted
        notes = dict(fitted.sims[max(fitted.fit)].notes)
        notes.pop("kept_attention_outputs", None)
        return notes

    def report(self, chunks: int) -> MemoryReport:
        """The whole report (the categories at the device peak) at ``chunks`` whole chunks."""
        if chunks < self.fewest:
            raise ValueError(f"the curve starts at {self.fewest} chunks, got {chunks}")
        if any(sim.report is None for sim in self._fitted.sims.values()):
            raise ValueError("this curve keeps the peaks only (peaks_only()); simulate again for the report")
        return self._fitted.simulated(self.strategy, chunks).report

    def peaks_only(self) -> "ChunkCurve":
        """The same curve without its simulations' reports and trackers (which hold the fake
        model): what :meth:`peaks` and :attr:`notes` read, small and picklable — for
        ``plan``'s worker processes to hand their curves back."""
        sims = {p: dataclasses.replace(sim, report=None, tracker=None) for p, sim in self._fitted.sims.items()}
        return dataclasses.replace(self, _fitted=dataclasses.replace(self._fitted, sims=sims))
