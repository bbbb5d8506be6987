"""Full-scale memory simulation: run real training steps on fake tensors.

The model is built from its config under ``FakeTensorMode`` (shapes and dtypes, no
storage), the strategy is applied, and forward + backward + optimizer step run for
two iterations so the optimizer state exists at the steady-state peak. The same
:class:`~longtrain.memory.tracker.MemoryTracker` that measures real CPU runs counts the
fake storages, so a simulated figure and an exact CPU measurement come from one code
path (:func:`run_training_steps` with ``fake=False``).

Assumptions, stated in every report: attention runs PyTorch SDPA (its fused kernels
keep the output and the log-sum-exp, never the s×s scores, on CPU and CUDA alike);
the optimizer step runs per parameter (as fused AdamW on CUDA) with state in the
parameter dtype; the CUDA caching allocator's fragmentation is not modelled.

By default the figures are extrapolated from a few small simulations
(:mod:`longtrain.plan.extrapolate`); ``exact=True`` simulates the whole model at the whole
length. With a machine named, a length that cannot fit it whatever the simulation finds is
refused at once (counted: :mod:`longtrain.plan.bounds`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten
from transformers import PretrainedConfig

from .. import registry
from ..errors import LongtrainError
from ..memory.placement import fragmentation_report
from ..memory.tracker import CATEGORIES, MemoryReport, MemoryTracker, in_backward
from ..memory.units import format_bytes, parse_bytes
from ..models.adapters import adapter_class, describe_model
from ..models.loading import default_dtype, load_config, parse_dtype
from ..optimizers import make_optimizer
from ..parallel.distributed import simulated_world
from ..parallel.layer_groups import busiest_group
from ..strategy import Strategy, applied_context, apply, step
from .bounds import refuse_lengths_that_cannot_fit
from .extrapolate import (
    ChunkCurve,
    _budget_stops_layers,
    _fit,
    _kept_outputs_apart,
    _layers,
    _Simulated,
    _stable_phases,
    chunk_of,
)
from .fake_model import build_fake_model, represented_parameters, with_4bit_base
from .report import format_table

__all__ = [
    "ASSUMPTIONS",
    "WARM_STARTS",
    "SimulationReport",
    "build_fake_model",
    "chunk_curve",
    "format_table",
    "on_machine",
    "run_training_steps",
    "simulate",
]


ASSUMPTIONS = (
    "attention: fused flash kernel, whole-sequence or per chunk (saves output + log-sum-exp, no s×s scores); "
    "optimizer: per-parameter step (AdamW: float32 masters and moments for 16-bit weights, adamw-16bit: state in "
    "their dtype); allocator fragmentation not modelled; "
    "under --sp: one rank's share, FSDP2's all-gather buffer counted, its gathered parameter copy not"
)


def run_training_steps(
    build_model: Callable[[], nn.Module],
    *,
    seq_len: int,
    batch_size: int = 1,
    strategy: Strategy | str | None = None,
    optimizer: str = "adamw",
    dtype: torch.dtype = torch.float32,
    iterations: int = 2,
    fake: bool = True,
    seed: int = 0,
    grad_accum: int = 1,
    trace: list | None = None,
    progress: Callable[[str], None] | None = None,
    phases: dict | None = None,
    warm_start: bool = False,
    host_memory: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[MemoryReport, int]:
    """Train ``iterations`` steps and report the last step's peak.

    ``grad_accum`` micro-batches per step: from the second on, the gradients of the
    earlier ones are alive during the forward pass, as in real accumulation. ``trace``:
    a list that receives the last step's device allocation trace (for the memory planner).
    ``progress``: called with a line as each step starts. ``phases``: a dict that receives
    the last step's peaks per place in the model's repeating structure (:class:`_PhaseMarks`)
    under ``"peaks"``, the number of times each place was reached (``"calls"``), the layer
    count (``"layers"``) and the tracker (``"tracker"``, for breakdowns at those peaks).
    ``warm_start``: instead of the first ``iterations - 1`` steps, give the optimizer its
    state by one step on zero gradients, then measure one step (only for optimizers whose
    state does not depend on the step's work: :data:`WARM_STARTS`). ``host_memory``: the
    host memory of the machine simulated, in bytes (:attr:`EngineContext.host_memory`: the
    default budget of whatever parks in host memory); None: unbounded. A real run
    (``fake=False``) keeps this machine's unless one is given. ``device``: where a real
    run's token ids are drawn (the model's device: ``build_model`` places the model; default
    the CPU).

    ``build_model()`` must return a model (strategy not yet applied). With ``fake=True``
    everything runs on fake tensors; with ``fake=False`` it allocates for real, which
    is the exact CPU measurement. Returns (report, parameter count).
    """
    strategy = Strategy.parse(strategy)
    with contextlib.ExitStack() as stack:
        if strategy.sequence_parallel is not None:
            if not fake:
                raise LongtrainError("sequence parallelism is measured under torchrun, or simulated (fake=True)")
            stack.enter_context(simulated_world(strategy.sequence_parallel.processes or strategy.sequence_parallel.degree))
        if fake:
            stack.enter_context(FakeTensorMode())
        stack.enter_context(default_dtype(dtype))
        torch.manual_seed(seed)
        model = build_model()
        apply(model, strategy)
        if fake or host_memory is not None:  # the machine simulated, not the one simulating
            applied_context(model).host_memory = host_memory
        model.train()
        n_params = represented_parameters(model)
        vocab = describe_model(model.config).vocab
        opt = make_optimizer(optimizer, model.parameters(), lr=1e-4, model=model)
        generator = None if fake else torch.Generator(device or "cpu").manual_seed(seed)
        if warm_start and opt is not None and optimizer in WARM_STARTS:
            _initialize_state(model, opt)
            iterations = 1
        with MemoryTracker(model, opt) as tracker:
            marks = _PhaseMarks(tracker, applied_context(model).adapter.layers) if phases is not None else None
            for it in range(iterations):
                if progress is not None:
                    progress(f"step {it + 1} of {iterations}" + (" (measured)" if it == iterations - 1 else ""))
                if it == iterations - 1:
                    tracker.reset_peak()
                    if marks is not None:
                        marks.new_step()
                for micro in range(grad_accum):
                    if marks is not None:
                        marks.micro_batch(micro)
                    input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator,
                                              device=None if fake else device)
                    # The label count is passed, not computed: under fake tensors it would
                    # need the data (every position but the last has a label here).
                    step(model, {"input_ids": input_ids}, strategy, num_label_tokens=grad_accum * batch_size * (seq_len - 1))
                    del input_ids
                if marks is not None:
                    marks.optimizer_step()
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
            report = tracker.report()
            if trace is not None:
                trace.extend(tracker.trace())
            if marks is not None:
                marks.remove()
                phases.update(peaks=tracker.phase_peaks(), calls=dict(marks.calls), layers=len(marks.index),
                              tracker=tracker)
    return report, n_params


WARM_STARTS = ("adamw", "adamw-16bit", "sgd")  # PyTorch's optimizers: their state is created by any step, whatever the gradients


def _initialize_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state as after a first step, from a step on zero gradients (which
    leaves the weights as they are: AdamW's update is 0 / (0 + eps), SGD's 0)."""
    params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad and not p.is_meta]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _PhaseMarks:
    """Labels the tracker's phases (:meth:`MemoryTracker.set_phase`) by the place of the
    step in its repeating structure. A place is a decoder layer entered, left, or reached
    by its output's gradient (its backward begins) — in which pass (with gradients,
    without, inside backward: recomputation), for the how-many-th time in this micro-batch
    (the chunk, in chunked engines), in which micro-batch — and within it the how-many-th
    repeat of a loop whose length grows with the sequence (:func:`~longtrain.memory.tracker.mark_repeat`:
    attention history blocks, head chunks). The embeddings and the head belong to the
    places of the layers next to them; the optimizer step has its own."""

    def __init__(self, tracker: MemoryTracker, layers):
        self.tracker = tracker
        self.index = {id(layer): j for j, layer in enumerate(layers)}
        self.calls: dict = collections.Counter()  # (place without its count) -> times reached
        self.micro = 0
        self.place: tuple = ("step",)
        self.handles = []
        for layer in layers:
            self.handles.append(layer.register_forward_pre_hook(self._enter))
            self.handles.append(layer.register_forward_hook(self._leave, always_call=True))
        tracker.on_repeat = self._repeat

    def new_step(self) -> None:
        self.calls.clear()
        self._set(("step",))

    def optimizer_step(self) -> None:
        self._set(("optimizer",))

    def micro_batch(self, micro: int) -> None:
        self.micro = micro
        self._set(("micro-batch", micro))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.tracker.on_repeat = None

    def _set(self, place: tuple) -> None:
        self.place = place
        self.tracker.set_phase((place,))

    def _count(self, key) -> int:
        count = self.calls[key]
        self.calls[key] = count + 1
        return count

    def _mark(self, event: str, j: int) -> None:
        kind = "backward" if in_backward() else ("grad" if torch.is_grad_enabled() else "no-grad")
        self._set(("layer", event, kind, j, self._count(("layer", event, kind, j, self.micro)), self.micro))

    def _repeat(self, kind: str) -> None:
        self.tracker.set_phase((self.place, ("repeat", kind, self._count((self.place, kind)))))

    def _enter(self, module, args) -> None:
        self._mark("enter", self.index[id(module)])

    def _leave(self, module, args, output) -> None:
        j = self.index[id(module)]
        self._mark("leave", j)
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._gradient_arrived, j))
                    break

    def _gradient_arrived(self, j: int, grad) -> None:
        self._mark("gradient", j)


