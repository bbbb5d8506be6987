"""The plan's report: one row per candidate weighed (:class:`PlanRow`), the ranked plan with
its verdict and table (:class:`Plan`), and the text tables every report prints
(:func:`format_table`)."""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass, field

from ..memory.units import format_bytes

__all__ = [
    "Plan",
    "PlanRow",
    "format_table",
    "format_tokens",
]


def format_table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


@dataclass(kw_only=True)
class PlanRow:
    """One candidate weighed. ``name`` is the strategy as ``--strategy`` reads it (``+spN``
    under sequence parallelism); where AdamW's state lives is ``optimizer_offload``, a field
    of its own: :meth:`flags` joins them into what the row prints, and nothing reads the
    name apart again."""

    name: str  # the strategy as --strategy reads it, e.g. "fpdt:chunk=8192:offload,mst" or "checkpoint,mst+sp2"
    strategy: dict
    device_bytes: int | None = None  # simulated allocated peak, optimizer state included
    reserved_bytes: int | None = None  # with the fragmentation margin: what must fit the device
    host_bytes: int | None = None
    fits: bool = False
    binds: str | None = None  # what does not fit, and by how much
    step_seconds: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    notes: dict = field(default_factory=dict)
    longest: int | None = None
    longest_binds: str | None = None
    optimizer_offload: bool = False  # AdamW's state and fp32 master weights in host memory (--optimizer-offload)
    simulated: bool = True  # False: judged by its lower bound, or skipped as slower than what fits

    @property
    def gpus(self) -> int:
        """Processes in all (torchrun's ``--nproc-per-node``): the sequence-parallel groups'."""
        sp = self._sequence_parallel()
        return (sp.get("processes") or sp.get("degree") or 1) if sp else 1

    @property
    def degree(self) -> int:
        """Processes each sequence is split over (``+spN``: ``--sp N`` under torchrun)."""
        sp = self._sequence_parallel()
        return (sp.get("degree") or 1) if sp else 1

    def _sequence_parallel(self) -> dict | None:
        sp = self.strategy.get("sequence_parallel") if isinstance(self.strategy, dict) else None
        return sp if isinstance(sp, dict) else None

    def flags(self) -> list[str]:
        """The ``longtrain train`` options that run this row: ``--strategy NAME``, with
        ``--optimizer-offload`` where AdamW's state lives in host memory and ``--sp N``
        under sequence parallelism."""
        flags = ["--strategy", self.name]
        if self.optimizer_offload:
            flags.append("--optimizer-offload")
        if self.degree > 1:
            flags += ["--sp", str(self.degree)]
        return flags

    @property
    def label(self) -> str:
        """:meth:`flags` as one string, as the table prints it: pastes whole after
        ``longtrain train --model M --seq-len N``."""
        return shlex.join(self.flags())


