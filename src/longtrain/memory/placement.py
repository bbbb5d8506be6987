"""Memory planning: place every tensor of a recorded step at a fixed offset, without fragmentation.

A training step allocates the same tensors in the same order every time. Given one
step's allocation trace — each tensor's size and the interval it lives — the offline
*dynamic storage allocation* problem asks for offsets such that tensors alive at the
same time never overlap, with the smallest top offset (the *planned peak*). The most
bytes ever alive at once bounds it from below; a caching allocator, which cannot see
the future, ends above it (fragmentation: the gap between its reserved and allocated
peaks). Memo (its paper, §5) solves this offline and serves the step from the plan.

Here:

- traces come from the tracker (:meth:`~longtrain.memory.tracker.MemoryTracker.trace`,
  exact on CPU and under the simulator) or from a CUDA allocator snapshot
  (:func:`trace_from_cuda_snapshot`);
- :func:`best_fit` is the greedy (biggest first, each at the lowest gap that fits);
  :func:`first_fit_online` is what an allocator without future knowledge does, a
  stand-in for the reserved peak where no GPU allocator ran;
- :func:`solve` is OR-Tools CP-SAT (``pip install ortools``): fixed time
  intervals, variable address intervals, ``NoOverlap2D``, minimize the top; greedy's
  plan as hint and fallback, under a time limit;
- :func:`solve_bilevel` is Memo's two levels, for whole-model traces: the timeline is cut
  into windows (a layer's forward or backward); tensors living inside one window are
  planned per window (identical windows — identical layers — solved once), tensors
  living across windows are bundled by (first window, last window); then windows and
  bundles are placed as blocks;
- :func:`check_plan` verifies a plan independently (a sweep over time), and
  :class:`Arena` serves planned tensors as views of one pre-allocated buffer.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import torch

from ..errors import LongtrainError

__all__ = [
    "ALIGN",
    "Arena",
    "Block",
    "FragmentationReport",
    "Plan",
    "best_fit",
    "check_plan",
    "first_fit_online",
    "fragmentation_report",
    "live_peak",
    "plan_memory",
    "solve",
    "solve_bilevel",
    "trace_from_cuda_snapshot",
]

# Offsets are planned in units of 512 bytes, the CUDA caching allocator's rounding.
ALIGN = 512


@dataclass(frozen=True)
class Block:
    """One tensor of a trace: ``size`` bytes alive over the time steps ``[start, end)``."""

    size: int
    start: int
    end: int
    label: str = ""


@dataclass
class Plan:
    """Offsets (bytes) for the blocks of a trace, and the top of the highest one."""

    offsets: list[int]
    peak: int
    method: str
    seconds: float = 0.0
    optimal: bool = False
    details: dict = field(default_factory=dict)


# ---- traces --------------------------------------------------------------------------

def trace_from_cuda_snapshot(snapshot: dict, device: int = 0) -> list[Block]:
    """Blocks from ``torch.cuda.memory._snapshot()`` taken after
    ``torch.cuda.memory._record_memory_history()``: a tensor lives from its ``alloc``
    to its ``free_requested`` (still-live ones to the end of the trace)."""
    events = snapshot.get("device_traces", [[]])[device]
    live: dict[int, tuple[int, int]] = {}
    blocks = []
    for t, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], t)
        elif action in ("free_requested", "free_completed") and event["addr"] in live:
            size, start = live.pop(event["addr"])
            blocks.append(Block(size, start, t + 1))
    end = len(events) + 1
    blocks += [Block(size, start, end) for size, start in live.values()]
    return sorted(blocks, key=lambda b: (b.start, b.end))


def live_peak(blocks: list[Block]) -> int:
    """The most bytes alive at any one time: no plan can go below it."""
    events = sorted([(b.start, b.size) for b in blocks] + [(b.end, -b.size) for b in blocks],
                    key=lambda e: (e[0], e[1]))  # frees before allocations at the same time
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def _units(size: int) -> int:
    return -(-size // ALIGN)


def _overlap(a: Block, b: Block) -> bool:
    return a.start < b.end and b.start < a.end


# ---- greedy and online ---------------------------------------------------------------

def _lowest_gap(placed: list[tuple[int, int]], size: int, best: bool) -> int:
    """Lowest offset (best: in the tightest gap) where ``size`` fits among ``placed``
    (offset, top) intervals."""
    placed.sort()
    candidate, gap_best, where = 0, None, None
    for offset, top in placed:
        if offset - candidate >= size:
            gap = offset - candidate
            if not best:
                return candidate
            if gap_best is None or gap < gap_best:
                gap_best, where = gap, candidate
        candidate = max(candidate, top)
    return where if where is not None else candidate


def best_fit(blocks: list[Block]) -> Plan:
    """Greedy offline plan: biggest (then longest-lived) first, each in the tightest gap
    left by the already placed blocks that overlap it in time."""
    started = time.perf_counter()
    order = sorted(range(len(blocks)), key=lambda i: (-blocks[i].size, -(blocks[i].end - blocks[i].start), i))
    offsets = [0] * len(blocks)
    done: list[int] = []
    for i in order:
        b = blocks[i]
        size = _units(b.size) * ALIGN
        placed = [(offsets[j], offsets[j] + _units(blocks[j].size) * ALIGN) for j in done if _overlap(b, blocks[j])]
        offsets[i] = _lowest_gap(placed, size, best=True)
        done.append(i)
    return Plan(offsets, _top(blocks, offsets), "greedy best-fit", time.perf_counter() - started)


def first_fit_online(blocks: list[Block]) -> Plan:
    """What an allocator that cannot see the future does: in time order, each new tensor
    at the lowest free address that fits (address-ordered first fit, no moving)."""
    started = time.perf_counter()
    order = sorted(range(len(blocks)), key=lambda i: (blocks[i].start, i))
    ends: list[tuple[int, int]] = []  # (end time, index) of placed blocks still to free
    live: dict[int, tuple[int, int]] = {}
    offsets = [0] * len(blocks)
    for i in order:
        b = blocks[i]
        while ends and ends[0][0] <= b.start:
            _, j = ends.pop(0)
            live.pop(j, None)
        offsets[i] = _lowest_gap(list(live.values()), _units(b.size) * ALIGN, best=False)
        live[i] = (offsets[i], offsets[i] + _units(b.size) * ALIGN)
        bisect.insort(ends, (b.end, i))
    return Plan(offsets, _top(blocks, offsets), "online first-fit", time.perf_counter() - started)


def _top(blocks, offsets) -> int:
    return max((o + _units(b.size) * ALIGN for b, o in zip(blocks, offsets)), default=0)


# ---- CP-SAT --------------------------------------------------------------------------

def _cp_model():
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise LongtrainError("memory planning needs OR-Tools: pip install ortools") from None
    return cp_model


def solve(blocks: list[Block], *, time_limit: float = 5.0, workers: int = 2, hint: Plan | None = None) -> Plan:
    """The plan with the smallest top CP-SAT finds within ``time_limit`` seconds; never
    worse than the greedy plan it starts from."""
    cp_model = _cp_model()
    started = time.perf_counter()
    greedy = hint or best_fit(blocks)
    if not blocks:
        return greedy
    sizes = [_units(b.size) for b in blocks]
    upper = greedy.peak // ALIGN
    lower = max(_units(live_peak(blocks)), max(sizes))
    model = cp_model.CpModel()
    offsets, times, spaces = [], [], []
    for i, (b, size) in enumerate(zip(blocks, sizes)):
        offset = model.NewIntVar(0, upper - size, f"o{i}")
        offsets.append(offset)
        times.append(model.NewIntervalVar(b.start, b.end - b.start, b.end, f"t{i}"))
        spaces.append(model.NewIntervalVar(offset, size, offset + size, f"s{i}"))
        model.AddHint(offset, greedy.offsets[i] // ALIGN)
    model.AddNoOverlap2D(times, spaces)
    top = model.NewIntVar(lower, upper, "top")
    for offset, size in zip(offsets, sizes):
        model.Add(offset + size <= top)
    model.Minimize(top)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = workers
    solver.parameters.relative_gap_limit = 1e-3  # within 0.1% of the bound is good enough
    status = solver.Solve(model)
    seconds = time.perf_counter() - started
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) or solver.Value(top) * ALIGN >= greedy.peak:
        return Plan(greedy.offsets, greedy.peak, "greedy best-fit (CP-SAT found nothing better)", seconds,
                    details={"cp_sat_status": solver.StatusName(status)})
    found = [solver.Value(o) * ALIGN for o in offsets]
    return Plan(found, _top(blocks, found), "CP-SAT", seconds, optimal=status == cp_model.OPTIMAL,
                details={"lower_bound": lower * ALIGN})


# ---- two levels (Memo §5) ------------------------------------------------------------

def _windows(blocks: list[Block], count: int) -> list[int]:
    """Cut points of ``count`` windows holding equal numbers of allocations."""
    starts = sorted(b.start for b in blocks)
    cuts = [starts[len(starts) * k // count] for k in range(1, count)]
    return sorted(set(cuts))


def solve_bilevel(blocks: list[Block], *, windows: int | list[int] = 64, time_limit: float = 5.0,
                  workers: int = 2) -> Plan:
    """Memo's bi-level plan for a whole-model trace (module docstring). ``windows``: how
    many equal windows to cut the timeline into, or the cut times themselves (e.g.
    layer boundaries)."""
    started = time.perf_counter()
    cuts = _windows(blocks, windows) if isinstance(windows, int) else sorted(windows)

    def window_of(t: int) -> int:
        return bisect.bisect_right(cuts, t)

    local: dict[int, list[int]] = {}
    bundles: dict[tuple[int, int], list[int]] = {}
    for i, b in enumerate(blocks):
        first, last = window_of(b.start), window_of(b.end - 1)
        (local.setdefault(first, []) if first == last else bundles.setdefault((first, last), [])).append(i)
    offsets = [0] * len(blocks)
    groups: list[tuple[Block, list[int], list[int]]] = []  # (group block, members, offsets inside)
    solved: dict[tuple, Plan] = {}
    for members in local.values():
        inner = [blocks[i] for i in members]
        base = min(b.start for b in inner)
        signature = tuple((b.size, b.start - base, b.end - base) for b in inner)
        if signature not in solved:  # identical layers: one solve
            rel = [Block(b.size, b.start - base, b.end - base) for b in inner]
            solved[signature] = solve(rel, time_limit=min(time_limit, 2.0), workers=workers)
        plan = solved[signature]
        groups.append((Block(plan.peak, base, max(b.end for b in inner)), members, plan.offsets))
    for members in bundles.values():  # tensors living across the same windows: packed greedily together
        inner = [blocks[i] for i in members]
        base = min(b.start for b in inner)
        plan = best_fit([Block(b.size, b.start - base, b.end - base) for b in inner])
        groups.append((Block(plan.peak, base, max(b.end for b in inner)), members, plan.offsets))
    outer = solve([g[0] for g in groups], time_limit=time_limit, workers=workers)
    for (group, members, inside), base in zip(groups, outer.offsets):
        for i, offset in zip(members, inside):
            offsets[i] = base + offset
    plan = Plan(offsets, _top(blocks, offsets), "CP-SAT, two levels", time.perf_counter() - started,
                details={"windows": len(local), "distinct_windows": len(solved), "bundles": len(bundles),
                         "outer_blocks": len(groups)})
    return plan


# ---- checking and serving --------------------------------------------------------------

def check_plan(blocks: list[Block], plan: Plan) -> None:
    """Raise ``AssertionError`` if two blocks alive at the same time overlap in the plan,
    or a block lies outside ``[0, plan.peak)``. Independent of the solvers: a sweep over
    time keeping the live address intervals sorted."""
    assert len(plan.offsets) == len(blocks), "one offset per block"
    events = sorted([(b.end, 0, i) for i, b in enumerate(blocks)] + [(b.start, 1, i) for i, b in enumerate(blocks)])
    live: list[tuple[int, int, int]] = []  # (offset, top, index), sorted
    for _, kind, i in events:
        b, offset = blocks[i], plan.offsets[i]
        entry = (offset, offset + b.size, i)
        if kind == 0:
            live.remove(entry)
            continue
        assert offset >= 0 and offset + b.size <= plan.peak, f"block {i} outside the plan"
        where = bisect.bisect_left(live, entry)
        if where > 0:
            assert live[where - 1][1] <= offset, f"blocks {live[where - 1][2]} and {i} overlap"
        if where < len(live):
            assert entry[1] <= live[where][0], f"blocks {i} and {live[where][2]} overlap"
        live.insert(where, entry)


class Arena:
    """One pre-allocated buffer serving the tensors of a plan as views at their offsets."""

    def __init__(self, plan: Plan, device: torch.device | str = "cpu"):
        self.plan = plan
        self.buffer = torch.empty(plan.peak, dtype=torch.uint8, device=device)

    def tensor(self, index: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """Block ``index``'s tensor: a view of the arena at its planned offset."""
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        offset = self.plan.offsets[index]
        return self.buffer[offset: offset + nbytes].view(dtype).view(shape)


