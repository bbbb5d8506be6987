"""``longtrain plan``: the fastest exact strategy that trains this model at this length on
this machine — decided before renting it.

For each candidate strategy (layer checkpointing + MsT; Memo + MsT; FPDT with host
offload at a few chunk sizes, with and without kept attention outputs):

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
comes at once. FPDT's peaks, which repeat chunk by chunk, are extended from two and four
chunks (:func:`simulate_step`), which makes a plan minutes instead of hours; simulations
are cached in the process. ``longest=True`` adds, per
strategy, the longest context it reaches (a second simulation at half the length, memory
taken as linear in the length between and beyond).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import LongtrainError
from ..memory.units import format_bytes
from ..models.loading import load_config, parse_dtype
from ..strategy import Strategy
from ..techniques.memo import Memo
from .time_model import H100, MachineRates, step_time

# The allocator's overhead on what a step allocates and frees (everything but the weights
# and the optimizer state, which are allocated once): (reserved − weights) / (allocated −
# weights) on the H100 (../shared/gpu/h100-2026-11-22.md), the largest seen per kind.
FRAGMENTATION = {"offload": 1.8, "chunked": 1.25, "whole": 1.1}
CHUNKS = (8192, 16384, 32768)


def candidates(seq_len: int, host_memory: int | None) -> dict[str, Strategy]:
    """The strategies the planner weighs at ``seq_len`` tokens (fastest-looking kinds of
    each family; SeCO/SpaCO are left out: slower than FPDT at the same memory)."""
    found = {
        "checkpoint,mst": Strategy(checkpoint=True, mst=True),
        "memo,mst": Strategy(memo=Memo(host_memory=host_memory), mst=True),
    }
    for chunk in CHUNKS:
        if chunk >= seq_len or seq_len // chunk > 32:  # one chunk is no chunking; many cost host time
            continue
        for keep in (False, True):
            options = {"chunk": chunk, "offload": True, "keep_output": keep}
            name = f"fpdt:chunk={chunk}:offload" + (":keep_output" if keep else "") + ",mst"
            found[name] = Strategy(engine="fpdt", engine_options=options, mst=True)
    return found


def _margin(strategy: Strategy) -> float:
    options = strategy.engine_options
    if getattr(options, "offload", False) or "memo" in strategy.techniques:
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


@dataclass
class Plan:
    model: str
    seq_len: int
    device_memory: int
    host_memory: int
    optimizer: str
    dtype: str
    rows: list[PlanRow]

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
        if best is not None:
            return (f"fastest that fits: {best.name} — predicted {best.step_seconds:.3g} s per step on an H100 "
                    f"({best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.0%}); device {format_bytes(best.reserved_bytes)} "
                    f"of {format_bytes(self.device_memory)} with the fragmentation margin, host "
                    f"{format_bytes(best.host_bytes)} of {format_bytes(self.host_memory)}")
        closest = min(self.rows, key=lambda r: r.reserved_bytes or float("inf"))
        return f"nothing fits {self.seq_len:,} tokens: closest is {closest.name}, where {closest.binds}"

    def table(self) -> str:
        from .simulate import format_table

        head = ("strategy", "device (reserved)", "host", "fits", "step s", "tokens/s", "MFU")
        longest = any(r.longest for r in self.rows)
        rows = [head + (("longest context",) if longest else ())]
        for r in self.rows:
            row = (r.name, format_bytes(r.reserved_bytes) if r.reserved_bytes else "–",
                   format_bytes(r.host_bytes) if r.host_bytes is not None else "–", "yes" if r.fits else "no",
                   f"{r.step_seconds:.3g}" if r.step_seconds else "–", f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "–",
                   f"{r.mfu:.0%}" if r.mfu else "–")
            if longest:
                row += (f"{r.longest:,} ({r.longest_binds})" if r.longest else "–",)
            rows.append(row)
        title = (f"{self.model}: {self.seq_len:,} tokens, {self.dtype}, {self.optimizer}; device "
                 f"{format_bytes(self.device_memory)}, host {format_bytes(self.host_memory)}")
        limits = [f"  {r.name}: {r.binds}" for r in self.rows if r.binds]
        return "\n".join([title, format_table(rows), ""] + (["what does not fit:"] + limits + [""] if limits else []) + [
            self.verdict(), "memory simulated (device × the allocator's measured fragmentation margin); "
            "step time from the H100 time model (longtrain.plan.time_model)"])


def _state_bytes(config, optimizer: str, dtype: torch.dtype) -> tuple[int, int]:
    """(parameter count, bytes of the optimizer state) of full fine-tuning."""
    from ..models.loading import build_from_config

    with torch.device("meta"):
        model = build_from_config(config, dtype)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    per = {"adamw": 2, "sgd": 1, "none": 0}[optimizer]
    return params, per * params * torch.tensor([], dtype=dtype).element_size()


@functools.lru_cache(maxsize=256)
def _simulated(config_json: str, seq_len: int, strategy_json: str, dtype: str, batch: int = 1):
    from transformers import AutoConfig

    from .simulate import simulate

    data = json.loads(config_json)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    report = simulate(config, seq_len, batch_size=batch, strategy=Strategy.from_json(strategy_json), optimizer="none",
                      dtype=dtype)
    return report.device_peak_bytes, report.peak.peak_host_bytes, dict(report.notes)


def simulate_step(config, seq_len: int, strategy: Strategy, dtype: str, batch: int = 1) -> tuple[int, int, dict]:
    """(device peak, host peak, notes) of one step without optimizer state.

    FPDT's schedule repeats per chunk: its device peak is one chunk's working set plus
    what grows with the length (token ids, targets: a line), and its host peak the
    parked chunks (a line). So past four chunks it is simulated at two and four chunks
    and the lines are extended to the length rounded up to whole chunks — minutes instead
    of hours at 512K tokens, never below a full simulation, and above it by at most the partial chunk
    (tests/test_planner.py). Other strategies are simulated
    at the full length."""
    config_json = json.dumps(config.to_dict(), sort_keys=True, default=str)
    chunk = getattr(strategy.engine_options, "chunk", None)
    if strategy.engine != "fpdt" or not chunk or seq_len <= 4 * chunk:
        return _simulated(config_json, seq_len, strategy.to_json(), dtype, batch)
    short, long = 2 * chunk, 4 * chunk
    d1, h1, _ = _simulated(config_json, short, strategy.to_json(), dtype, batch)
    d2, h2, notes = _simulated(config_json, long, strategy.to_json(), dtype, batch)
    whole = -(-seq_len // chunk) * chunk  # a last partial chunk counted whole: never below the real peak
    scale = (whole - long) / (long - short)
    return int(d2 + scale * (d2 - d1)), int(h2 + scale * (h2 - h1)), notes


def plan(model, seq_len: int, *, device_memory: int, host_memory: int, optimizer: str = "adamw",
         dtype: str = "bfloat16", rates: MachineRates = H100, longest: bool = False, batch: int = 1,
         progress: Callable[[str], None] | None = None) -> Plan:
    """Rank the candidate strategies for ``model`` (preset, directory or config) at
    ``seq_len`` tokens on a device of ``device_memory`` bytes with ``host_memory`` bytes of
    host memory (module docstring)."""
    say = progress or (lambda _: None)
    config = load_config(model)
    config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, 2 * seq_len)
    torch_dtype = parse_dtype(dtype)
    params, state = _state_bytes(config, optimizer, torch_dtype)
    item = torch.tensor([], dtype=torch_dtype).element_size()
    model_states = params * item * 2 + state  # weights, gradients, optimizer state
    name = model if isinstance(model, str) else getattr(config, "name_or_path", "") or config.model_type
    result = Plan(name, seq_len, device_memory, host_memory, optimizer, str(torch_dtype).replace("torch.", ""), [])
    if model_states > device_memory:
        raise LongtrainError(
            f"the model states alone (weights, gradients, {optimizer} state: {format_bytes(model_states)}) exceed the "
            f"device's {format_bytes(device_memory)} by {format_bytes(model_states - device_memory)}; no activation "
            "strategy helps — shard them over GPUs (--sp), train LoRA, or use a smaller optimizer"
        )
    for label, strategy in candidates(seq_len, host_memory).items():
        say(f"simulating {label} at {seq_len:,} tokens")
        row = _evaluate(label, strategy, config, seq_len, dtype, state, params * item + state, device_memory,
                        host_memory, rates, batch)
        if longest and row.device_bytes is not None:
            row.longest, row.longest_binds = _longest(row, strategy, config, seq_len, dtype, state, device_memory,
                                                      host_memory, batch)
        result.rows.append(row)
    result.rows.sort(key=lambda r: (not r.fits, r.step_seconds if r.fits else (r.reserved_bytes or float("inf"))))
    return result


def _evaluate(label, strategy, config, seq_len, dtype, state, persistent, device_memory, host_memory, rates,
              batch) -> PlanRow:
    try:
        device, host, notes = simulate_step(config, seq_len, strategy, dtype, batch)
    except LongtrainError as exc:  # e.g. memo: the inputs and attention outputs alone exceed the host budget
        return PlanRow(label, strategy.to_dict(), None, None, None, False, str(exc), None, None, None)
    device += state
    reserved = int(persistent + _margin(strategy) * (device - persistent))
    binds = []
    if reserved > device_memory:
        binds.append(f"device memory: needs {format_bytes(reserved)}, {format_bytes(reserved - device_memory)} over")
    if host > host_memory:
        binds.append(f"host memory: needs {format_bytes(host)}, {format_bytes(host - host_memory)} over")
    predicted = step_time(config, seq_len, strategy, rates, notes=notes, batch=batch)
    return PlanRow(label, strategy.to_dict(), device, reserved, host, not binds, "; ".join(binds) or None,
                   predicted.seconds, batch * seq_len / predicted.seconds, predicted.mfu(rates.peak), notes)


def _longest(row: PlanRow, strategy, config, seq_len, dtype, state, device_memory, host_memory, batch):
    """Longest context by the line through the peaks at ``seq_len`` / 2 and ``seq_len``."""
    half = max(2, seq_len // 2)
    try:
        device_half, host_half, _ = simulate_step(config, half, strategy, dtype, batch)
    except LongtrainError:
        return None, None
    margin = _margin(strategy)
    device_slope = margin * (row.device_bytes - state - device_half) / (seq_len - half)  # reserved bytes per token
    host_slope = (row.host_bytes - host_half) / (seq_len - half)
    by_device = seq_len + (device_memory - row.reserved_bytes) / device_slope if device_slope > 0 else float("inf")
    by_host = seq_len + (host_memory - row.host_bytes) / host_slope if host_slope > 0 else float("inf")
    if by_device == by_host == float("inf"):
        return None, "no limit found"
    return int(max(0, min(by_device, by_host))), "device memory" if by_device <= by_host else "host memory"
