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
itself from its fit simulations, seconds to half a minute per 8B candidate); simulations
are cached in the process. A fitting checkpointed row's search for top layers left whole
runs in a worker of its own, beside the others. Each row names its strategy as
``--strategy`` reads it and AdamW's place apart (:meth:`PlanRow.flags`; :meth:`Plan.command`
the whole ``longtrain train`` line). ``longest=True`` adds, per simulated strategy, the
longest context it reaches (a search: :mod:`longtrain.plan.longest`).
"""

from __future__ import annotations

import json
from typing import Callable

import torch

from .. import registry
from ..errors import LongtrainError
from ..memory.units import format_bytes
from ..models.adapters import adapter_class, describe_model
from ..models.loading import load_config, parse_dtype
from ..strategy import Strategy
from .bounds import (FRAGMENTATION, Budget, _beyond_reach, _bound, budgets_for, least_bytes, longest_where,
                     parked_bytes, parked_split, reserved_bytes)
from .candidates import (CHUNKS, _leaves_layers_whole, _rebuilt, candidates, host_budgets_beside_optimizer,
                         outputs_kept_within)
from .longest import longest_context
from .report import Plan, PlanRow
from .steps import _Simulations, chunk_curve_of, config_from_json, simulate_step
from .time_model import H100, MachineRates, step_time

# plan() and its row, and what the planner is made of, re-exported from their modules.
__all__ = [
    "CHUNKS",
    "FRAGMENTATION",
    "Budget",
    "Plan",
    "PlanRow",
    "WHOLE_LAYERS_FILL",
    "budgets_for",
    "candidates",
    "chunk_curve_of",
    "host_budgets_beside_optimizer",
    "least_bytes",
    "longest_where",
    "most_whole_layers",
    "outputs_kept_within",
    "parked_bytes",
    "parked_split",
    "plan",
    "reserved_bytes",
    "simulate_step",
]


# Layers left whole fill the device up to this share of it: they buy speed, not length,
# and the few GiB left absorb what the margin misses (a run that dies costs more).
WHOLE_LAYERS_FILL = 0.95


def plan(model, seq_len: int, *, device_memory: int, host_memory: int, optimizer: str = "adamw",
         dtype: str = "bfloat16", rates: MachineRates = H100, longest: bool = False, batch: int = 1,
         gpus: int = 1, lora_rank: int | None = None, exhaustive: bool = False,
         optimizer_offload: bool | None = None, rates_name: str = "h100", workers: int = 1,
         progress: Callable[[str], None] | None = None, engine: str | None = None) -> Plan:
    """Rank the candidate strategies for ``model`` (preset, directory or config) at
    ``seq_len`` tokens on ``gpus`` devices of ``device_memory`` bytes each (sequence
    parallel over them when more than one) with ``host_memory`` bytes of host memory in
    all (module docstring). ``lora_rank``: train LoRA adapters of that rank instead of
    every weight. ``optimizer_offload``: AdamW's state only in host memory (True), only on
    the device (False), or both weighed (None). ``workers``: processes simulating
    candidates at once (the command line uses one per core, up to 4). ``engine``: weigh only that
    engine's variants."""
    say = progress or (lambda _: None)
    if gpus < 1:
        raise LongtrainError(f"--gpus must be a positive count, got {gpus}")
    config = load_config(model)
    adapter_class(config.model_type).allow_positions(config, 2 * seq_len)
    torch_dtype = parse_dtype(dtype)
    item = torch.tensor([], dtype=torch_dtype).element_size()
    params, budgets = budgets_for(config, device_memory=device_memory, host_memory=host_memory, optimizer=optimizer,
                                  dtype=torch_dtype, lora_rank=lora_rank, gpus=gpus, optimizer_offload=optimizer_offload)
    name = model if isinstance(model, str) else getattr(config, "name_or_path", "") or config.model_type
    result = Plan(model=name, seq_len=seq_len, device_memory=device_memory, host_memory=host_memory, optimizer=optimizer,
                  dtype=str(torch_dtype).replace("torch.", ""), rows=[], gpus=gpus, lora_rank=lora_rank,
                  rates_name=rates_name, untimed=adapter_class(config.model_type).untimed_work, batch=batch)
    sp = {"degree": gpus} if gpus > 1 else None
    jobs = []
    kind = adapter_class(config.model_type)
    if gpus > 1 and not kind.has_attention:
        raise LongtrainError(f"--gpus {gpus} splits the sequence over attention heads (Ulysses), and {config.model_type} "
                             "has no attention; plan one GPU, or split its layers over GPUs with the adjoint engine "
                             f"(torchrun; `longtrain simulate --engine adjoint --layer-groups {gpus}` says what each GPU needs)")
    usual = candidates(seq_len, host_memory, describe_model(config).layers, adapter=kind)
    # FPDT with more than 32 chunks costs host time per chunk: tried only when nothing with
    # fewer fits (after every usual candidate), since smaller chunks reach longer contexts.
    every = candidates(seq_len, host_memory, describe_model(config).layers, every_chunk=True, adapter=kind)
    if engine is not None:
        registry.engine(engine)  # an unknown name is refused in one line
        serving = sorted({s.engine for s in every.values()})
        if engine not in serving:
            raise LongtrainError(f"--engine {engine} does not train {config.model_type} models; engines a plan weighs "
                                 f"for them: {', '.join(serving)}")
        usual, every = ({label: s for label, s in found.items() if s.engine == engine} for found in (usual, every))
    # In the candidates' order (a set's would change with the process's string hashing, and so
    # the order of the rows they tie in).
    fallback = [label for label, strategy in every.items()
                if label not in usual and strategy.engine_options.chunk < seq_len]
    jobs_beyond = []  # candidates with over 32 chunks: after the others
    for label, strategy in {**usual, **{label: every[label] for label in fallback}}.items():
        beyond = label in fallback
        if sp is not None:
            if not all(registry.technique(name).sequence_parallel for name in strategy.techniques):
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
            (part, fitted_part), fitted_strategy = fitted
            # A candidate that cannot fit by what it parks is not timed (at lengths far beyond
            # any that fits, the time model's per-chunk schedule alone would take minutes).
            seconds = float("inf") if _bound(config, seq_len, fitted_strategy, budget, item, batch, gpus) else \
                step_time(config, seq_len, fitted_strategy, rates, batch=batch, optimizer_offload=offloaded,
                          trainable=params).seconds
            name = label.replace(part, fitted_part) if part else label
            (jobs_beyond if beyond else jobs).append((seconds, name, fitted_strategy, budget))
    jobs = sorted(jobs, key=lambda job: job[0]) + sorted(jobs_beyond, key=lambda job: job[0])
    many = set(range(len(jobs) - len(jobs_beyond), len(jobs)))  # their indices
    bounds = [_bound(config, seq_len, strategy, budget, item, batch, gpus) for _, _, strategy, budget in jobs]
    if jobs and all(bound is not None for bound in bounds):
        shown = [(seconds, _shown(name, budget), strategy, budget) for seconds, name, strategy, budget in jobs]
        raise LongtrainError(_beyond_reach(config, seq_len, shown, bounds, item, batch, gpus, device_memory, host_memory))
    to_simulate = [i for i, bound in enumerate(bounds) if bound is None]
    winner = None
    searches = []  # (where its row goes, what gives the row with top layers left whole, or None)
    with _Simulations(workers) as simulations:
        for i, (_, label, strategy, budget) in enumerate(jobs):
            offloaded = budget.optimizer == "adamw-offload"
            args = (config, seq_len, strategy, dtype, batch, budget.optimizer, lora_rank)
            if bounds[i] is not None:
                row = PlanRow(name=label, strategy=strategy.to_dict(), binds=bounds[i], optimizer_offload=offloaded,
                              simulated=False)
            elif winner is not None and not exhaustive:  # started ahead or not: the answer must not depend on --jobs
                row = PlanRow(name=label, strategy=strategy.to_dict(),
                              notes={"skipped": f"over 32 chunks, and {winner} fits" if i in many
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
                        say(f"simulating {_shown(other, other_budget)} at {seq_len:,} tokens")
                row = _evaluate(label, strategy, config, seq_len, budget, rates, batch, params,
                                lambda: simulations.result(args))
                if longest and row.device_bytes is not None:
                    row.longest, row.longest_binds = longest_context(config, strategy, budget, dtype, batch=batch,
                                                                     lora_rank=lora_rank, start=seq_len, label=label,
                                                                     progress=say)
                if row.fits and winner is None:
                    winner = row.label
            result.rows.append(row)
            if row.fits and _leaves_layers_whole(strategy) and not longest:
                # A sequential search of its own: in a worker, beside the other fitting rows' searches.
                if workers > 1:
                    say(f"searching how many top layers {_shown(label, budget)} leaves whole at {seq_len:,} tokens")
                    searches.append((len(result.rows), simulations.call(
                        _whole_layers_elsewhere, row, strategy.to_json(), json.dumps(config.to_dict(), default=str),
                        seq_len, budget, rates, batch, params, dtype, lora_rank).result))
                else:
                    whole = most_whole_layers(row, strategy, config, seq_len, budget, rates, batch, params, say,
                                              lambda candidate: simulate_step(config, seq_len, candidate, dtype, batch,
                                                                              budget.optimizer, lora_rank))
                    searches.append((len(result.rows), lambda whole=whole: whole))
        for where, search in reversed(searches):
            whole = search()
            if whole is not None:
                result.rows.insert(where, whole)
    result.rows.sort(key=lambda r: (not r.fits, not r.simulated,
                                    r.step_seconds if r.fits else (r.reserved_bytes or float("inf"))))
    return result


def _whole_layers_elsewhere(row: PlanRow, strategy_json: str, config_json: str, seq_len: int, budget: Budget, rates,
                            batch: int, params: int, dtype: str, lora_rank) -> PlanRow | None:
    """:func:`most_whole_layers` of a fitting row, as a worker process runs it (the config
    and strategy as JSON)."""
    config, strategy = config_from_json(config_json), Strategy.from_json(strategy_json)
    return most_whole_layers(row, strategy, config, seq_len, budget, rates, batch, params, lambda _: None,
                             lambda candidate: simulate_step(config, seq_len, candidate, dtype, batch, budget.optimizer,
                                                             lora_rank))


def most_whole_layers(row: PlanRow, strategy: Strategy, config, seq_len, budget: Budget, rates, batch, params,
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
    n = describe_model(config).layers
    target = int(WHOLE_LAYERS_FILL * budget.device_memory)
    if n < 4 or (row.reserved_bytes or target) >= target:  # below 4 layers: not worth its simulations
        return None
    tried: dict[int, PlanRow] = {}

    name = _leaves_layers_whole(strategy)

    def evaluate(count: int) -> None:
        options, item = registry.technique(name).costs.with_whole_layers(name, strategy.techniques[name], count)
        label = row.name.replace(name, item, 1)
        say(f"simulating {_shown(label, budget)} at {seq_len:,} tokens")
        candidate = _rebuilt(strategy, **{name: options})
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


def _shown(label: str, budget: Budget) -> str:
    """A candidate as progress lines name it: its --strategy value, with --optimizer-offload
    where AdamW's state lives in host memory."""
    return label + (" --optimizer-offload" if budget.optimizer == "adamw-offload" else "")


def _evaluate(label, strategy, config, seq_len, budget: Budget, rates, batch, params, simulated) -> PlanRow:
    """The plan's row of one candidate; ``simulated()`` gives its simulate_step figures."""
    offloaded = budget.optimizer == "adamw-offload"
    try:
        device, host, notes = simulated()
    except LongtrainError as exc:  # e.g. memo: the inputs and attention outputs alone exceed the host budget
        return PlanRow(name=label, strategy=strategy.to_dict(), binds=str(exc), optimizer_offload=offloaded)
    reserved = reserved_bytes(strategy, budget, device)
    device += budget.device_state
    binds = []
    if reserved > budget.device_memory:
        binds.append(f"device memory: needs {format_bytes(reserved)}, {format_bytes(reserved - budget.device_memory)} over")
    if host > budget.host_memory:
        binds.append(f"host memory: needs {format_bytes(host)}, {format_bytes(host - budget.host_memory)} over")
    predicted = step_time(config, seq_len, strategy, rates, notes=notes, batch=batch, optimizer_offload=offloaded,
                          trainable=params)
    return PlanRow(name=label, strategy=strategy.to_dict(), device_bytes=device, reserved_bytes=reserved, host_bytes=host,
                   fits=not binds, binds="; ".join(binds) or None, step_seconds=predicted.seconds,
                   tokens_per_s=batch * seq_len / predicted.seconds, mfu=predicted.mfu(rates.peak), notes=notes,
                   optimizer_offload=offloaded)