@dataclass
class FragmentationReport:
    """Device bytes of one step: alive at once, planned, and an online allocator's top."""

    blocks: int
    live_peak: int
    planned_peak: int
    greedy_peak: int
    online_peak: int
    method: str
    seconds: float

    def rows(self) -> list[tuple[str, str]]:
        from .units import format_bytes

        def share(n):
            return f"{format_bytes(n)} ({n / self.live_peak:.3f}× allocated)" if self.live_peak else format_bytes(n)

        return [("allocated (most bytes alive at once)", format_bytes(self.live_peak)),
                (f"planned ({self.method}, {self.seconds:.1f} s)", share(self.planned_peak)),
                ("greedy best-fit plan", share(self.greedy_peak)),
                ("online first-fit (an allocator without the plan)", share(self.online_peak))]


def plan_memory(blocks: list[Block], *, time_limit: float = 5.0, bilevel_above: int = 400) -> tuple[Plan, Plan]:
    """(best plan, greedy plan) of ``blocks``: CP-SAT on the whole trace up to
    ``bilevel_above`` blocks, else two levels — kept only where it beats greedy."""
    greedy = best_fit(blocks)
    if len(blocks) <= bilevel_above:
        return solve(blocks, time_limit=time_limit, hint=greedy), greedy
    two_levels = solve_bilevel(blocks, time_limit=time_limit)
    if two_levels.peak < greedy.peak:
        return two_levels, greedy
    return Plan(greedy.offsets, greedy.peak, "greedy best-fit (two-level CP-SAT was not better)",
                greedy.seconds + two_levels.seconds, details=two_levels.details), greedy


def fragmentation_report(blocks: list[Block], *, time_limit: float = 5.0) -> FragmentationReport:
    """Plan ``blocks`` and compare the plan with the allocated and online peaks."""
    plan, greedy = plan_memory(blocks, time_limit=time_limit)
    check_plan(blocks, plan)
    return FragmentationReport(len(blocks), live_peak(blocks), plan.peak, greedy.peak, first_fit_online(blocks).peak,
                               plan.method, plan.seconds)