@dataclass
class SimulationReport:
    model: str
    seq_len: int
    batch_size: int
    strategy: dict
    optimizer: str
    dtype: str
    parameters: int
    peak: MemoryReport
    assumptions: str = ASSUMPTIONS
    fragmentation: Any = None  # a FragmentationReport when asked for
    notes: dict = field(default_factory=dict)  # what techniques chose (memo's alpha)
    lora_rank: int | None = None  # LoRA adapters of this rank on every linear layer but the head
    trainable_parameters: int | None = None  # those with gradients and optimizer state
    method: str = "exact: every layer at the whole length"  # or the sizes the figures were extrapolated from
    flops_per_token: float | None = None  # forward + backward model FLOPs (a mixture of experts: its active ones)
    active_parameters: int | None = None  # matmul parameters a token multiplies by
    matmul_parameters: int | None = None  # all matmul parameters (every expert)
    layer_groups: int | None = None  # the adjoint engine's layers over this many processes: the busiest one's share
    base_bits: int | None = None  # 4: the base's linear weights held in 4 bits by bitsandbytes (NF4)

    @property
    def device_peak_bytes(self) -> int:
        return self.peak.peak_device_bytes

    def verdict(self, device_memory: int | None = None, host_memory: int | None = None) -> tuple[bool, str]:
        """Whether the simulated peaks fit ``device_memory`` and ``host_memory`` bytes (either
        may be None: not judged), and one line saying so — or by how much they do not."""
        judged = [(what, need, have) for what, need, have in
                  (("device", self.peak.peak_device_bytes, device_memory), ("host", self.peak.peak_host_bytes, host_memory))
                  if have is not None]
        over = [f"{what} {format_bytes(need)} > {format_bytes(have)} by {format_bytes(need - have)}"
                for what, need, have in judged if need > have]
        if over:
            return False, "does not fit: " + "; ".join(over)
        return True, "fits: " + ", ".join(f"{what} {format_bytes(need)} of {format_bytes(have)}" for what, need, have in judged)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["peak"] = self.peak.to_dict()
        return data

    def fragmentation_table(self) -> str:
        rows = [("device memory of the last step", "")] + self.fragmentation.rows()
        return format_table(rows) + (f"\n({self.fragmentation.blocks:,} tensors; offsets planned once for the "
                                     "recorded step, as Memo's memory planner does)")

    def table(self) -> str:
        """Device and host bytes by category at the device peak, plus the largest tensors."""
        rows = [("category", "device", "host")]
        for category in CATEGORIES:
            rows.append((category, format_bytes(self.peak.device_bytes(category)), format_bytes(self.peak.host_bytes(category))))
        rows.append(("total at device peak", format_bytes(self.peak.peak_device_bytes), format_bytes(self.peak.host_bytes_at_peak)))
        rows.append(("host peak", "", format_bytes(self.peak.peak_host_bytes)))
        strategy_name = Strategy.from_dict(self.strategy).spec
        optimizer = "adamw in host memory (--optimizer-offload)" if self.optimizer == "adamw-offload" else self.optimizer
        lora = (f", LoRA rank {self.lora_rank} ({self.trainable_parameters / 1e6:.1f}M trainable)"
                if self.lora_rank else "") + (" over a 4-bit (NF4) base" if self.base_bits else "")
        head = (
            f"{self.model}: {self.parameters / 1e9:.2f}B parameters{lora}, seq_len {self.seq_len}, batch {self.batch_size}, "
            f"strategy {strategy_name}, optimizer {optimizer}, {self.dtype}"
        )
        sp = (self.strategy or {}).get("sequence_parallel") or {}
        if sp.get("processes"):  # data-parallel groups of ``degree``
            head += f"; one of {sp['processes']} processes in groups of {sp['degree']}, FSDP2 sharding over all"
        if self.layer_groups:
            head += (f"; the busiest of {self.layer_groups} layer groups (its layers with the embedding and the head; "
                     "the parameters are its share)")
        largest = "largest tensors at the device peak:"
        if not self.method.startswith("exact"):
            largest = "largest tensors at the device peak of the largest simulation extrapolated from:"
        lines = [head]
        if self.flops_per_token:
            experts = (f" (of {self.matmul_parameters / 1e9:.2f}B: the experts a token runs)"
                       if self.active_parameters != self.matmul_parameters else "")
            lines.append(f"model FLOPs per token: {self.flops_per_token / 1e9:.2f} G = 6 × {self.active_parameters / 1e9:.2f}B "
                         f"matmul parameters{experts} + causal attention")
        lines += [format_table(rows), "", largest]
        for info in self.peak.largest:
            shape = "x".join(str(d) for d in info.shape)
            lines.append(f"  {format_bytes(info.nbytes):>12}  {info.category:<16} {info.location:<6} {info.dtype}[{shape}]  {info.origin}")
        for key, value in self.notes.items():
            lines.append(f"{key}: {value:.3g}" if isinstance(value, float) else f"{key}: {value}")
        if self.fragmentation is not None:
            lines += ["", self.fragmentation_table()]
        lines.append(f"simulated: {self.method}")
        lines.append(f"assumes {self.assumptions}")
        return "\n".join(lines)