def format_tokens(tokens: int) -> str:
    """A token count as ``--seq-len`` reads it, shortest first: 524288 -> '512K'."""
    for suffix, unit in (("M", 2**20), ("K", 2**10)):
        if tokens >= unit and tokens % unit == 0:
            return f"{tokens // unit}{suffix}"
    return str(tokens)


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
    sp: int | None = None  # GPUs that share each sequence, where fewer than gpus (data-parallel groups)
    untimed: str | None = None  # work of the model the time model does not count (its adapter's untimed_work)
    batch: int = 1
    four_bit: bool = False  # the base held in 4 bits (bitsandbytes NF4) under the LoRA adapters

    @property
    def best(self) -> PlanRow | None:
        fitting = [r for r in self.rows if r.fits]
        return fitting[0] if fitting else None

    def command(self, row: PlanRow | None = None) -> str:
        """The whole command line that trains ``row`` (default: the best), to paste as it is:
        ``longtrain train --model M --seq-len N`` with the row's :meth:`~PlanRow.flags` and the
        plan's own settings (LoRA, optimizer, dtype, batch); under ``torchrun`` for ``+spN``."""
        row = row or self.best
        if row is None:
            raise ValueError("nothing fits: no command to train")
        launch = ["longtrain", "train"] if row.gpus == 1 else \
            ["torchrun", "--nproc-per-node", str(row.gpus), "-m", "longtrain.cli", "train"]
        args = launch + ["--model", self.model, "--seq-len", format_tokens(self.seq_len)] + row.flags()
        if self.lora_rank:
            args += ["--lora", "--lora-rank", str(self.lora_rank)] + (["--4bit"] if self.four_bit else [])
        if self.optimizer in ("sgd", "adamw-16bit"):  # (the state `none` counts has no training counterpart)
            args += ["--optimizer", self.optimizer]
        if self.dtype != "bfloat16":
            args += ["--dtype", self.dtype]
        if self.batch != 1:
            args += ["--batch-size", str(self.batch)]
        return shlex.join(args)

    def to_dict(self) -> dict:
        """The plan as data; each row also with its ``flags`` (train's options for it) and its
        whole ``command`` line."""
        data = dataclasses.asdict(self)
        for row, out in zip(self.rows, data["rows"]):
            out["flags"], out["command"] = row.flags(), self.command(row)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def verdict(self) -> str:
        best = self.best
        per = " per GPU" if self.gpus > 1 else ""
        if best is not None:
            gpus = "1 GPU" if self.gpus == 1 else f"{self.gpus} GPUs"
            return (f"fastest that fits: {best.label} — predicted {best.step_seconds:.3g} s per step on {gpus} at the "
                    f"{self.rates_name} rates ({best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.0%}); device "
                    f"{format_bytes(best.reserved_bytes)} of {format_bytes(self.device_memory)}{per} with the fragmentation "
                    f"margin, host {format_bytes(best.host_bytes)} of {format_bytes(self.host_memory)}")
        simulated = [r for r in self.rows if r.reserved_bytes is not None]
        if not simulated:
            return f"nothing fits {self.seq_len:,} tokens: " + "; ".join(sorted({r.binds for r in self.rows if r.binds}))
        closest = min(simulated, key=lambda r: r.reserved_bytes)
        return f"nothing fits {self.seq_len:,} tokens: closest is {closest.label}, where {closest.binds}"

    def table(self) -> str:
        head = ("train with", "device (reserved)", "host", "fits", "step s", "tokens/s", "MFU")
        longest = any(r.longest for r in self.rows)
        rows = [head + (("longest context",) if longest else ())]
        for r in self.rows:
            fits = "yes" if r.fits else ("no" if r.binds else "–")
            row = (r.label, format_bytes(r.reserved_bytes) if r.reserved_bytes else "–",
                   format_bytes(r.host_bytes) if r.host_bytes is not None else "–", fits,
                   f"{r.step_seconds:.3g}" if r.step_seconds else "–", f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "–",
                   f"{r.mfu:.0%}" if r.mfu else "–")
            if longest:
                row += (f"{r.longest:,} ({r.longest_binds})" if r.longest else "–",)
            rows.append(row)
        what = f"LoRA rank {self.lora_rank}" if self.lora_rank else f"full fine-tuning, {self.optimizer}"
        what += " over a 4-bit (NF4) base" if self.four_bit else ""
        groups = f" in groups of {self.sp} sharing each sequence" if self.sp and self.sp != self.gpus else ""
        title = (f"{self.model}: {self.seq_len:,} tokens, {self.dtype}, {what}; {self.gpus} GPU(s) of "
                 f"{format_bytes(self.device_memory)}{groups}, host {format_bytes(self.host_memory)}")
        limits = [f"  {r.label}: {r.binds}" for r in self.rows if r.binds]
        skipped = [r for r in self.rows if not r.simulated and not r.binds]
        lines = [title, format_table(rows), ""]
        if limits:
            lines += ["what does not fit:"] + limits + [""]
        if skipped:
            lines += [f"{len(skipped)} candidate(s) not simulated ({skipped[0].notes['skipped']}); "
                      "--exhaustive simulates them", ""]
        train = [f"train it: {self.command()}"] if self.best is not None else []
        if train and self.optimizer == "none":
            train.append("(planned without optimizer state: `longtrain train` steps AdamW, whose float32 masters and "
                         "moments this plan does not count; plan with --optimizer adamw to count them)")
        return "\n".join(lines + [self.verdict()] + train + [
            "memory simulated (device × the allocator's measured fragmentation margin); "
            f"step time from the time model at the {self.rates_name} rates (longtrain.plan.time_model)"
            + (f"; it does not count {self.untimed}" if self.untimed else "")])
