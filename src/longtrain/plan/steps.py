"""The planner's whole-length simulations of one step (:func:`simulate_step`), cached in the
process — a candidate is simulated once however often a plan or a longest-context search
asks — and read from a chunk curve (:func:`chunk_curve_of`) where a chunked engine's length
is whole chunks; :class:`_Simulations` runs them in worker processes."""

from __future__ import annotations

import copy
import json
from typing import Callable

from ..strategy import Strategy
from . import workers
from .extrapolate import chunk_axis
from .simulate import chunk_curve, simulate

__all__ = [
    "cached_curves",
    "chunk_curve_of",
    "clear_caches",
    "config_from_json",
    "simulate_elsewhere",
    "simulate_step",
]


_SIMULATIONS: dict[tuple, tuple[int, int, dict]] = {}  # simulate_step's results in this process
_CURVES: dict[tuple, object] = {}  # chunk_curve's results (a ChunkCurve or None) in this process


def clear_caches() -> None:
    """Test hook: forget every simulation and chunk curve cached in this process, so that
    the next plan simulates again."""
    _SIMULATIONS.clear()
    _CURVES.clear()


def cached_curves() -> dict[tuple, object]:
    """Test hook: a copy of the chunk curves cached in this process, by cache key."""
    return dict(_CURVES)


def _key(config, seq_len, strategy: Strategy, dtype, batch, optimizer, lora_rank) -> tuple:
    return (json.dumps(config.to_dict(), sort_keys=True, default=str), seq_len, strategy.to_json(), str(dtype), batch,
            optimizer, lora_rank)


def _iterations(optimizer: str) -> int | None:
    # One step suffices where no optimizer state lives on the device between steps (or where the
    # optimizer creates it on the host in its first step); LoRA's adapters keep theirs on the device.
    return 1 if optimizer in ("none", "adamw-offload") else None


def chunk_curve_of(config, strategy: Strategy, dtype: str, batch: int = 1, optimizer: str = "none",
                   lora_rank: int | None = None, progress: Callable[[str], None] | None = None):
    """:func:`~longtrain.plan.simulate.chunk_curve` of a planned step (cached in the process):
    the peaks at every length of whole chunks from one set of small simulations."""
    key = _key(config, 0, strategy, dtype, batch, optimizer, lora_rank)
    if key not in _CURVES:
        _CURVES[key] = chunk_curve(config, strategy, batch_size=batch, optimizer=optimizer, dtype=dtype,
                                   lora_rank=lora_rank, iterations=_iterations(optimizer), progress=progress,
                                   planning=True)
    return _CURVES[key]


def simulate_step(config, seq_len: int, strategy: Strategy, dtype: str, batch: int = 1, optimizer: str = "none",
                  lora_rank: int | None = None) -> tuple[int, int, dict]:
    """(device peak, host peak, notes) of one step at ``seq_len`` tokens; with
    ``optimizer="none"`` without optimizer state, with ``"adamw-offload"`` with its host
    state and streamed gradients. Cached in the process.

    Always the whole length: the simulator extends each phase's peak from a few layers and
    chunks itself (plan/extrapolate.py), so its cost hardly grows with the length; a chunked
    engine at a length of whole chunks reads its :func:`chunk_curve_of`, which shares those
    small simulations between lengths. (A line through the peaks at two and four FPDT
    chunks would underestimate long contexts: the peak moves from one phase to another as
    the length grows, and the later phases grow faster; docs/planner.md has an example.)"""
    key = _key(config, seq_len, strategy, dtype, batch, optimizer, lora_rank)
    if key not in _SIMULATIONS:
        _SIMULATIONS[key] = _simulate_step(config, seq_len, strategy, dtype, batch, optimizer, lora_rank)
    return _SIMULATIONS[key]


def _simulate_step(config, seq_len, strategy: Strategy, dtype, batch, optimizer, lora_rank) -> tuple[int, int, dict]:
    axis = chunk_axis(config, seq_len, strategy)
    if axis is not None and axis.offset == 0 and axis.target >= axis.first + 3:
        curve = chunk_curve_of(config, strategy, dtype, batch, optimizer, lora_rank)
        if curve is not None and axis.target >= curve.fewest:
            device, host = curve.peaks(axis.target)
            return device, host, curve.notes
    config = copy.deepcopy(config)
    report = simulate(config, seq_len, batch_size=batch, strategy=strategy, optimizer=optimizer, dtype=dtype,
                      iterations=_iterations(optimizer), lora_rank=lora_rank, planning=True)
    return report.device_peak_bytes, report.peak.peak_host_bytes, dict(report.notes)


def config_from_json(config_json: str):
    """A model config from its ``to_dict()`` as JSON (how a worker process receives it)."""
    from transformers import AutoConfig

    data = json.loads(config_json)
    return AutoConfig.for_model(data.pop("model_type"), **data)


def simulate_elsewhere(config_json: str, seq_len: int, strategy_json: str, dtype, batch, optimizer, lora_rank):
    """simulate_step in a worker process (plan's ``jobs``), and the chunk curves it made on
    the way: the parent caches them, so ``--longest`` searches them without simulating again."""
    config = config_from_json(config_json)
    before = set(_CURVES)
    result = _simulate_step(config, seq_len, Strategy.from_json(strategy_json), dtype, batch, optimizer, lora_rank)
    return result, {key: curve and curve.peaks_only() for key, curve in _CURVES.items() if key not in before}


class _Simulations:
    """The planned candidates' simulations (:func:`simulate_step`), in ``workers`` processes
    when more than one: an 8B candidate takes up to 15 s of one core, so a plan on two cores
    answers in about half the time. Results are cached in this process as simulate_step's."""

    def __init__(self, workers: int):
        self.workers = workers
        self.futures: dict[tuple, object] = {}
        self.executor = None

    def __enter__(self):
        if self.workers > 1:  # each worker imports torch and the simulator while the plan is set up
            self.executor = workers.adopt(self.workers) or workers.pool(self.workers)
        return self

    def __exit__(self, *exc):
        if self.executor is not None:  # what still runs was started ahead and is not needed
            workers.stop_now(self.executor)

    def started(self, args) -> bool:
        return _key(*args) in self.futures or _key(*args) in _SIMULATIONS

    def _pool(self):
        if self.executor is None:
            self.executor = workers.pool(self.workers)
        return self.executor

    def start(self, args) -> bool:
        """Start simulating ``args`` (simulate_step's) in a worker; False if started or known already."""
        if self.started(args):
            return False
        if self.workers > 1:
            config, seq_len, strategy, *rest = args
            config_json = json.dumps(config.to_dict(), default=str)
            self.futures[_key(*args)] = self._pool().submit(simulate_elsewhere, config_json, seq_len,
                                                            strategy.to_json(), *rest)
        return True

    def call(self, fn, *args):
        """A future of ``fn(*args)`` run in a worker (``fn`` and its arguments picklable)."""
        return self._pool().submit(fn, *args)

    def result(self, args) -> tuple[int, int, dict]:
        key = _key(*args)
        future = self.futures.pop(key, None)
        if future is not None and key not in _SIMULATIONS:
            _SIMULATIONS[key], curves = future.result()
            for curve_key, curve in curves.items():
                _CURVES.setdefault(curve_key, curve)
        return simulate_step(*args)