def simulate(
    model: str | PretrainedConfig,
    seq_len: int,
    *,
    batch_size: int = 1,
    strategy: Strategy | str | None = None,
    optimizer: str = "adamw",
    dtype: str | torch.dtype = "bfloat16",
    lora_rank: int | None = None,
    iterations: int | None = None,
    grad_accum: int = 1,
    fragmentation: bool = False,
    exact: bool = False,
    progress: Callable[[str], None] | None = None,
    device_memory: int | str | None = None,
    host_memory: int | str | None = None,
    layer_groups: int | None = None,
    planning: bool = False,
    four_bit: bool = False,
) -> SimulationReport:
    """Simulated steady-state peak of one training step at full scale (no allocation).

    ``model`` is a preset name (``"llama3-8b"``), a local model directory (only its
    config is read) or a ``PretrainedConfig``. ``iterations``: steps simulated (default
    2, so optimizer state exists at the peak; 1 suffices with ``optimizer="none"``).
    ``grad_accum``: micro-batches per step (gradients alive during later forwards).
    ``lora_rank``: train LoRA adapters of this rank (every linear layer but the head, as
    ``longtrain train --lora``): the base weights are frozen (no gradients, no optimizer
    state). ``fragmentation``: also plan the last step's device memory offline
    (:func:`longtrain.memory.placement.fragmentation_report`; needs the whole step's trace, so
    it implies ``exact``). ``exact``: simulate every layer at the whole length instead of
    extrapolating from a few layers and chunks (:mod:`longtrain.plan.extrapolate`; minutes to hours at
    long context instead of seconds). ``progress``: called with a line per simulation
    run or step.

    The machine simulated (bytes, or sizes like ``"120GiB"``): ``host_memory`` is the host
    memory the run may use — the default budget of everything a strategy parks there
    (Memo's swapped activations, kept attention outputs and parked inputs, chunk stores)
    where the strategy names none, as a real run takes half its machine's physical memory;
    None: unbounded, every layer parks what it can and the report's host peak says how much
    that is. Nothing depends on the memory of the machine that simulates. With
    ``device_memory`` and/or ``host_memory``, a length that cannot fit them whatever the
    simulation finds (the token ids and what the strategy parks, counted, not simulated)
    is refused at once, naming the longest that could.

    ``layer_groups``: the adjoint engine's layers over that many processes; the busiest
    rank (:func:`~longtrain.parallel.layer_groups.busiest_group`) as one process.
    ``planning``: the planner's figures, from the fit simulations without the checks
    beyond them (:func:`~longtrain.plan.extrapolate._fit`). ``four_bit``: the base held in 4
    bits by bitsandbytes, NF4 (:mod:`~longtrain.plan.fake_model`; with ``lora_rank``), as a
    config whose ``quantization_config`` loads in 4 bits is simulated anyway.
    """
    if lora_rank is not None and (isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank <= 0):
        raise LongtrainError(f"lora_rank must be a positive integer, got {lora_rank!r}")
    device_memory, host_memory = (None if size is None else _machine_bytes(name, size)
                                  for name, size in (("device_memory", device_memory), ("host_memory", host_memory)))
    config = load_config(model)
    if four_bit:
        config = with_4bit_base(config)
    adapter_class(config.model_type).allow_positions(config, seq_len)
    config.use_cache = False
    torch_dtype = parse_dtype(dtype)
    strategy = Strategy.parse(strategy)
    if layer_groups is not None:
        if registry.engine(strategy.engine).layer_groups is None:
            raise LongtrainError(f"layer groups split the layers of the adjoint engine over processes, not the "
                                 f"{strategy.engine} engine's; pass --engine adjoint (a transformer's sequence splits: --sp)")
        config = busiest_group(config, layer_groups)
    simulated = on_machine(strategy, host_memory)  # what a run there resolves its default budgets to
    if device_memory is not None or host_memory is not None:
        refuse_lengths_that_cannot_fit(config, seq_len, simulated, torch_dtype, batch_size, device_memory, host_memory)
    run, warm_start = _runner(strategy, batch_size=batch_size, optimizer=optimizer, dtype=torch_dtype,
                              lora_rank=lora_rank, iterations=iterations, grad_accum=grad_accum)
    say = progress or (lambda _: None)

    result = None
    if not (exact or fragmentation):
        item = torch.tensor([], dtype=torch_dtype).element_size()
        fitted = _fit(config, seq_len, simulated, functools.partial(run, warm_start=warm_start), say,
                      _kept_outputs_apart(config, simulated, batch_size, torch_dtype),
                      whole_layers=_budget_stops_layers(config, seq_len, simulated, batch_size, item), planning=planning)
        result = fitted.simulated(simulated) if fitted is not None else None
    if result is None:
        trace = [] if fragmentation else None
        started = time.perf_counter()
        say(f"simulating all {_layers(config)} layers at {seq_len:,} tokens")
        result = run(config, seq_len, simulated, trace=trace, progress=say)
        say(f"simulated in {time.perf_counter() - started:.1f} s")
        frag = fragmentation_report(trace) if fragmentation else None
    else:
        frag = None
    name = model if isinstance(model, str) else getattr(config, "name_or_path", "") or config.model_type
    return SimulationReport(
        model=name, seq_len=seq_len, batch_size=batch_size, strategy=strategy.to_dict(), optimizer=optimizer,
        dtype=str(torch_dtype).replace("torch.", ""), parameters=result.parameters, peak=result.report, fragmentation=frag,
        notes=result.notes, lora_rank=lora_rank, trainable_parameters=result.trainable if lora_rank else None,
        method=result.method, layer_groups=layer_groups, base_bits=adapter_class(config.model_type).base_bits(config),
        **_flop_facts(config, seq_len),
    )


