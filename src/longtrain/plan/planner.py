"""``longtrain plan``: the fastest exact strategy that trains this model at this length on
this machine — decided before renting it.

For each candidate strategy (layer checkpointing + MsT; Memo + MsT; FPDT at a few chunk
sizes, with everything, only the layer inputs or nothing parked in host memory, with kept
attention outputs — every layer's, or as many as the host holds — or with checkpoint
segments of several layers) and each place for AdamW's state (the device, or host memory
with fp32 master weights: ``--optimizer-offload``):

1. **memory** — the simulator runs one training step on fake tensors (no optimizer step);
   the optimizer's state, which lives through the whole step, is added exactly
   (AdamW: two moments per trainable parameter in the parameter dtype). What the step
   allocates and frees (all but weights and optimizer state) is then multiplied by the
   allocator's fragmentation margin measured on the H100 (up to 1.8 with offload, 1.25 for
   chunked engines without it, 1.1 otherwise): the reserved peak decides whether a run dies;
2. **time** — :func:`~longtrain.plan.time_model.step_time` (matmuls, attention and
   recomputation at the machine's rates);
3. **verdict** — fits or not, and what binds (device or host memory, by how much); the
   fitting ones ranked fastest first.

Before simulating anything, what no strategy can shed — parameters, gradients and
optimizer state — is checked against the device: if it alone does not fit, the answer
comes at once. Each candidate then gets a lower bound of its memory from what it parks
(layer inputs, K/V, attention outputs: counted, not simulated); one whose bound does not
fit is not simulated. The rest are simulated fastest-predicted first; once one fits,
the slower ones are listed as such without simulating them (``exhaustive=True``
simulates them all), ``workers`` at a time in processes of their own. Each simulation
covers the whole length (:func:`simulate_step`: the simulator extends per-phase peaks
itself, seconds to half a minute per 8B candidate); simulations are cached in the process.
``longest=True`` adds, per simulated strategy, the longest context it reaches (a search:
:mod:`longtrain.plan.longest`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engines.chunked import planned_kept_outputs
from ..errors import LongtrainError
from ..memory.units import format_bytes
from ..models.loading import load_config, parse_dtype
from ..models.shapes import kept_output_bytes, kv_bytes_per_token
from ..strategy import Strategy
from ..techniques.memo import Memo
from .time_model import H100, MachineRates, step_time

# The allocator's overhead on what a step allocates and frees (everything but the weights
# and the optimizer state, which are allocated once): (reserved − weights) / (allocated −
# weights) on the H100 (../shared/gpu/h100-2026-11-22.md), the largest seen per kind.
FRAGMENTATION = {"offload": 1.8, "chunked": 1.25, "whole": 1.1}
CHUNKS = (8192, 16384, 32768)
# Layers left whole fill the device up to this share of it: they buy speed, not length,
# and the few GiB left absorb what the margin misses (a run that dies costs more).
WHOLE_LAYERS_FILL = 0.95


def candidates(seq_len: int, host_memory: int | None, layers: int = 32, every_chunk: bool = False,
               chunks: tuple[int, ...] = CHUNKS) -> dict[str, Strategy]:
    """The strategies the planner weighs at ``seq_len`` tokens (fastest-looking kinds of
    each family; SeCO/SpaCO are left out: slower than FPDT at the same memory).
    ``every_chunk``: every chunk size, however many chunks (for :func:`max_context`)."""
    found = {
        # kept attention outputs wait in host memory, within the same budget as Memo's
        "checkpoint,mst": Strategy(checkpoint={"host_memory": host_memory} if host_memory else True, mst=True),
        # ... and the checkpointed inputs too, first in that budget: whole-sequence layers past
        # where their inputs fit on the device (256K tokens of Llama-3-8B on 80 GB)
        "checkpoint:offload_inputs,mst": Strategy(checkpoint={"offload_inputs": True,
                                                              **({"host_memory": host_memory} if host_memory else {})},
                                                  mst=True),
        "memo,mst": Strategy(memo=Memo(host_memory=host_memory), mst=True),
    }
    segment = max(2, round(layers ** 0.5))  # √n segments park the fewest inputs
    for chunk in chunks:
        if not every_chunk and (chunk >= seq_len or seq_len // chunk > 32):  # one chunk is no chunking; many cost host time
            continue
        # What goes to host memory: K/V and layer inputs, the inputs only (one layer's K/V and
        # their gradient sums stay on the device: no copy per pair of chunks), or nothing.
        # √n segments park fewer inputs: weighed with everything parked or nothing, not with the inputs alone.
        for parked, offload, segments in ((":offload", {"offload": True}, True),
                                          (":offload_inputs", {"offload_inputs": True}, False), ("", {}, True)):
            variants = [("", {}), (":keep_output", {"keep_output": True})]
            if segments:
                variants.append((f":segment={segment}", {"segment": segment}))
            if offload and host_memory:  # as many layers' outputs as the host holds (plan() counts them)
                variants.append((":keep_output=fit", {"keep_output": "fit"}))
            for variant, extra in variants:
                options = {"chunk": chunk, **offload, **extra}
                name = f"fpdt:chunk={chunk}{parked}{variant},mst"
                found[name] = Strategy(engine="fpdt", engine_options=options, mst=True)
    return found


def host_budgets_beside_optimizer(strategy: Strategy, room: int) -> Strategy:
    """``strategy`` with Memo's and checkpointing's host budgets cut to ``room``: what AdamW's
    state and master weights leave of the host when they live there."""
    changed = {}
    if "memo" in strategy.techniques:
        changed["memo"] = dataclasses.replace(strategy.techniques["memo"], host_memory=max(1, room))
    checkpoint = strategy.techniques.get("checkpoint")
    if checkpoint is not None and checkpoint.host_memory is not None:
        changed["checkpoint"] = dataclasses.replace(checkpoint, host_memory=max(1, room))
    return _rebuilt(strategy, **changed) if changed else strategy


def outputs_kept_within(config, seq_len: int, strategy: Strategy, item: int, batch: int,
                        room: int) -> tuple[str, Strategy] | None:
    """(label suffix, strategy) of a candidate with FPDT's ``keep_output=fit`` made a count:
    the layers whose attention outputs ``room`` bytes of host memory hold beside the parked
    inputs and K/V, as the engine counts them (``engines.chunked.planned_kept_outputs``) —
    a count, so the simulation's chunk curve does not count again at each length. None
    where that count is no layer or every one (the plain and ``:keep_output`` candidates)
    or under sequence parallelism (ranks share the host; not planned yet). Other
    candidates come back as they are."""
    options = strategy.engine_options
    if strategy.engine != "fpdt" or options.keep_output != "fit":
        return "", strategy
    if strategy.sequence_parallel is not None:
        return None
    fitted = dataclasses.replace(options, host_memory=max(1, room)).settings()
    kept = planned_kept_outputs(config, seq_len, fitted, item, batch)
    if kept in (0, config.num_hidden_layers):
        return None
    return f":keep_output={kept}", Strategy(engine="fpdt", engine_options=dataclasses.replace(options, keep_output=kept),
                                             sequence_parallel=strategy.sequence_parallel, **strategy.techniques)


def parked_split(config, seq_len: int, strategy: Strategy, item: int, batch: int = 1) -> tuple[int, int]:
    """:func:`parked_bytes` as (on the device, in host memory): checkpointing's parked
    inputs (``offload_inputs``) fill its host budget and leave the rest on the device;
    FPDT's K/V go where ``offload`` puts them, its inputs and kept outputs where
    ``offload_inputs`` (by default ``offload``) does."""
    if strategy.engine == "fpdt":  # (which takes neither checkpointing nor Memo)
        settings = strategy.engine_options.settings()
        kv, inputs = _fpdt_parked(config, seq_len, strategy.engine_options, item, batch)
        return kv * (not settings.offload) + inputs * (not settings.offload_inputs), \
            kv * settings.offload + inputs * settings.offload_inputs
    parked = parked_bytes(config, seq_len, strategy, item, batch)
    checkpoint = strategy.techniques.get("checkpoint")
    if checkpoint is not None and checkpoint.offload_inputs and "memo" not in strategy.techniques:
        on_host = parked if checkpoint.host_memory is None else min(parked, checkpoint.host_memory)
        return parked - on_host, on_host
    offload = getattr(strategy.engine_options, "offload", False) or "memo" in strategy.techniques
    return (0, parked) if offload else (parked, 0)


def parked_bytes(config, seq_len: int, strategy: Strategy, item: int, batch: int = 1) -> int:
    """A lower bound of what a step parks at its fullest: under checkpointing and Memo
    every layer's input; under FPDT the layer inputs — or, with segments, the segment
    starts — and one layer's K/V (attention outputs with ``keep_output``); 0 otherwise.
    Where it is parked (device or host): :func:`parked_split`."""
    n, d = config.num_hidden_layers, config.hidden_size
    tokens = batch * seq_len
    if "checkpoint" in strategy.techniques or "memo" in strategy.techniques:
        return n * tokens * d * item  # every layer's input (Memo: in host memory, with more)
    if strategy.engine != "fpdt":
        return 0
    return sum(_fpdt_parked(config, seq_len, strategy.engine_options, item, batch))


def _fpdt_parked(config, seq_len: int, options, item: int, batch: int) -> tuple[int, int]:
    """FPDT's part of :func:`parked_bytes`: (K/V, layer inputs and kept attention outputs)."""
    n, d = config.num_hidden_layers, config.hidden_size
    tokens = batch * seq_len
    segment = getattr(options, "segment", 1)
    inputs = (n - 1 if segment <= 1 else -(-n // segment) - 1) * tokens * d * item
    kv = tokens * kv_bytes_per_token(config, item) * (1 if options.recompute_kv else n)
    kept = planned_kept_outputs(config, seq_len, options.settings(), item, batch) * kept_output_bytes(config, batch, seq_len, item)
    return kv, inputs + kept


def _margin(strategy: Strategy) -> float:
    options = strategy.engine_options
    if getattr(options, "offload", False) or getattr(options, "offload_inputs", False) or "memo" in strategy.techniques:
        return FRAGMENTATION["offload"]
    return FRAGMENTATION["chunked" if strategy.engine in ("fpdt", "seco", "spaco") else "whole"]


@dataclass
class PlanRow:
    name: str
    strategy: dict
    device_bytes: int | None  # simulated allocated peak, optimizer state included
    reserved_bytes: int | None  # with the fragmentation margin: what must fit the device
    host_bytes: int | None
    fits: bool
    binds: str | None  # what does not fit, and by how much
    step_seconds: float | None
    tokens_per_s: float | None
    mfu: float | None
    notes: dict = field(default_factory=dict)
    longest: int | None = None
    longest_binds: str | None = None
    optimizer_offload: bool = False  # AdamW's state and fp32 master weights in host memory
    simulated: bool = True  # False: judged by its lower bound, or skipped as slower than what fits

    @property
    def strategy_name(self) -> str:
        return self.name.split(" · ")[0]


@dataclass
class Plan:
    model: str
    seq_len: int
    device_memory: int
    host_memory: int
    optimizer: str
    dtype: str
    rows: list[PlanRow]
    gpus: int = 1
    lora_rank: int | None = None
    rates_name: str = "h100"

    @property
    def best(self) -> PlanRow | None:
        fitting = [r for r in self.rows if r.fits]
        return fitting[0] if fitting else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def verdict(self) -> str:
        best = self.best
        per = " per GPU" if self.gpus > 1 else ""
        if best is not None:
            return (f"fastest that fits: {best.name} — predicted {best.step_seconds:.3g} s per step on "
                    f"{self.gpus}× {self.rates_name} ({best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.0%}); device "
                    f"{format_bytes(best.reserved_bytes)} of {format_bytes(self.device_memory)}{per} with the fragmentation "
                    f"margin, host {format_bytes(best.host_bytes)} of {format_bytes(self.host_memory)}")
        simulated = [r for r in self.rows if r.reserved_bytes is not None]
        if not simulated:
            return f"nothing fits {self.seq_len:,} tokens: " + "; ".join(sorted({r.binds for r in self.rows if r.binds}))
        closest = min(simulated, key=lambda r: r.reserved_bytes)
        return f"nothing fits {self.seq_len:,} tokens: closest is {closest.name}, where {closest.binds}"

    def table(self) -> str:
        from .simulate import format_table

        head = ("strategy", "device (reserved)", "host", "fits", "step s", "tokens/s", "MFU")
        longest = any(r.longest for r in self.rows)
        rows = [head + (("longest context",) if longest else ())]
        for r in self.rows:
            fits = "yes" if r.fits else ("no" if r.binds else "–")
            row = (r.name, format_bytes(r.reserved_bytes) if r.reserved_bytes else "–",
                   format_bytes(r.host_bytes) if r.host_bytes is not None else "–", fits,
                   f"{r.step_seconds:.3g}" if r.step_seconds else "–", f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "–",
                   f"{r.mfu:.0%}" if r.mfu else "–")
            if longest:
                row += (f"{r.longest:,} ({r.longest_binds})" if r.longest else "–",)
            rows.append(row)
        what = f"LoRA rank {self.lora_rank}" if self.lora_rank else f"full fine-tuning, {self.optimizer}"
        title = (f"{self.model}: {self.seq_len:,} tokens, {self.dtype}, {what}; {self.gpus} GPU(s) of "
                 f"{format_bytes(self.device_memory)}, host {format_bytes(self.host_memory)}")
        limits = [f"  {r.name}: {r.binds}" for r in self.rows if r.binds]
        skipped = [r for r in self.rows if not r.simulated and not r.binds]
        lines = [title, format_table(rows), ""]
        if limits:
            lines += ["what does not fit:"] + limits + [""]
        if skipped:
            lines += [f"{len(skipped)} candidate(s) not simulated ({skipped[0].notes['skipped']}); "
                      "--exhaustive simulates them", ""]
        return "\n".join(lines + [
            self.verdict(), "memory simulated (device × the allocator's measured fragmentation margin); "
            f"step time from the time model at the {self.rates_name} rates (longtrain.plan.time_model)"])


def _state_bytes(config, optimizer: str, dtype: torch.dtype) -> tuple[int, int]:
    """(parameter count, bytes of the optimizer state on the device) of full fine-tuning."""
    from ..models.loading import build_from_config

    with torch.device("meta"):
        model = build_from_config(config, dtype)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    per = {"adamw": 2, "sgd": 1, "none": 0}[optimizer]
    return params, per * params * torch.tensor([], dtype=dtype).element_size()


_SIMULATIONS: dict[tuple, tuple[int, int, dict]] = {}  # simulate_step's results in this process
_CURVES: dict[tuple, object] = {}  # chunk_curve's results (a ChunkCurve or None) in this process


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
    from .simulate import chunk_curve

    key = _key(config, 0, strategy, dtype, batch, optimizer, lora_rank)
    if key not in _CURVES:
        _CURVES[key] = chunk_curve(config, strategy, batch_size=batch, optimizer=optimizer, dtype=dtype,
                                   lora_rank=lora_rank, iterations=_iterations(optimizer), progress=progress)
    return _CURVES[key]


def simulate_step(config, seq_len: int, strategy: Strategy, dtype: str, batch: int = 1, optimizer: str = "none",
                  lora_rank: int | None = None) -> tuple[int, int, dict]:
    """(device peak, host peak, notes) of one step at ``seq_len`` tokens; with
    ``optimizer="none"`` without optimizer state, with ``"adamw-offload"`` with its host
    state and streamed gradients. Cached in the process.

    Always the whole length: the simulator extends each phase's peak from a few layers and
    chunks itself (plan/simulate.py), so a step of an 8B model costs seconds to half a minute at
    any length; a chunked engine at a length of whole chunks reads its
    :func:`chunk_curve_of`, which shares those small simulations between lengths. (A line
    through the peaks at two and four FPDT chunks, used here before, underestimated long
    contexts: the peak moves from one phase to another as the length grows — Llama-3-8B,
    fpdt:chunk=8192:segment=6 with the gradients on the device, 32.14 / 32.40 / 35.88 /
    42.94 / 63.32 GiB at 16K / 32K / 128K / 256K / 512K tokens, 17 KB per token at first
    and 84 KB at the end.)"""
    key = _key(config, seq_len, strategy, dtype, batch, optimizer, lora_rank)
    if key not in _SIMULATIONS:
        _SIMULATIONS[key] = _simulate_step(config, seq_len, strategy, dtype, batch, optimizer, lora_rank)
    return _SIMULATIONS[key]


def _simulate_step(config, seq_len, strategy: Strategy, dtype, batch, optimizer, lora_rank) -> tuple[int, int, dict]:
    from .simulate import _chunk_axis, simulate

    axis = _chunk_axis(config, seq_len, strategy)
    if axis is not None and axis.offset == 0 and axis.target >= axis.first + 3:
        curve = chunk_curve_of(config, strategy, dtype, batch, optimizer, lora_rank)
        if curve is not None and axis.target >= curve.fewest:
            device, host = curve.peaks(axis.target)
            return device, host, curve.notes
    config = copy.deepcopy(config)
    report = simulate(config, seq_len, batch_size=batch, strategy=strategy, optimizer=optimizer, dtype=dtype,
                      iterations=_iterations(optimizer), lora_rank=lora_rank)
    return report.device_peak_bytes, report.peak.peak_host_bytes, dict(report.notes)


def _simulate_elsewhere(config_json: str, seq_len: int, strategy_json: str, dtype, batch, optimizer, lora_rank):
    """simulate_step in a worker process (plan's ``jobs``), and the chunk curves it made on
    the way: the parent caches them, so ``--longest`` searches them without simulating again."""
    from transformers import AutoConfig

    data = json.loads(config_json)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    before = set(_CURVES)
    result = _simulate_step(config, seq_len, Strategy.from_json(strategy_json), dtype, batch, optimizer, lora_rank)
    return result, {key: curve and curve.peaks_only() for key, curve in _CURVES.items() if key not in before}


@dataclass
class _Budget:
    """What a candidate must fit: the machine, and what stays resident whatever the strategy."""

    device_memory: int
    host_memory: int
    persistent: int  # device bytes allocated once (weights, and optimizer state when on the device)
    device_state: int  # optimizer state on the device (added to simulations without optimizer)
    host_state: int  # optimizer state, masters and gradient buffers in host memory
    optimizer: str  # what the simulation runs: "none" (state added) or "adamw-offload"


def budgets_for(config, *, device_memory: int, host_memory: int, optimizer: str, dtype: torch.dtype,
                lora_rank: int | None = None, gpus: int = 1, optimizer_offload: bool | None = None
                ) -> tuple[int, list[_Budget]]:
    """(parameter count, the places for the optimizer's state that the machine allows:
    the device, host memory, or both) — or a one-line error when the model states alone
    cannot fit."""
    item = torch.tensor([], dtype=dtype).element_size()
    params, state = _state_bytes(config, optimizer, dtype)
    if lora_rank:  # adapters are a fraction of a percent of the weights: their gradients and state are simulated
        state = 0
    # Under sequence parallelism FSDP2 shards parameters, gradients and optimizer state over the GPUs.
    weights = params * item // gpus
    state //= gpus
    budgets = []
    grads = 0 if lora_rank else weights
    if weights + grads + state <= device_memory and optimizer_offload is not True:
        # LoRA: the adapters' optimizer state is simulated with them (a fraction of a percent of the weights).
        budgets.append(_Budget(device_memory, host_memory, weights + state, state, 0, optimizer if lora_rank else "none"))
    if optimizer_offload is not False and optimizer == "adamw" and not lora_rank and gpus == 1 and weights <= device_memory:
        masters = params * 4  # fp32 masters, two fp32 moments, a gradient buffer in the parameters' dtype
        budgets.append(_Budget(device_memory, host_memory, weights, 0, 3 * masters + params * item, "adamw-offload"))
    if optimizer_offload and not any(b.optimizer == "adamw-offload" for b in budgets):
        raise LongtrainError("--optimizer-offload plans AdamW's state in host memory for full fine-tuning on one GPU; "
                             "it needs --optimizer adamw, no --lora and --gpus 1")
    if not budgets:
        raise LongtrainError(
            f"the model states alone (weights, gradients, {optimizer} state: {format_bytes(weights + grads + state)} per GPU) "
            f"exceed the device's {format_bytes(device_memory)} by {format_bytes(weights + grads + state - device_memory)}; "
            "no activation strategy helps — shard them over more GPUs (--gpus), train LoRA (--lora), or use a smaller optimizer"
        )
    return params, budgets


def plan(model, seq_len: int, *, device_memory: int, host_memory: int, optimizer: str = "adamw",
         dtype: str = "bfloat16", rates: MachineRates = H100, longest: bool = False, batch: int = 1,
         gpus: int = 1, lora_rank: int | None = None, exhaustive: bool = False,
         optimizer_offload: bool | None = None, rates_name: str = "h100", workers: int = 1,
         progress: Callable[[str], None] | None = None) -> Plan:
    """Rank the candidate strategies for ``model`` (preset, directory or config) at
    ``seq_len`` tokens on ``gpus`` devices of ``device_memory`` bytes each (sequence
    parallel over them when more than one) with ``host_memory`` bytes of host memory in
    all (module docstring). ``lora_rank``: train LoRA adapters of that rank instead of
    every weight. ``optimizer_offload``: AdamW's state only in host memory (True), only on
    the device (False), or both weighed (None). ``workers``: processes simulating
    candidates at once (the command line uses one per core, up to 4)."""
    from .longest import longest_context

    say = progress or (lambda _: None)
    if gpus < 1:
        raise LongtrainError(f"--gpus must be a positive count, got {gpus}")
    config = load_config(model)
    config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, 2 * seq_len)
    torch_dtype = parse_dtype(dtype)
    item = torch.tensor([], dtype=torch_dtype).element_size()
    params, budgets = budgets_for(config, device_memory=device_memory, host_memory=host_memory, optimizer=optimizer,
                                  dtype=torch_dtype, lora_rank=lora_rank, gpus=gpus, optimizer_offload=optimizer_offload)
    name = model if isinstance(model, str) else getattr(config, "name_or_path", "") or config.model_type
    result = Plan(name, seq_len, device_memory, host_memory, optimizer, str(torch_dtype).replace("torch.", ""), [],
                  gpus, lora_rank, rates_name)
    sp = {"degree": gpus} if gpus > 1 else None
    jobs = []
    usual = candidates(seq_len, host_memory, config.num_hidden_layers)
    # FPDT with more than 32 chunks costs host time per chunk: tried only when nothing with
    # fewer fits (after every usual candidate), since smaller chunks reach longer contexts.
    every = candidates(seq_len, host_memory, config.num_hidden_layers, every_chunk=True)
    fallback = {label for label, strategy in every.items()
                if label not in usual and strategy.engine_options.chunk < seq_len}
    many = set()  # the candidates' names with over 32 chunks
    for label, strategy in {**usual, **{label: every[label] for label in fallback}}.items():
        if sp is not None:
            if "memo" in strategy.techniques:  # Memo does not run under sequence parallelism yet
                continue
            strategy = _rebuilt(strategy, sequence_parallel=sp)
            label += f"+sp{gpus}"
        for budget in budgets:
            offloaded = budget.optimizer == "adamw-offload"
            if offloaded:
                strategy = host_budgets_beside_optimizer(strategy, host_memory - budget.host_state)
            fitted = outputs_kept_within(config, seq_len, strategy, item, batch, host_memory - budget.host_state)
            if fitted is None:
                continue
            fitted_label, fitted_strategy = fitted
            # A candidate that cannot fit by what it parks is not timed (at lengths far beyond
            # any that fits, the time model's per-chunk schedule alone would take minutes).
            seconds = float("inf") if _bound(config, seq_len, fitted_strategy, budget, item, batch, gpus) else \
                step_time(config, seq_len, fitted_strategy, rates, batch=batch, optimizer_offload=offloaded,
                          trainable=params).seconds
            name = label.replace(":keep_output=fit", fitted_label) + (" · optimizer in host memory" if offloaded else "")
            if label in fallback:
                many.add(name)
            jobs.append((seconds, name, fitted_strategy, budget))
    jobs.sort(key=lambda job: (job[1] in many, job[0]))
    bounds = [_bound(config, seq_len, strategy, budget, item, batch, gpus) for _, _, strategy, budget in jobs]
    if jobs and all(bound is not None for bound in bounds):
        raise LongtrainError(_beyond_reach(config, seq_len, jobs, bounds, item, batch, gpus, device_memory, host_memory))
    to_simulate = [i for i, bound in enumerate(bounds) if bound is None]
    winner = None
    with _Simulations(workers) as simulations:
        for i, (_, label, strategy, budget) in enumerate(jobs):
            offloaded = budget.optimizer == "adamw-offload"
            args = (config, seq_len, strategy, dtype, batch, budget.optimizer, lora_rank)
            if bounds[i] is not None:
                row = PlanRow(label, strategy.to_dict(), None, None, None, False, bounds[i], None, None, None,
                              optimizer_offload=offloaded, simulated=False)
            elif winner is not None and not exhaustive and not simulations.started(args):
                row = PlanRow(label, strategy.to_dict(), None, None, None, False, None, None, None, None,
                              notes={"skipped": f"over 32 chunks, and {winner} fits" if label in many
                                     else f"predicted slower than {winner}, which fits"},
                              optimizer_offload=offloaded, simulated=False)
            else:
                # The next candidates start in the other workers while this one is simulated —
                # until one fits: then only those already started are waited for.
                ahead = to_simulate[to_simulate.index(i):][:workers] if winner is None or exhaustive else []
                for j in ahead:
                    _, other, other_strategy, other_budget = jobs[j]
                    if simulations.start((config, seq_len, other_strategy, dtype, batch, other_budget.optimizer,
                                          lora_rank)):
                        say(f"simulating {other} at {seq_len:,} tokens")
                row = _evaluate(label, strategy, config, seq_len, budget, rates, batch, params,
                                lambda: simulations.result(args))
                if longest and row.device_bytes is not None:
                    row.longest, row.longest_binds = longest_context(config, strategy, budget, dtype, batch=batch,
                                                                     lora_rank=lora_rank, start=seq_len, label=label,
                                                                     progress=say)
                if row.fits and winner is None:
                    winner = label
            result.rows.append(row)
            if row.fits and "checkpoint" in strategy.techniques and not longest:
                whole = _with_whole_layers(row, strategy, config, seq_len, budget, rates, batch, params, say,
                                           lambda candidate: simulate_step(config, seq_len, candidate, dtype, batch,
                                                                           budget.optimizer, lora_rank))
                if whole is not None:
                    result.rows.append(whole)
    result.rows.sort(key=lambda r: (not r.fits, not r.simulated,
                                    r.step_seconds if r.fits else (r.reserved_bytes or float("inf"))))
    return result


class _Simulations:
    """The planned candidates' simulations (:func:`simulate_step`), in ``workers`` processes
    when more than one: an 8B candidate takes up to half a minute of one core, so a plan on two cores
    answers in about half the time. Results are cached in this process as simulate_step's."""

    def __init__(self, workers: int):
        self.workers = workers
        self.futures: dict[tuple, object] = {}
        self.executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)

    def started(self, args) -> bool:
        return _key(*args) in self.futures or _key(*args) in _SIMULATIONS

    def start(self, args) -> bool:
        """Start simulating ``args`` (simulate_step's) in a worker; False if started or known already."""
        if self.started(args):
            return False
        if self.workers > 1:
            if self.executor is None:
                import concurrent.futures
                import multiprocessing

                # spawn: a fresh interpreter, not a fork of one that may hold threads.
                self.executor = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"))
            config, seq_len, strategy, *rest = args
            config_json = json.dumps(config.to_dict(), default=str)
            self.futures[_key(*args)] = self.executor.submit(_simulate_elsewhere, config_json, seq_len,
                                                             strategy.to_json(), *rest)
        return True

    def result(self, args) -> tuple[int, int, dict]:
        key = _key(*args)
        future = self.futures.pop(key, None)
        if future is not None and key not in _SIMULATIONS:
            _SIMULATIONS[key], curves = future.result()
            for curve_key, curve in curves.items():
                _CURVES.setdefault(curve_key, curve)
        return simulate_step(*args)


