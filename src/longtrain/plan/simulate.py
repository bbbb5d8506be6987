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

**Extrapolation** (:func:`simulate`'s default; ``exact=True`` runs the whole model at the
whole length). A step repeats itself layer by layer — and in the chunked engines (fpdt,
seco, spaco) chunk by chunk — so every figure of the report (the peaks, and each
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
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch import nn
from torch.utils._pytree import tree_flatten
from transformers import PretrainedConfig

from ..errors import LongtrainError
from ..memory.plan import fragmentation_report
from ..memory.tracker import CATEGORIES, DEVICE, HOST, MemoryReport, MemoryTracker, in_backward
from ..memory.units import format_bytes
from ..models.loading import add_lora, build_from_config, default_dtype, load_config, parse_dtype
from ..optimizers import make_optimizer
from ..parallel.distributed import simulated_world
from ..strategy import Strategy, applied_context, apply, step

ASSUMPTIONS = (
    "attention: fused flash kernel, whole-sequence or per chunk (saves output + log-sum-exp, no s×s scores); "
    "optimizer: per-parameter step, state in parameter dtype; allocator fragmentation not modelled; "
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
    (``fake=False``) keeps this machine's unless one is given.

    ``build_model()`` must return a model (strategy not yet applied). With ``fake=True``
    everything runs on fake tensors; with ``fake=False`` it allocates for real, which
    is the exact CPU measurement. Returns (report, parameter count).
    """
    strategy = Strategy.parse(strategy)
    with contextlib.ExitStack() as stack:
        if strategy.sequence_parallel is not None:
            if not fake:
                raise LongtrainError("sequence parallelism is measured under torchrun, or simulated (fake=True)")
            stack.enter_context(simulated_world(strategy.sequence_parallel.degree))
        if fake:
            stack.enter_context(FakeTensorMode())
        stack.enter_context(default_dtype(dtype))
        torch.manual_seed(seed)
        model = build_model()
        apply(model, strategy)
        if fake or host_memory is not None:  # the machine simulated, not the one simulating
            applied_context(model).host_memory = host_memory
        model.train()
        n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        vocab = model.config.vocab_size
        opt = make_optimizer(optimizer, model.parameters(), lr=1e-4, model=model)
        generator = None if fake else torch.Generator().manual_seed(seed)
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
                    input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
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


WARM_STARTS = ("adamw", "sgd")  # PyTorch's optimizers: their state is created by any step, whatever the gradients


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
        strategy_name = Strategy.from_dict(self.strategy).name
        lora = (f", LoRA rank {self.lora_rank} ({self.trainable_parameters / 1e6:.1f}M trainable)"
                if self.lora_rank else "")
        head = (
            f"{self.model}: {self.parameters / 1e9:.2f}B parameters{lora}, seq_len {self.seq_len}, batch {self.batch_size}, "
            f"strategy {strategy_name}, optimizer {self.optimizer}, {self.dtype}"
        )
        largest = "largest tensors at the device peak:"
        if not self.method.startswith("exact"):
            largest = "largest tensors at the device peak of the largest simulation extrapolated from:"
        lines = [head, format_table(rows), "", largest]
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


def format_table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


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
) -> SimulationReport:
    """Simulated steady-state peak of one training step at full scale (no allocation).

    ``model`` is a preset name (``"llama3-8b"``), a local model directory (only its
    config is read) or a ``PretrainedConfig``. ``iterations``: steps simulated (default
    2, so optimizer state exists at the peak; 1 suffices with ``optimizer="none"``).
    ``grad_accum``: micro-batches per step (gradients alive during later forwards).
    ``lora_rank``: train LoRA adapters of this rank (every linear layer but the head, as
    ``longtrain train --lora``): the base weights are frozen (no gradients, no optimizer
    state). ``fragmentation``: also plan the last step's device memory offline
    (:func:`longtrain.memory.plan.fragmentation_report`; needs the whole step's trace, so
    it implies ``exact``). ``exact``: simulate every layer at the whole length instead of
    extrapolating from a few layers and chunks (module docstring; minutes to hours at
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
    """
    if lora_rank is not None and (isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank <= 0):
        raise LongtrainError(f"lora_rank must be a positive integer, got {lora_rank!r}")
    device_memory, host_memory = (None if size is None else _machine_bytes(name, size)
                                  for name, size in (("device_memory", device_memory), ("host_memory", host_memory)))
    config = load_config(model)
    config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, seq_len)
    config.use_cache = False
    torch_dtype = parse_dtype(dtype)
    strategy = Strategy.parse(strategy)
    simulated = on_machine(strategy, host_memory)  # what a run there resolves its default budgets to
    if device_memory is not None or host_memory is not None:
        _refuse_lengths_that_cannot_fit(config, seq_len, simulated, torch_dtype, batch_size, device_memory, host_memory)
    run, warm_start = _runner(strategy, batch_size=batch_size, optimizer=optimizer, dtype=torch_dtype,
                              lora_rank=lora_rank, iterations=iterations, grad_accum=grad_accum)
    say = progress or (lambda _: None)

    result = None
    if not (exact or fragmentation):
        item = torch.tensor([], dtype=torch_dtype).element_size()
        fitted = _fit(config, seq_len, simulated, functools.partial(run, warm_start=warm_start), say,
                      _kept_outputs_apart(config, simulated, batch_size, torch_dtype),
                      whole_layers=_budget_stops_layers(config, seq_len, simulated, batch_size, item))
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
        method=result.method,
    )


def _machine_bytes(name: str, size: int | str) -> int:
    from ..memory.units import parse_bytes

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

    def resolved(options):
        if dataclasses.is_dataclass(options) and getattr(options, "host_memory", 0) is None:
            return dataclasses.replace(options, host_memory=host_memory)
        return options

    return Strategy(strategy.engine, resolved(strategy.engine_options), strategy.sequence_parallel,
                    **{name: resolved(options) for name, options in strategy.techniques.items()})


def _budget_stops_layers(config, seq_len: int, strategy: Strategy, batch: int, item: int) -> bool:
    """Whether a technique's host budget stops it partway up the model — some layers park or
    keep what the others cannot (``host_bytes_wanted`` over ``host_memory``). Which ones is
    a count of whole layers, not a share, so a few layers cannot stand for the model: it is
    simulated whole (where nothing stops, the small simulations run without the budget)."""
    for options in strategy.techniques.values():
        wanted, budget = getattr(options, "host_bytes_wanted", None), getattr(options, "host_memory", None)
        if wanted is not None and budget is not None and wanted(config, batch, seq_len, item) > budget:
            return True
    return False


def _refuse_lengths_that_cannot_fit(config, seq_len: int, strategy: Strategy, dtype: torch.dtype, batch: int,
                                    device_memory: int | None, host_memory: int | None) -> None:
    """Refuse at once a length whose token ids and parked activations alone — counted from
    the config (:func:`~longtrain.plan.planner.least_bytes`), not simulated — exceed the
    machine named, naming the longest length that could fit beside the weights."""
    from .planner import least_bytes, longest_where

    item = torch.tensor([], dtype=dtype).element_size()
    gpus = strategy.sequence_parallel.degree if strategy.sequence_parallel is not None else 1

    def over(tokens: int, weights: int = 0) -> list[str]:
        device, host = least_bytes(config, tokens, strategy, item, batch, gpus)
        return [f"{need} of {where} memory, {format_bytes(have)} named"
                for where, need, have in (("device", format_bytes(weights + device), device_memory),
                                          ("host", format_bytes(host), host_memory))
                if have is not None and (weights + device if where == "device" else host) > have]

    if not over(seq_len):
        return
    from .planner import _state_bytes

    weights = _state_bytes(config, "none", dtype)[0] * item // gpus  # frozen under LoRA, there all the same
    longest = longest_where(lambda tokens: not over(tokens, weights), seq_len)
    raise LongtrainError(
        f"{seq_len:,} tokens cannot fit: under strategy {strategy.name or 'none'}, the token ids and what the step parks "
        f"alone need at least {'; '.join(over(seq_len))} (counted, not simulated); "
        + (f"at most {longest:,} tokens could fit beside the weights" if longest else
           "no length fits beside the weights")
        + (f" ({batch} per batch)" if batch > 1 else ""))


@dataclass
class ChunkCurve:
    """A chunked engine's simulated step as a function of its length in whole chunks
    (:func:`chunk_curve`): at ``chunks`` ≥ :attr:`fewest` the figures
    :func:`simulate` gives at ``chunks × chunk`` tokens, without simulating again —
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


def chunk_curve(model: str | PretrainedConfig, strategy: Strategy | str, *, batch_size: int = 1,
                optimizer: str = "adamw", dtype: str | torch.dtype = "bfloat16", lora_rank: int | None = None,
                iterations: int | None = None, progress: Callable[[str], None] | None = None) -> ChunkCurve | None:
    """The peaks of ``strategy``'s chunked engine at every length of whole chunks from a
    few small simulations (a minute for an 8B model): what a search for the longest
    context evaluates instead of a simulation per length. None where the figures are not
    extrapolated along chunks (sequence parallelism; a pattern that never settles)."""
    strategy = Strategy.parse(strategy)
    if strategy.engine not in _CHUNKED or strategy.sequence_parallel is not None:
        return None
    chunk = strategy.engine_options.chunk
    # Far more chunks than the small simulations hold, so that the chunk axis is extrapolated;
    # the length itself only sets the target, which the curve replaces.
    seq_len = chunk * 2**20
    config = load_config(model)
    # Positions for the small simulations (a few chunks); memory does not depend on this
    # setting in the supported families (rotary angles are computed per position).
    config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, 64 * chunk)
    config.use_cache = False
    torch_dtype = parse_dtype(dtype)
    run, warm_start = _runner(strategy, batch_size=batch_size, optimizer=optimizer, dtype=torch_dtype,
                              lora_rank=lora_rank, iterations=iterations, grad_accum=1)
    fitted = _fit(config, seq_len, strategy, functools.partial(run, warm_start=warm_start), progress or (lambda _: None),
                  _kept_outputs_apart(config, strategy, batch_size, torch_dtype))
    if fitted is None or fitted.chunks is None:
        return None
    return ChunkCurve(chunk, fitted.chunks.first + 3, strategy, fitted)


def _runner(strategy: Strategy, *, batch_size, optimizer, dtype, lora_rank, iterations, grad_accum):
    """(one simulation of a step — :func:`_simulate_once` with the run's settings — and
    whether the small simulations may warm-start the optimizer)."""
    # The small simulations start from the optimizer's state (one measured step) where that
    # is the steady state: not where a technique decides at its first step (memo's α).
    warm_start = iterations is None and "memo" not in strategy.techniques
    run = functools.partial(_simulate_once, batch_size=batch_size, optimizer=optimizer, dtype=dtype,
                            lora_rank=lora_rank, iterations=iterations or (1 if optimizer == "none" else 2),
                            grad_accum=grad_accum)
    return run, warm_start


# ---- one simulation -------------------------------------------------------------------------

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


def build_fake_model(config: PretrainedConfig, dtype: torch.dtype, lora_rank: int | None = None) -> nn.Module:
    """The model of ``config`` for a simulation, with LoRA adapters of ``lora_rank`` when
    given; call it under ``FakeTensorMode``.

    Without LoRA the model is built in the fake mode directly. peft cannot add adapters
    there: it moves each new adapter to its base layer's device and dtype with
    ``Module.to``, and PyTorch swaps every fake parameter for its converted copy with
    ``torch.utils.swap_tensors`` — even when the copy is the tensor itself — which refuses
    tensors that the fake mode holds weak references to. So with LoRA the model and its
    adapters are built on the meta device (peft leaves meta adapters where they are; they
    are created in the default dtype, which :func:`run_training_steps` sets to the
    model's, as peft's move would), and every parameter and buffer is then replaced by a
    fake tensor of its shape, dtype and ``requires_grad`` — shared ones (tied embeddings)
    stay shared.
    """
    if not lora_rank:
        return build_from_config(config, dtype)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("meta"):
        model = add_lora(build_from_config(config, dtype), rank=lora_rank)
    return _meta_to_fake(model)


def _meta_to_fake(model: nn.Module, device: str = "cpu") -> nn.Module:
    """Replace the meta parameters and buffers of ``model`` by (fake) tensors on ``device``."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                new = done.get(id(tensor))
                if new is None:
                    new = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    if isinstance(tensor, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                    done[id(tensor)] = new
                table[name] = new
    return model


# ---- extrapolation ----------------------------------------------------------------------------

CHECK_TOLERANCE = 1e-3  # a check simulation further than this (relative) from the extrapolated peak: not settled
_SHIFTS = 2  # times the sizes move one repeat up after a missed check, before the full simulation
_CHUNKED = ("fpdt", "seco", "spaco")


@dataclass(frozen=True)
class _Axis:
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

    def shifted(self) -> "_Axis":
        return dataclasses.replace(self, first=self.first + 1)


def _layers(config) -> int:
    return getattr(config, "num_hidden_layers", 0)


def _per_layer_lists(config) -> dict[str, list]:
    n = _layers(config)
    return {key: value for key, value in vars(config).items()
            if isinstance(value, (list, tuple)) and len(value) == n and key != "architectures"}


def _period(values) -> int:
    """The smallest p with ``values[i] == values[i % p]`` for every i."""
    n = len(values)
    return next(p for p in range(1, n + 1) if all(values[i] == values[i % p] for i in range(n)))


def _layer_period(config, strategy: Strategy) -> int:
    """Layers per repeat: of the config's per-layer lists (Gemma-2's sliding/global
    ``layer_types``) and of FPDT's checkpoint segments."""
    period = 1
    for values in _per_layer_lists(config).values():
        period = math.lcm(period, _period(values))
    return math.lcm(period, max(1, int(getattr(strategy.engine_options, "segment", 1) or 1)))


def _depth(strategy: Strategy) -> int:
    """Repeats at each end of the model (and of a chunk sequence) that may differ from the
    ones between them: the first and the last, and the next ones, which bound the uniform
    middle; Memo's layers kept on the device, and the layers checkpointing leaves whole, are
    more special ones at the top."""
    memo, checkpoint = strategy.techniques.get("memo"), strategy.techniques.get("checkpoint")
    top = max(memo.keep_last if memo is not None else 0, getattr(checkpoint, "except_last", 0))
    return max(2, top + 1)


def _layer_axis(config, strategy: Strategy) -> _Axis | None:
    """Layers in whole repeats (:func:`_layer_period`); the partial repeat at the top is kept
    in every size. At least ``2 · depth`` repeats, so that both ends are told apart."""
    n = _layers(config)
    if not isinstance(n, int) or n < 1 or not _repeats_layers(config, strategy):
        return None
    period = _layer_period(config, strategy)
    offset = n % period
    first = 2 * _depth(strategy) - (1 if offset else 0)  # a partial repeat at the top counts as one
    axis = _Axis("layers", period, offset, n // period, max(1, first))
    return axis if axis.extrapolated else None


def _repeats_layers(config, strategy: Strategy) -> bool:
    # SSM-ResNet (the adjoint engine's models): layer groups over ranks; cheap to simulate whole anyway.
    return config.model_type != "ssm_resnet" and strategy.engine != "adjoint"


def _chunk_axis(config, seq_len: int, strategy: Strategy) -> _Axis | None:
    """Tokens in whole chunks of a chunked engine; the last (possibly partial) chunk is kept
    in every size. At least ``2 · depth`` chunks past the sliding window, if any (until a
    chunk sees a whole window, each sees more than the one before); SpaCO backpropagates
    its last ``budget`` chunks when simulated, so its sizes start two chunks above that.
    Not under sequence parallelism (its padded layouts)."""
    if strategy.engine not in _CHUNKED or strategy.sequence_parallel is not None:
        return None
    chunk = strategy.engine_options.chunk
    count = -(-seq_len // chunk)
    last = seq_len - (count - 1) * chunk
    window = _sliding_window(config)
    first = 2 * _depth(strategy) + (-(-window // chunk) + 1 if window else 0)
    if strategy.engine == "spaco":
        first = max(first, strategy.engine_options.budget + 2)
    axis = _Axis("chunks", chunk, last - chunk, count, first)
    return axis if axis.extrapolated else None


def _sliding_window(config) -> int | None:
    """The attention window in tokens, if any layer has one (Mistral, Gemma-2's sliding layers)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types and "sliding_attention" not in types:
        return None
    return int(window)


def _end(i: int, total: int, depth: int):
    """Where ``i`` of ``total`` repeats sits: ("first", i) or ("last", total - 1 - i) within
    ``depth`` of an end, else None (the uniform middle)."""
    if i < depth:
        return "first", i
    if total - 1 - i < depth:
        return "last", total - 1 - i
    return None


def _stable_phases(phases: dict, period: int, depth: int) -> dict:
    """The peaks of each place (:class:`_PhaseMarks`), labelled so that the same place
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
    small = copy.deepcopy(config)
    for key, values in _per_layer_lists(config).items():
        setattr(small, key, type(values)(values[:layers]))
    small.num_hidden_layers = layers
    return small


def _scaled_strategy(strategy: Strategy, config, layers: int) -> Strategy:
    """The strategy for a simulation with ``layers`` of the model's layers: host budgets that
    bound a whole step are lifted (checked on the extrapolated host peak instead), Memo's is
    scaled to the layers it covers, so that its α is the full model's, and checkpointing's is
    lifted: fewer layers than the whole model are simulated only where it stops none of them
    (:func:`_budget_stops_layers`). Budgets left to their default stay unbounded."""
    options = strategy.engine_options
    if getattr(options, "host_memory", None) is not None:
        options = dataclasses.replace(options, host_memory=None)
    if _partial_kept_outputs(strategy, config):
        # Every layer's output or none (:func:`_kept_outputs_apart` corrects the figures).
        options = dataclasses.replace(options, keep_output=options.settings().offload_inputs)
    techniques = dict(strategy.techniques)
    full = _layers(config)

    def share(budget: int | None, top: int) -> int | None:  # the budget of the layers below ``top``, as in the full model
        return None if budget is None else max(1, budget * max(1, layers - top) // max(1, full - top))

    memo = techniques.get("memo")
    if memo is not None:
        techniques["memo"] = dataclasses.replace(memo, host_memory=share(memo.host_memory, memo.keep_last))
    checkpoint = techniques.get("checkpoint")
    if checkpoint is not None and layers < full:
        techniques["checkpoint"] = dataclasses.replace(checkpoint, host_memory=None)
    return Strategy(strategy.engine, options, strategy.sequence_parallel, **techniques)


def _partial_kept_outputs(strategy: Strategy, config) -> bool:
    """FPDT keeping the attention outputs of the lowest N layers of the model (or as many
    as fit), which a small simulation cannot: its handful of layers would keep all."""
    if strategy.engine != "fpdt" or strategy.sequence_parallel is not None:
        return False
    keep = strategy.engine_options.keep_output
    return keep == "fit" or (not isinstance(keep, bool) and isinstance(keep, int) and 0 < keep < _layers(config))


def _kept_outputs_apart(config, strategy: Strategy, batch_size: int, dtype: torch.dtype):
    """For :func:`_partial_kept_outputs`: the small simulations keep every layer's output
    (in host memory, with ``offload_inputs``) or none (on the device, without), and
    ``correction(tokens)`` gives (device bytes, host bytes) to add at full scale, and the
    count N: the outputs of the layers that keep none taken off the host peak, or those
    of the N layers that keep theirs added to the device peak (all of them alive at once:
    an upper bound). Checked against whole-model simulations (tests/test_simulate_fast.py).
    None where there is nothing to correct."""
    if not _partial_kept_outputs(strategy, config):
        return None
    return _KeptOutputsCorrection(config, strategy.engine_options.settings(), _layers(config), batch_size,
                                  torch.tensor([], dtype=dtype).element_size())


@dataclass(frozen=True, eq=False)
class _KeptOutputsCorrection:
    """:func:`_kept_outputs_apart`'s ``correction``: a module-level class, not a closure, so
    that a fitted simulation holding it goes back from the planner's worker processes (pickled)."""

    config: object
    settings: object
    layers: int
    batch_size: int
    item: int

    def __call__(self, tokens: int) -> tuple[int, int, int]:
        from ..engines.chunked import outputs_that_fit, parked_host_bytes
        from ..models.shapes import kept_output_bytes

        settings, layers = self.settings, self.layers
        kept = outputs_that_fit(settings.keep_output, layers, settings.offload_inputs, settings.host_budget,
                                lambda k: parked_host_bytes(self.config, self.batch_size, tokens, self.item, settings, k))
        one = kept_output_bytes(self.config, self.batch_size, tokens, self.item)
        return (0, -(layers - kept) * one, kept) if settings.offload_inputs else (kept * one, 0, kept)


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
    layers: _Axis | None
    chunks: _Axis | None
    seq_len: int = 0
    kept: Callable[[int], tuple[int, int, int]] | None = None  # :func:`_kept_outputs_apart`

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
        memo = strategy.techniques.get("memo")
        if memo is not None and "memo_host_budget" in notes:
            notes["memo_host_budget"] = memo.host_memory  # the small simulations' is a share of it
        seq_len = axis.value(axis.target) if axis is not None else sims[max(fit)].tokens
        _check_host_budget(strategy, report, seq_len)
        parts = []
        if layers is not None:
            parts.append(f"{layers.value(a)}, {layers.value(a + 1)} layers (checked at {layers.value(a + 2)})")
        if axis is not None:
            parts.append(f"{axis.value(b):,}, {axis.value(b + 1):,} tokens (checked at {axis.value(b + 2):,}; "
                         f"chunks of {axis.unit:,})")
        method = f"extrapolated from {len(sims)} small simulations: " + " × ".join(parts) + "; --exact: the whole model"
        return _Simulated(report, parameters, trainable, notes, method)


def _fit(config, seq_len: int, strategy: Strategy, run, say, kept=None, whole_layers: bool = False) -> _Fitted | None:
    """The small simulations the full-scale figures are extrapolated from, fitted and
    checked (module docstring), or None when there is nothing to extrapolate or the
    pattern never settled. ``kept``: :func:`_kept_outputs_apart`'s correction.
    ``whole_layers``: every layer in every simulation (:func:`_budget_stops_layers`)."""
    layers = None if whole_layers else _layer_axis(config, strategy)
    chunks = _chunk_axis(config, seq_len, strategy)
    if layers is None and chunks is None:
        return None
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
                               _scaled_strategy(strategy, config, n_layers), places=places)
            sims[(u, v)].tokens = tokens
            say(f"[{n}/{len(todo)}] {n_layers} layers at {tokens:,} tokens: {time.perf_counter() - started:.1f} s")

    for attempt in range(_SHIFTS + 1):
        a = layers.first if layers is not None else 0
        b = chunks.first if chunks is not None else 0
        fit = [(a + i, b + j) for i in (0, 1) for j in (0, 1)
               if (i == 0 or layers is not None) and (j == 0 or chunks is not None)]
        layer_check = (a + 2, b + (chunks is not None)) if layers is not None else None
        chunk_check = (a + (layers is not None), b + 2) if chunks is not None else None
        simulate_at(fit + [p for p in (layer_check, chunk_check) if p is not None])
        # The places kept (the ends, shared by every fit simulation) must hold each fit
        # simulation's own peaks — none in the middle — and, extrapolated, the check
        # simulations' peaks.
        unsettled = {p for p in fit + [layer_check, chunk_check]
                     if p is not None and not _reproduces(sims, fit, a, b, p, exactly=p in fit)}
        if not unsettled:
            return _Fitted(sims, fit, a, b, layers, chunks, seq_len, kept)
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
    budget = getattr(strategy.engine_options, "host_memory", None)
    if budget is None or report.peak_host_bytes <= 0:
        return
    from ..memory.units import parse_bytes

    budget = parse_bytes(budget)
    if report.peak_host_bytes > budget:
        raise LongtrainError(
            f"the {strategy.engine} engine needs {format_bytes(report.peak_host_bytes)} of host memory for {seq_len:,} "
            f"tokens (simulated), the host budget is {format_bytes(budget)}; raise host_memory, shorten the sequence, "
            "or offload less"
        )