def _flop_facts(config, seq_len: int) -> dict:
    shape = describe_model(config)
    if not shape.feed_forward:  # SSMs: their recurrence's FLOPs are not counted
        return {}
    return {"flops_per_token": shape.flops_per_token(seq_len), "active_parameters": shape.matmul_parameters(True),
            "matmul_parameters": shape.matmul_parameters(False)}


def _machine_bytes(name: str, size: int | str) -> int:
    value = parse_bytes(size)
    if isinstance(value, bool) or value <= 0:
        raise LongtrainError(f"{name} must be a positive size, got {size!r}")
    return value


def on_machine(strategy: Strategy, host_memory: int | None) -> Strategy:
    """``strategy`` as a run on a machine whose run may use ``host_memory`` bytes of host
    memory resolves it: every host budget left to its default (an engine's or a technique's
    ``host_memory`` of None) set to that; as it is where ``host_memory`` is None (unbounded)."""
    if host_memory is None:
        return strategy

    def resolved(costs, options):
        if costs.host_budget_option is not None and costs.host_budget(options) is None:
            return costs.with_host_budget_named(options, host_memory)
        return options

    return Strategy(strategy.engine, resolved(registry.engine(strategy.engine).costs, strategy.engine_options),
                    strategy.sequence_parallel, **{name: resolved(registry.technique(name).costs, options)
                                                   for name, options in strategy.techniques.items()})