def _with_whole_layers(row: PlanRow, strategy: Strategy, config, seq_len, budget: _Budget, rates, batch, params,
                       say, simulated) -> PlanRow | None:
    """``row``'s checkpointing with as many top layers left whole (``except_last``: nothing
    recomputed there) as fit in :data:`WHOLE_LAYERS_FILL` of the device, or None if not one does.

    A search over the count, six simulations at most: n/4 and n/2, then the count where the
    line through the simulated reserved peaks nearest the fill (one on each side of it, or
    the two highest below it) reaches it, kept between the largest count known to fit and
    the smallest known not to. The first few whole layers may cost nothing (the peak can sit
    in the loss head): while the peaks are flat and none is over the fill, every layer is
    tried. A simulation that is refused counts as not fitting; the largest count that fits is
    kept."""
    n = config.num_hidden_layers
    target = int(WHOLE_LAYERS_FILL * budget.device_memory)
    if n < 4 or (row.reserved_bytes or target) >= target:  # below 4 layers: not worth its simulations
        return None
    tried: dict[int, PlanRow] = {}

    def evaluate(count: int) -> None:
        checkpoint = dataclasses.replace(strategy.techniques["checkpoint"], except_last=count)
        label = row.name.replace("checkpoint", f"checkpoint:except_last={count}", 1)
        say(f"simulating {label} at {seq_len:,} tokens")
        candidate = _rebuilt(strategy, checkpoint=checkpoint)
        tried[count] = _evaluate(label, candidate, config, seq_len, budget, rates, batch, params,
                                 lambda: simulated(candidate))

    def fits(count: int) -> bool:
        found = tried[count]
        return found.fits and found.reserved_bytes is not None and found.reserved_bytes <= target

    evaluate(n // 4)
    evaluate(n // 2)
    for _ in range(4):
        good = max((c for c in tried if fits(c)), default=0)
        bad = min((c for c in tried if not fits(c)), default=n + 1)
        if bad - good <= 1:
            break
        peak = {c: r.reserved_bytes for c, r in sorted(tried.items()) if r.reserved_bytes is not None}
        below = [c for c in peak if peak[c] <= target]
        above = [c for c in peak if peak[c] > target]
        a, b = (below[-1], above[0]) if below and above else (below[-2:] if len(below) >= 2 else (None, None))
        if a is not None and peak[b] != peak[a]:
            guess = a + int((target - peak[a]) * (b - a) // (peak[b] - peak[a]))
        elif not above:
            guess = bad - 1  # flat so far, nothing over the fill: try every layer
        else:
            guess = (good + bad) // 2
        evaluate(min(max(guess, good + 1), bad - 1))
    good = max((c for c in tried if fits(c)), default=0)
    return tried[good] if good else None


def _rebuilt(strategy: Strategy, sequence_parallel=None, **techniques) -> Strategy:
    """``strategy`` with a sequence-parallel degree and/or techniques replaced."""
    return Strategy(engine=strategy.engine, engine_options=strategy.engine_options,
                    sequence_parallel=sequence_parallel or strategy.sequence_parallel,
                    **{**strategy.techniques, **techniques})


def least_bytes(config, seq_len: int, strategy: Strategy, item: int, batch: int = 1, gpus: int = 1) -> tuple[int, int]:
    """(device, host) bytes one rank of a step of ``strategy`` holds at its fullest beside the
    model states, whatever the simulation finds: the token ids (int64, on the device) and what
    it parks (:func:`parked_split`), a share of ``gpus`` under sequence parallelism. Counted
    from the config, so any length is answered at once."""
    on_device, on_host = parked_split(config, seq_len, strategy, item, batch)
    return (8 * batch * seq_len + on_device) // gpus, on_host // gpus


def longest_where(fits: Callable[[int], bool], below: int) -> int:
    """The longest length under ``below`` where ``fits`` (true up to some length, false
    beyond) holds, by bisection; 0 where it holds at none."""
    if not fits(2):
        return 0
    low, high = 2, below
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _bound(config, seq_len, strategy, budget: _Budget, item, batch, gpus) -> str | None:
    """Why ``strategy`` cannot fit whatever the simulation says (the token ids and its parked
    bytes alone, :func:`least_bytes`), or None."""
    on_device, on_host = least_bytes(config, seq_len, strategy, item, batch, gpus)
    device = budget.persistent + on_device
    host = budget.host_state + on_host
    if device > budget.device_memory:
        return f"device memory: at least {format_bytes(device)} (what it parks; not simulated)"
    if host > budget.host_memory:
        return f"host memory: at least {format_bytes(host)} (what it parks; not simulated)"
    return None


def _beyond_reach(config, seq_len, jobs, bounds, item, batch, gpus, device_memory, host_memory) -> str:
    """The one line refusing a length at which no candidate can fit by its bound
    (:func:`_bound`), naming the longest length at which one could."""
    reach = [longest_where(lambda tokens: _bound(config, tokens, strategy, budget, item, batch, gpus) is None, seq_len)
             for _, _, strategy, budget in jobs]
    best = max(range(len(jobs)), key=lambda i: reach[i])
    machine = f"{gpus} × {format_bytes(device_memory)}" if gpus > 1 else format_bytes(device_memory)
    longest = (f"the longest any could fit is {reach[best]:,} tokens ({jobs[best][1]})" if reach[best]
               else "no length fits beside the model states")
    return (f"no strategy weighed fits {seq_len:,} tokens on {machine} of device and {format_bytes(host_memory)} of host "
            f"memory: the token ids and what each candidate parks alone exceed it ({jobs[best][1]}: "
            f"{bounds[best].replace(' (what it parks; not simulated)', '')}); {longest} — counted, not simulated")


def _reserved(strategy: Strategy, budget: _Budget, device: int) -> int:
    """What must fit the device: the simulated peak (``device``, without on-device
    optimizer state) with that state, and what a step allocates and frees times the
    allocator's fragmentation margin."""
    return int(budget.persistent + _margin(strategy) * (device + budget.device_state - budget.persistent))


def _evaluate(label, strategy, config, seq_len, budget: _Budget, rates, batch, params, simulated) -> PlanRow:
    """The plan's row of one candidate; ``simulated()`` gives its simulate_step figures."""
    offloaded = budget.optimizer == "adamw-offload"
    try:
        device, host, notes = simulated()
    except LongtrainError as exc:  # e.g. memo: the inputs and attention outputs alone exceed the host budget
        return PlanRow(label, strategy.to_dict(), None, None, None, False, str(exc), None, None, None,
                       optimizer_offload=offloaded)
    reserved = _reserved(strategy, budget, device)
    device += budget.device_state
    binds = []
    if reserved > budget.device_memory:
        binds.append(f"device memory: needs {format_bytes(reserved)}, {format_bytes(reserved - budget.device_memory)} over")
    if host > budget.host_memory:
        binds.append(f"host memory: needs {format_bytes(host)}, {format_bytes(host - budget.host_memory)} over")
    predicted = step_time(config, seq_len, strategy, rates, notes=notes, batch=batch, optimizer_offload=offloaded,
                          trainable=params)
    return PlanRow(label, strategy.to_dict(), device, reserved, host, not binds, "; ".join(binds) or None,
                   predicted.seconds, batch * seq_len / predicted.seconds, predicted.mfu(rates.peak), notes,
                   optimizer_offload=offloaded)
