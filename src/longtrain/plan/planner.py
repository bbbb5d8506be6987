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
itself from its fit simulations, 1–15 s of one core per 8B candidate); simulations
are cached in the process. A fitting checkpointed row's search for top layers left whole
runs in a worker of its own, beside the others. Each row names its strategy as
``--strategy`` reads it — computed from the strategy's fields (:attr:`Strategy.label`), also
for the rows derived from a candidate — and AdamW's place apart (:meth:`PlanRow.flags`;
:meth:`Plan.command` the whole ``longtrain train`` line). ``longest=True`` adds, per
simulated strategy, the longest context it reaches (a search: :mod:`longtrain.plan.longest`).

What is asked is a :class:`~longtrain.plan.request.PlanRequest`; :func:`plan` is made of
one step each: the machine's budgets (:func:`_setting`), the candidates (:func:`_candidates`),
each placed, bounded and timed (:func:`_jobs`, :func:`_placed`), simulated in order with the
whole-layer rows (:class:`_InOrder`), and ranked (:func:`_rank`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from .. import registry
from ..errors import LongtrainError
from ..memory.units import format_bytes
from ..models.adapters import adapter_class, describe_model
from ..models.loading import load_config, parse_dtype
from ..strategy import Strategy
from .bounds import (
    FRAGMENTATION,
    Budget,
    _beyond_reach,
    _bound,
    budget_under,
    budgets_for,
    least_bytes,
    longest_where,
    parked_bytes,
    parked_split,
    reserved_bytes,
)
from .candidates import (
    CHUNKS,
    _leaves_layers_whole,
    _rebuilt,
    added_techniques,
    candidates,
    host_budgets_beside_optimizer,
    outputs_kept_within,
)
from .fake_model import with_4bit_base
from .longest import longest_context
from .report import Plan, PlanRow
from .request import PlanRequest
from .steps import _Simulations, chunk_curve_of, config_from_json, simulate_step
from .time_model import H100, MachineRates, step_time

# plan() and its request and row, and what the planner is made of, re-exported from their modules.
__all__ = [
    "CHUNKS",
    "FRAGMENTATION",
    "H100",
    "Budget",
    "MachineRates",
    "Plan",
    "PlanRequest",
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

NOT_SIMULATED = "(what it parks; not simulated)"  # after a row's bound: what refused it


def plan(request: PlanRequest, *, workers: int = 1, progress: Callable[[str], None] | None = None) -> Plan:
    """Rank the candidate strategies for what ``request`` asks (:class:`PlanRequest`: the
    model at ``seq_len`` tokens on ``gpus`` devices of ``device_memory`` bytes each —
    sequence parallel over them when more than one — with ``host_memory`` bytes of host
    memory in all; module docstring). How it is computed never changes the answer:
    ``workers`` processes simulate candidates at once (the command line uses one per
    core, up to 4), and ``progress`` is told each simulation as it starts."""
    if not isinstance(request, PlanRequest):
        raise LongtrainError(f"plan() takes a PlanRequest (longtrain.plan.request), got {type(request).__name__}: "
                             "plan(PlanRequest(model, seq_len, device_memory=..., host_memory=...))")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise LongtrainError(f"workers (--jobs) must be a positive count, got {workers!r}")
    setting = _setting(request)
    with _Simulations(workers) as simulations:  # the workers start while the candidates are weighed
        jobs = _jobs(setting)
        if jobs and all(job.bound is not None for job in jobs):
            raise LongtrainError(_beyond_reach(setting.config, request.seq_len,
                                               [(job.shown, job.strategy, job.budget) for job in jobs],
                                               [job.bound for job in jobs], setting.item, request.batch, request.degree,
                                               request.device_memory, request.host_memory))
        result = _empty_plan(setting)
        result.rows = _InOrder(setting, jobs, simulations, workers, progress or (lambda _: None)).rows()
    result.rows.sort(key=_rank)
    return result


@dataclass
class _Setting:
    """What each step of a plan reads: the request, and what follows from it once."""

    request: PlanRequest
    config: object  # the model's config, its positions allowed to twice the length
    kind: type  # the model's adapter class
    item: int  # bytes per element of the dtype
    params: int  # parameters trained (the time model's optimizer step)
    budgets: list[Budget]  # one per place of the optimizer's state

    def simulation(self, strategy: Strategy, budget: Budget) -> tuple:
        """simulate_step's arguments for ``strategy`` within ``budget``."""
        r = self.request
        return (self.config, r.seq_len, strategy, r.dtype, r.batch, budget.optimizer, r.lora_rank)


def _setting(request: PlanRequest) -> _Setting:
    """The model's config and the places for the optimizer's state; what no strategy can
    help (the model states alone, sequence parallelism without attention) refused at once."""
    config = load_config(request.model)
    if request.four_bit:
        with_4bit_base(config)
    kind = adapter_class(config.model_type)
    kind.allow_positions(config, 2 * request.seq_len)
    dtype = parse_dtype(request.dtype)
    params, budgets = budgets_for(config, device_memory=request.device_memory, host_memory=request.host_memory,
                                  optimizer=request.optimizer, dtype=dtype, lora_rank=request.lora_rank,
                                  gpus=request.gpus, optimizer_offload=request.optimizer_offload)
    if request.degree > 1 and not kind.has_attention:
        raise LongtrainError(f"--gpus {request.gpus} splits the sequence over attention heads (Ulysses), and "
                             f"{config.model_type} has no attention; plan one GPU, or split its layers over GPUs with "
                             f"the adjoint engine (torchrun; `longtrain simulate --engine adjoint --layer-groups "
                             f"{request.gpus}` says what each GPU needs)")
    return _Setting(request, config, kind, dtype.itemsize, params, budgets)


def _empty_plan(setting: _Setting) -> Plan:
    """The plan's heading: what was asked, before any row."""
    r = setting.request
    name = r.model if isinstance(r.model, str) else getattr(setting.config, "name_or_path", "") or setting.config.model_type
    return Plan(model=name, seq_len=r.seq_len, device_memory=r.device_memory, host_memory=r.host_memory,
                optimizer=r.optimizer, dtype=str(parse_dtype(r.dtype)).removeprefix("torch."), rows=[], gpus=r.gpus, sp=r.sp,
                lora_rank=r.lora_rank, rates_name=r.rates_label, untimed=setting.kind.untimed_work, batch=r.batch,
                four_bit=bool(setting.kind.base_bits(setting.config)))


@dataclass
class _Job:
    """One candidate with the optimizer's state in one place, as the plan weighs it."""

    strategy: Strategy  # sequence parallel, host budgets and kept outputs fitted to the machine
    budget: Budget
    bound: str | None  # why it cannot fit by what it parks alone (not simulated), or None
    seconds: float  # predicted step time; infinite where its bound refuses it (not timed)
    beyond: bool  # over 32 chunks: weighed after every usual candidate

    @property
    def name(self) -> str:
        return self.strategy.label

    @property
    def offloaded(self) -> bool:
        return self.budget.optimizer == "adamw-offload"

    @property
    def shown(self) -> str:
        return _shown(self.name, self.budget)


def _candidates(setting: _Setting) -> list[tuple[Strategy, bool]]:
    """(candidate, whether it has over 32 chunks), in the candidates' order: those with
    over 32 chunks — which cost host time per chunk — last, since smaller chunks reach longer
    contexts (a set's order would change with the process's string hashing, and so the
    order of the rows they tie in)."""
    r = setting.request
    layers = describe_model(setting.config).layers
    added = added_techniques(setting.config, r.device_memory, setting.item, frozen=bool(r.lora_rank) and not r.four_bit)
    usual = candidates(r.seq_len, r.host_memory, layers, adapter=setting.kind, added=added, carried=r.carried)
    every = candidates(r.seq_len, r.host_memory, layers, every_chunk=True, adapter=setting.kind, added=added,
                       carried=r.carried)
    for name in r.carried:
        if not any(name in strategy.techniques for strategy in every.values()):
            raise LongtrainError(f"--with {name}: no candidate weighed for {setting.config.model_type} models takes it "
                                 f"(their engines, their techniques or the model's family refuse it); leave it out")
    if r.engine is not None:
        serving = sorted({strategy.engine for strategy in every.values()})
        if r.engine not in serving:
            raise LongtrainError(f"--engine {r.engine}: a plan weighs no {r.engine} candidate for "
                                 f"{setting.config.model_type} models; engines it weighs for them: {', '.join(serving)}")
        usual, every = ({label: s for label, s in found.items() if s.engine == r.engine} for found in (usual, every))
    fallback = [label for label, strategy in every.items()
                if label not in usual and registry.engine(strategy.engine).costs.chunk(strategy.engine_options) < r.seq_len]
    if r.engine is not None and not usual and not fallback:
        raise LongtrainError(f"--engine {r.engine}: none of its candidates runs {r.seq_len:,} tokens in more than one "
                             f"chunk; train --engine {r.engine} with a smaller chunk, or plan without --engine")
    return [(strategy, False) for strategy in usual.values()] + [(every[label], True) for label in fallback]


def _jobs(setting: _Setting) -> list[_Job]:
    """Every candidate at every place of the optimizer's state, bounded and timed: fastest
    predicted first, those with over 32 chunks after all the others."""
    jobs = [job for strategy, beyond in _candidates(setting) for job in _placed(setting, strategy, beyond)]
    return (sorted((job for job in jobs if not job.beyond), key=lambda job: job.seconds)
            + sorted((job for job in jobs if job.beyond), key=lambda job: job.seconds))


def _placed(setting: _Setting, strategy: Strategy, beyond: bool) -> list[_Job]:
    """``strategy`` over the plan's GPUs at each place of the optimizer's state: its host
    budgets beside that state, its kept outputs within the host's room, its bound, and its
    predicted time where the bound does not refuse it already (at lengths far beyond any
    that fits, the time model's per-chunk schedule alone would take minutes)."""
    r = setting.request
    if r.gpus > 1:
        if not all(registry.technique(name).sequence_parallel for name in strategy.techniques):
            return []
        groups = {} if r.degree == r.gpus else {"processes": r.gpus}  # data-parallel groups of r.degree
        strategy = _rebuilt(strategy, sequence_parallel={"degree": r.degree, **groups})
    jobs = []
    for budget in setting.budgets:
        budget = budget_under(strategy, budget, setting.config, setting.item)  # weights a technique streams from the host
        offloaded = budget.optimizer == "adamw-offload"
        room = r.host_memory - budget.host_state
        fitted = outputs_kept_within(setting.config, r.seq_len,
                                     host_budgets_beside_optimizer(strategy, room) if budget.host_state else strategy,
                                     setting.item, r.batch, room)
        if fitted is None:
            continue
        bound = _bound(setting.config, r.seq_len, fitted, budget, setting.item, r.batch, r.degree)
        seconds = float("inf") if bound else step_time(setting.config, r.seq_len, fitted, r.rates, batch=r.batch,
                                                       optimizer_offload=offloaded, trainable=setting.params).seconds
        jobs.append(_Job(fitted, budget, bound, seconds, beyond))
    return jobs


class _InOrder:
    """The jobs simulated fastest-predicted first (module docstring): once one fits, the
    slower ones are listed as such unsimulated (unless ``exhaustive``); the next ones start
    in the other workers while one is simulated. A fitting row whose technique can leave
    top layers whole gets a search for how many, in a worker of its own beside the others."""

    def __init__(self, setting: _Setting, jobs: list[_Job], simulations: _Simulations, workers: int, say):
        self.setting, self.jobs, self.simulations, self.workers, self.say = setting, jobs, simulations, workers, say
        self.to_simulate = [i for i, job in enumerate(jobs) if job.bound is None]
        self.winner: str | None = None  # the label of the first row that fits
        self.winner_seconds = float("inf")  # its predicted step time

    def rows(self) -> list[PlanRow]:
        """A row per job, in order, and after each fitting one its row with top layers whole."""
        rows, searches = [], []  # searches: (where its row goes, what gives it or None)
        for i, job in enumerate(self.jobs):
            rows.append(self._row(i, job))
            if rows[-1].fits and _leaves_layers_whole(job.strategy) and not self.setting.request.longest:
                searches.append((len(rows), self._whole_layers(rows[-1], job)))
        for where, search in reversed(searches):
            whole = search()
            if whole is not None:
                rows.insert(where, whole)
        return rows

    def _row(self, i: int, job: _Job) -> PlanRow:
        r = self.setting.request
        if job.bound is not None:
            return PlanRow(name=job.name, strategy=job.strategy.to_dict(), binds=f"{job.bound} {NOT_SIMULATED}",
                           optimizer_offload=job.offloaded, simulated=False)
        if self.winner is not None and not r.exhaustive and not self._may_win_with_whole_layers(job):
            # started ahead or not: the answer must not depend on --jobs
            skipped = (f"over 32 chunks, and {self.winner} fits" if job.beyond
                       else f"predicted slower than {self.winner}, which fits")
            return PlanRow(name=job.name, strategy=job.strategy.to_dict(), notes={"skipped": skipped},
                           optimizer_offload=job.offloaded, simulated=False)
        self._start_ahead(i)
        row = _evaluate(job.strategy, self.setting.config, r.seq_len, job.budget, r.rates, r.batch, self.setting.params,
                        lambda: self.simulations.result(self.setting.simulation(job.strategy, job.budget)))
        if r.longest and row.device_bytes is not None:
            row.longest, row.longest_binds = longest_context(self.setting.config, job.strategy, job.budget, r.dtype,
                                                             batch=r.batch, lora_rank=r.lora_rank, start=r.seq_len,
                                                             label=job.name, progress=self.say)
        if row.fits and self.winner is None:
            self.winner, self.winner_seconds = row.label, row.step_seconds
        return row

    def _may_win_with_whole_layers(self, job: _Job) -> bool:
        """Whether ``job``, predicted slower than the first row that fits, may still beat it
        with top layers left whole (its own search then says how many fit): with as many whole
        as the device could hold beside its lower bound (``whole_layer_bytes`` each), it is
        predicted faster than that row. The memory kept outputs take on the device may instead
        leave layers whole in another candidate."""
        s, r = self.setting, self.setting.request
        name = _leaves_layers_whole(job.strategy)
        if name is None or job.beyond or r.longest:  # (a longest-context plan searches no whole layers)
            return False
        shape = describe_model(s.config)
        # As many whole layers as the device could hold beside the step's lower bound.
        held = job.budget.persistent + least_bytes(s.config, r.seq_len, job.strategy, s.item, r.batch, r.degree)[0]
        room = WHOLE_LAYERS_FILL * job.budget.device_memory - held
        count = min(shape.layers, int(room // shape.whole_layer_bytes(r.batch * r.seq_len // r.degree, s.item)))
        if count < 1:
            return False
        options = registry.technique(name).costs.with_whole_layers(job.strategy.techniques[name], count)
        whole = _rebuilt(job.strategy, **{name: options})
        return step_time(s.config, r.seq_len, whole, r.rates, batch=r.batch, optimizer_offload=job.offloaded,
                         trainable=s.params).seconds < self.winner_seconds

    def _start_ahead(self, i: int) -> None:
        """Job ``i`` and the next ones to simulate, ``workers`` in all, started where not yet."""
        for j in self.to_simulate[self.to_simulate.index(i):][:self.workers]:
            job = self.jobs[j]
            if self.simulations.start(self.setting.simulation(job.strategy, job.budget)):
                self.say(f"simulating {job.shown} at {self.setting.request.seq_len:,} tokens")

    def _whole_layers(self, row: PlanRow, job: _Job) -> Callable[[], PlanRow | None]:
        """What gives ``row`` with as many top layers whole as fit (:func:`most_whole_layers`):
        a search in a worker of its own where there are several, else done here now."""
        s, r = self.setting, self.setting.request
        if self.workers > 1:
            self.say(f"searching how many top layers {job.shown} leaves whole at {r.seq_len:,} tokens")
            return self.simulations.call(_whole_layers_elsewhere, row, job.strategy.to_json(),
                                         json.dumps(s.config.to_dict(), default=str), r.seq_len, job.budget, r.rates,
                                         r.batch, s.params, r.dtype, r.lora_rank).result
        whole = most_whole_layers(row, job.strategy, s.config, r.seq_len, job.budget, r.rates, r.batch, s.params,
                                  self.say, lambda candidate: simulate_step(*s.simulation(candidate, job.budget)))
        return lambda: whole


def _rank(row: PlanRow) -> tuple:
    """Fitting rows fastest first, then the simulated ones that do not fit, nearest first."""
    return (not row.fits, not row.simulated, row.step_seconds if row.fits else (row.reserved_bytes or float("inf")))


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
        options = registry.technique(name).costs.with_whole_layers(strategy.techniques[name], count)
        candidate = _rebuilt(strategy, **{name: options})
        say(f"simulating {_shown(candidate.label, budget)} at {seq_len:,} tokens")
        tried[count] = _evaluate(candidate, config, seq_len, budget, rates, batch, params, lambda: simulated(candidate))

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


def _evaluate(strategy: Strategy, config, seq_len, budget: Budget, rates, batch, params, simulated) -> PlanRow:
    """The plan's row of one candidate; ``simulated()`` gives its simulate_step figures."""
    offloaded = budget.optimizer == "adamw-offload"
    name = strategy.label
    try:
        device, host, notes = simulated()
    except LongtrainError as exc:  # e.g. memo: the inputs and attention outputs alone exceed the host budget
        return PlanRow(name=name, strategy=strategy.to_dict(), binds=str(exc), optimizer_offload=offloaded)
    reserved = reserved_bytes(strategy, budget, device)
    device += budget.device_state
    binds = []
    step = budget.persistent + budget.step_extra  # the optimizer step, activations freed
    if reserved > budget.device_memory:
        binds.append(f"device memory: needs {format_bytes(reserved)}, {format_bytes(reserved - budget.device_memory)} over")
    elif step > budget.device_memory:
        binds.append(f"device memory at the optimizer step: needs {format_bytes(step)}, "
                     f"{format_bytes(step - budget.device_memory)} over")
    if host > budget.host_memory:
        binds.append(f"host memory: needs {format_bytes(host)}, {format_bytes(host - budget.host_memory)} over")
    predicted = step_time(config, seq_len, strategy, rates, notes=notes, batch=batch, optimizer_offload=offloaded,
                          trainable=params)
    sp = strategy.sequence_parallel  # data-parallel groups each train their own batch in that time
    groups = (sp.processes or sp.degree) // sp.degree if sp is not None else 1
    return PlanRow(name=name, strategy=strategy.to_dict(), device_bytes=device, reserved_bytes=reserved, host_bytes=host,
                   fits=not binds, binds="; ".join(binds) or None, step_seconds=predicted.seconds,
                   tokens_per_s=groups * batch * seq_len / predicted.seconds, mfu=predicted.mfu(rates.peak), notes=notes,
                   optimizer_offload=offloaded)
