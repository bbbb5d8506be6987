"""The end-of-run summary: summary.json, and the table ``longtrain train`` prints from it.

The summary is what a run measured (losses over the whole run, resumed parts included;
throughput; peak and reserved memory; the evaluation) next to what stock training would
need (the simulator's peak for the same model without techniques), so one file answers
"did it learn, how fast, and what did the strategy save". The formatting only reads the
dict, so a summary.json from disk prints the same.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LongtrainError, writing
from ..memory.allocator import allocator_setting
from ..memory.units import format_bytes
from ..models.adapters import describe_model
from ..strategy import Strategy, applied_context, pinned_host_bytes
from . import run_checkpoints as ckpt
from .config import TrainConfig
from .metrics import read_metrics, strict_json

__all__ = ["format_summary", "write_summary"]


def write_summary(out: Path, config: TrainConfig, *, strategy: Strategy, model, device: torch.device,
                  compute_dtype: torch.dtype, dtype: torch.dtype, processes: int, steps: int, has_task: bool,
                  evaluation: dict | None, peak_bytes: int, reserved_bytes: int, step_times: list[float], seconds: float,
                  base_config) -> dict:
    """The run's summary, written to summary.json in ``out``. ``steps``: the step the run
    is at; ``step_times``: the steps this command trained; ``base_config``: the model's
    config (before LoRA is merged)."""
    from ..plan.simulate import simulate

    c = config
    # The whole run's losses, the parts before a resume included.
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    window = max(1, min(10, len(losses) // 4))
    steady = step_times[1:] or step_times
    # The same run without techniques (LoRA's adapters over the base as loaded, 4 bits or not).
    # A run the simulator cannot stand for (a mixture of experts outside bfloat16) has none.
    try:
        stock = simulate(base_config, c.seq_len, batch_size=c.batch_size, strategy="none", optimizer=c.optimizer,
                         dtype=dtype, lora_rank=c.lora_rank if c.lora else None)
        stock_peak, stock_setup = stock.device_peak_bytes, "same setup"
    except LongtrainError as exc:
        stock_peak, stock_setup = None, f"not simulated: {exc}"
    summary = {
        "model": c.model, "seq_len": c.seq_len, "strategy": strategy.spec, "steps": steps,
        "optimizer": "adamw-offload" if c.optimizer_offload else c.optimizer,  # adamw: float32 masters for 16-bit weights
        "steps_trained": len(step_times),  # by this command (fewer than "steps" when it resumed)
        "first_loss": sum(losses[:window]) / window if losses else None,
        "final_loss": sum(losses[-window:]) / window if losses else None,
        "task": evaluation,
        # The pass-key accuracy before the first step (logged as step 0 by a run that started from it).
        "task_before": next((r["eval"] for r in read_metrics(out / "metrics.jsonl")
                             if r.get("step") == 0 and "eval" in r), None) if has_task else None,
        "tokens_per_s": c.seq_len * c.batch_size * c.grad_accum * len(steady) / sum(steady) if steady else None,
        "measured_peak_bytes": peak_bytes,
        "measured_with": "cuda-allocator" if device.type == "cuda" else "tracked-storages",
        # What runs out on a GPU is the allocator's reservation (fragmentation included), and the setting that shapes it.
        "measured_reserved_bytes": reserved_bytes if device.type == "cuda" else None,
        "allocator": allocator_setting() if device.type == "cuda" else None,
        # The kernel of unmasked attention blocks (masks and soft-capping use explicit scores).
        "attention_kernel": _attention_kernel(base_config, device, compute_dtype),
        # Host memory longtrain parked chunks in (chunked attention's pinned pool).
        "host_pool_bytes": pinned_host_bytes(model),
        "simulated_stock_peak_bytes": stock_peak,
        "simulated_stock_setup": stock_setup,
        "seconds": seconds,
        "device": str(device),
        "processes": processes,
        # What techniques measured or chose on this machine (memo's alpha and its inputs).
        "strategy_notes": dict(applied_context(model).notes),
    }
    with writing("the run summary", out / "summary.json"):
        ckpt.write_text_atomic(out / "summary.json", strict_json(summary, indent=2))
    return summary


def _attention_kernel(config, device: torch.device, dtype: torch.dtype) -> str | None:
    shape = describe_model(config)
    if not shape.has_attention:  # SSMs
        return None
    from ..ops.attention_blocks import attention_kernel

    return attention_kernel(device, dtype, shape.head_dim)


def _evaluation_row(task: dict | None, before: dict | None = None) -> tuple[str, str]:
    if task is not None and "digit_accuracy" in task:
        text = (f"{task['digit_accuracy']:.1%} of answer digits, {task['key_accuracy']:.1%} of whole keys "
                f"({task['samples']} held-out samples)")
        if before is not None:
            text += f"; before training {before['digit_accuracy']:.1%} and {before['key_accuracy']:.1%}"
        return ("pass-key accuracy", text + "; chance 10% of digits")
    if task is not None and "loss" in task:
        return ("held-out loss", f"{task['loss']:.4f} on {task['samples']} windows of --data set aside from training")
    return ("held-out loss", "none: the data holds fewer than 10 windows of --seq-len, too few to set one aside")


def _throughput_row(summary: dict) -> tuple[str, str]:
    if summary["tokens_per_s"] is None:
        return ("throughput", f"n/a (no step trained by this command) on {summary['device']}")
    kernel = f" (attention kernel {summary['attention_kernel']})" if summary.get("attention_kernel") and \
        summary["device"].startswith("cuda") else ""
    return ("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s on {summary['device']}{kernel}")


def _peak_text(summary: dict) -> str:
    text = f"{format_bytes(summary['measured_peak_bytes'])} ({summary['measured_with']})"
    if summary.get("measured_reserved_bytes"):  # CUDA: the reservation is what runs out
        text += (f", {format_bytes(summary['measured_reserved_bytes'])} reserved "
                 f"({summary['measured_reserved_bytes'] / max(1, summary['measured_peak_bytes']):.2f}×, allocator {summary['allocator']})")
    return text


def _steps_phrase(summary: dict) -> str:
    trained = summary.get("steps_trained", summary["steps"])
    return f"{trained} steps" + ("" if trained == summary["steps"] else f" (resumed: {summary['steps']} in all)")


def _stock_row(summary: dict) -> tuple[str, str]:
    if summary["simulated_stock_peak_bytes"] is None:
        return ("simulated stock peak", f"n/a ({summary['simulated_stock_setup']})")
    return ("simulated stock peak", f"{format_bytes(summary['simulated_stock_peak_bytes'])} (same model, no techniques, "
                                    f"{summary['simulated_stock_setup']}, seq_len {summary['seq_len']:,})")


def format_summary(summary: dict) -> str:
    rows = [
        ("loss", f"{summary['final_loss']:.4f} (mean of the last steps; first steps: {summary['first_loss']:.4f})"
                 if summary["final_loss"] is not None else "n/a (no step logged in this run directory)"),
        _evaluation_row(summary["task"], summary.get("task_before")),
        _throughput_row(summary),
        ("measured peak memory", _peak_text(summary) if summary.get("steps_trained", 1) else "n/a (no step trained by this command)"),
        _stock_row(summary),
        ("wall time", f"{summary['seconds']:.0f} s for {_steps_phrase(summary)}, strategy {summary['strategy']}"
                      + (f", optimizer {summary['optimizer']}" if summary.get("optimizer") else "")),
    ]
    if summary.get("processes", 1) > 1:
        rows[3] = (rows[3][0], rows[3][1] + f", the largest of {summary['processes']} processes")
    if summary.get("host_pool_bytes"):
        parked = format_bytes(summary["host_pool_bytes"])
        if summary["device"].startswith("cpu"):  # one memory: the parked chunks add to the measured peak
            rows.insert(4, ("parked chunks", f"{parked} (on a CPU run offload parks them in the same memory as the "
                                             "device: the run's peak is up to the measured peak plus this)"))
        else:
            rows.insert(4, ("host memory", f"{parked} in the pinned pool of parked chunks"))
    notes = summary.get("strategy_notes") or {}
    if "memo_alpha" in notes:
        how = ("measured: one layer {:.3g} s, host link {:.3g} GB/s".format(notes["memo_layer_seconds"], notes["memo_host_bandwidth"] / 1e9)
               if notes.get("memo_measured") else "given" if "memo_layer_seconds" not in notes else "modelled")
        rows.append(("memo alpha", f"{notes['memo_alpha']:.3f} of the other activations' tokens swapped ({how})"))
    if "kept_attention_outputs" in notes:
        rows.append(("kept attention", f"the lowest {notes['kept_attention_outputs']} layers keep their attention "
                                       "output (no second attention forward in their backward)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
