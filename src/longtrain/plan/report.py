"""The plan's report: one row per candidate weighed (:class:`PlanRow`), the ranked plan with
its verdict and table (:class:`Plan`), and the text tables every report prints
(:func:`format_table`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ..memory.units import format_bytes

__all__ = [
    "Plan",
    "PlanRow",
    "format_table",
]


def format_table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


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
    untimed: str | None = None  # work of the model the time model does not count (its adapter's untimed_work)

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
            gpus = "1 GPU" if self.gpus == 1 else f"{self.gpus} GPUs"
            return (f"fastest that fits: {best.name} — predicted {best.step_seconds:.3g} s per step on {gpus} at the "
                    f"{self.rates_name} rates ({best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.0%}); device "
                    f"{format_bytes(best.reserved_bytes)} of {format_bytes(self.device_memory)}{per} with the fragmentation "
                    f"margin, host {format_bytes(best.host_bytes)} of {format_bytes(self.host_memory)}")
        simulated = [r for r in self.rows if r.reserved_bytes is not None]
        if not simulated:
            return f"nothing fits {self.seq_len:,} tokens: " + "; ".join(sorted({r.binds for r in self.rows if r.binds}))
        closest = min(simulated, key=lambda r: r.reserved_bytes)
        return f"nothing fits {self.seq_len:,} tokens: closest is {closest.name}, where {closest.binds}"

    def table(self) -> str:
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
            f"step time from the time model at the {self.rates_name} rates (longtrain.plan.time_model)"
            + (f"; it does not count {self.untimed}" if self.untimed else "")])