def chunk_curve(model: str | PretrainedConfig, strategy: Strategy | str, *, batch_size: int = 1,
                optimizer: str = "adamw", dtype: str | torch.dtype = "bfloat16", lora_rank: int | None = None,
                iterations: int | None = None, progress: Callable[[str], None] | None = None,
                planning: bool = False) -> ChunkCurve | None:
    """The peaks of ``strategy``'s chunked engine at every length of whole chunks from a
    few small simulations (a minute for an 8B model): what a search for the longest
    context evaluates instead of a simulation per length. None where the figures are not
    extrapolated along chunks (sequence parallelism; a pattern that never settles)."""
    strategy = Strategy.parse(strategy)
    chunk = chunk_of(strategy)
    if chunk is None:
        return None
    # Far more chunks than the small simulations hold, so that the chunk axis is extrapolated;
    # the length itself only sets the target, which the curve replaces.
    seq_len = chunk * 2**20
    config = load_config(model)
    # Positions for the small simulations (a few chunks); memory does not depend on this
    # setting in the supported families (rotary angles are computed per position).
    adapter_class(config.model_type).allow_positions(config, 64 * chunk)
    config.use_cache = False
    torch_dtype = parse_dtype(dtype)
    run, warm_start = _runner(strategy, batch_size=batch_size, optimizer=optimizer, dtype=torch_dtype,
                              lora_rank=lora_rank, iterations=iterations, grad_accum=1)
    fitted = _fit(config, seq_len, strategy, functools.partial(run, warm_start=warm_start), progress or (lambda _: None),
                  _kept_outputs_apart(config, strategy, batch_size, torch_dtype), planning=planning)
    if fitted is None or fitted.chunks is None:
        return None
    return ChunkCurve(chunk, fitted.chunks.first + 3, strategy, fitted)


def _runner(strategy: Strategy, *, batch_size, optimizer, dtype, lora_rank, iterations, grad_accum):
    """(one simulation of a step — :func:`_simulate_once` with the run's settings — and
    whether the small simulations may warm-start the optimizer)."""
    # The small simulations start from the optimizer's state (one measured step) where that
    # is the steady state: not where a technique decides at its first step (memo's α).
    warm_start = iterations is None and not any(registry.technique(name).costs.decides_at_first_step
                                                for name in strategy.techniques)
    run = functools.partial(_simulate_once, batch_size=batch_size, optimizer=optimizer, dtype=dtype,
                            lora_rank=lora_rank, iterations=iterations or (1 if optimizer == "none" else 2),
                            grad_accum=grad_accum)
    return run, warm_start


# ---- one simulation -------------------------------------------------------------------------

def _simulate_once(config, seq_len: int, strategy: Strategy, *, batch_size, optimizer, dtype, lora_rank, iterations,
                   grad_accum, trace=None, progress=None, places: tuple[int, int] | None = None,
                   warm_start: bool = False) -> _Simulated:
    """One simulation; with ``places`` = (layer period, depth), also the peaks of each
    place of the repeating structure (:func:`_stable_phases`)."""
    built: list = []  # the model, for what its techniques noted (memo's alpha)

    def build():
        built.append(build_fake_model(config, dtype, lora_rank))
        return built[-1]

    phases = {} if places is not None else None
    report, n_params = run_training_steps(
        build, seq_len=seq_len, batch_size=batch_size, strategy=strategy, optimizer=optimizer, dtype=dtype,
        iterations=iterations, grad_accum=grad_accum, trace=trace, progress=progress, phases=phases,
        warm_start=warm_start,
    )
    model = built[0]
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    context = applied_context(model)
    # A budget left unbounded (no host memory named) is noted as None, not infinity.
    notes = {key: None if isinstance(value, float) and value == math.inf else value
             for key, value in (context.notes if context is not None else {}).items()}
    if places is None:
        return _Simulated(report, n_params, trainable, notes)
    return _Simulated(report, n_params, trainable, notes, phases=_stable_phases(phases, *places),
                      tracker=phases["tracker"])
