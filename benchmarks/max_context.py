"""The longest context the planner finds for Llama-3-8B and Qwen2-7B on one H100 or H200
with 128 GB of host memory: full fine-tuning with AdamW (its state on the device, or in
host memory with fp32 master weights) and LoRA; for the mixtures of experts Qwen3-30B-A3B
and gpt-oss-20b, LoRA and QLoRA — writes docs/results/max_context.{json,md}.

    python benchmarks/max_context.py            # the dense models (a process per model)
    python benchmarks/max_context.py --moe      # the mixtures of experts, merged into the report
    python benchmarks/max_context.py --moe --mode "LoRA r16" --model qwen3-30b-a3b   # some of them
    python benchmarks/max_context.py --dense --mode "full, AdamW (either place)"       # some dense rows, merged
    python benchmarks/max_context.py --restep   # every stored row's step time again at today's H100 table
    python benchmarks/max_context.py --smoke    # tiny model, seconds (CI)

Each machine × model × mode row is the longest context of any candidate strategy
(:func:`longtrain.plan.longest.max_context`: a search over whole-length simulations per
candidate — FPDT exact to the chunk, the others to within 1/64 — that reports a length
that fits and names what binds just beyond it), the strategy that reaches it, and the
predicted step time at that length with the H100 rates. The anchors quoted beside are
their authors' figures on their hardware, not reruns.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import DOCS, write_report  # noqa: E402

from longtrain.memory.units import parse_bytes  # noqa: E402
from longtrain.plan.longest import max_context  # noqa: E402

MACHINES = {"1×H100 80 GB + 128 GB host": ("80GiB", "128GB"), "1×H200 141 GB + 128 GB host": ("139GiB", "128GB")}
MODES = {
    "full, AdamW (either place)": {"optimizer_offload": None},
    "full, AdamW fp32 masters in host memory": {"optimizer_offload": True},
    "LoRA r16": {"lora_rank": 16},
    "QLoRA r16 (4-bit NF4 base)": {"lora_rank": 16, "four_bit": True},
}
ANCHORS = {
    ("llama3-8b", "1×H100 80 GB + 128 GB host", "full, AdamW (either place)"):
        "ALST: 500K on 1×H100 (DeepSpeed CPU-offloaded optimizer, host memory beyond 128 GB)",
    ("llama3-8b", "1×H200 141 GB + 128 GB host", "full, AdamW (either place)"): "ALST: 1.2M on 1×H200 (large host memory)",
    ("llama3-8b", "1×H100 80 GB + 128 GB host", "LoRA r16"): "Unsloth: 342K (QLoRA, 4-bit weights) on 80 GB",
    ("qwen3-30b-a3b", "1×H100 80 GB + 128 GB host", "LoRA r16"):
        "Unsloth: 500K of gpt-oss-20b (a 21B MoE, 4-bit weights) on 80 GB",
    ("gpt-oss-20b", "1×H100 80 GB + 128 GB host", "QLoRA r16 (4-bit NF4 base)"):
        "Unsloth: 500K+ (QLoRA, 290K without tiled MLP) on 80 GB",
}
DENSE_MODELS = ("llama3-8b", "qwen2-7b")
DENSE_MODES = ("full, AdamW (either place)", "full, AdamW fp32 masters in host memory", "LoRA r16")
COMMAND = ("python benchmarks/max_context.py (the dense models, 2026-11-23; their \"either place\" rows again on "
           "2026-11-30 with AdamW's float32 masters: --dense --mode \"full, AdamW (either place)\"); python "
           "benchmarks/max_context.py --moe (the mixtures of experts, 2026-11-30; 25–50 minutes on 2 cores); "
           "python benchmarks/max_context.py --restep (step times at the H100 table of 2026-11-30)")
# Mixtures of experts: their weights alone take most of an 80 GB GPU in bf16, so LoRA and QLoRA only.
MOE_MODELS = ("qwen3-30b-a3b", "gpt-oss-20b")
MOE_MODES = ("LoRA r16", "QLoRA r16 (4-bit NF4 base)")


def rows_of(model: str, smoke: bool, machines: dict | None = None, modes: dict | None = None) -> list[dict]:
    """Every machine × mode row of one model (one process: its simulations are shared)."""
    machines = {"tiny": ("4MiB", "4MiB")} if smoke else machines or MACHINES
    modes = ({"full, AdamW on the device": {"optimizer_offload": False}} if smoke
             else modes or {m: MODES[m] for m in DENSE_MODES})
    rows = []
    for machine, (device, host) in machines.items():
        for mode, options in modes.items():
            print(f"{model}, {machine}, {mode} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                limits = max_context(model, device_memory=parse_bytes(device), host_memory=parse_bytes(host),
                                     chunks=(256,) if smoke else (8192,), **options)
            except Exception as exc:  # noqa: BLE001 - a mode this build cannot plan is reported, not fatal
                rows.append({"model": model, "machine": machine, "mode": mode, "tokens": None, "strategy": None,
                             "binds": f"not planned: {exc}", "step_s": None, "anchor": ANCHORS.get((model, machine, mode))})
                continue
            best = limits[0]
            shown = {id(limit): limit.name + (" --optimizer-offload" if limit.optimizer_offload else "") for limit in limits}
            print(f"{model}, {machine}, {mode}: {best.tokens:,} tokens ({shown[id(best)]}; {best.binds}) "
                  f"in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            rows.append({"model": model, "machine": machine, "mode": mode, "tokens": f"{best.tokens:,}",
                         "strategy": shown[id(best)], "binds": f"{best.binds} beyond it", "step_s": best.step_seconds,
                         "anchor": ANCHORS.get((model, machine, mode)),
                         "others": {shown[id(limit)]: limit.tokens for limit in limits[1:]}})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None, help="directory for the report (default docs/results/)")
    parser.add_argument("--moe", action="store_true",
                        help="only the mixture-of-experts rows (qwen3-30b-a3b and gpt-oss-20b, LoRA and QLoRA, both "
                             "machines), merged into the report")
    parser.add_argument("--dense", action="store_true",
                        help="only the dense models' rows (llama3-8b and qwen2-7b), merged into the report")
    parser.add_argument("--mode", action="append", choices=list(MODES),
                        help="with --moe or --dense: only this training mode's rows (repeatable; default: every one)")
    parser.add_argument("--model", action="append", choices=DENSE_MODELS + MOE_MODELS,
                        help="with --moe or --dense: only this model's rows (repeatable; default: every one)")
    parser.add_argument("--machine", action="append", choices=list(MACHINES),
                        help="with --moe or --dense: only this machine's rows (repeatable; default: every one)")
    parser.add_argument("--restep", action="store_true",
                        help="recompute every stored row's predicted step time at the built-in H100 table")
    args = parser.parse_args(argv)
    if args.restep:
        write(_restepped(_merged([], args.out)), False, args.out, command=COMMAND)
        return
    if args.moe or args.dense:
        machines = {m: MACHINES[m] for m in args.machine} if args.machine else None
        models, modes = (MOE_MODELS, MOE_MODES) if args.moe else (DENSE_MODELS, DENSE_MODES)
        rows = _each_model(list(args.model or models), False, {m: MODES[m] for m in args.mode or modes}, machines)
        write(_merged(rows, args.out), False, args.out, command=COMMAND)
        return
    models = ["tiny-llama"] if args.smoke else list(DENSE_MODELS)
    write(_each_model(models, args.smoke), args.smoke, args.out)


def _each_model(models: list[str], smoke: bool, modes: dict | None = None, machines: dict | None = None) -> list[dict]:
    """:func:`rows_of` each model, a process per model (at most one per core) where there are several."""
    if len(models) == 1:
        return rows_of(models[0], smoke, machines, modes)
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(min(len(models), os.cpu_count() or 1),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        return [row for rows in pool.map(rows_of, models, [smoke] * len(models), [machines] * len(models),
                                         [modes] * len(models)) for row in rows]


def _restepped(rows: list[dict]) -> list[dict]:
    """``rows`` with each predicted step time computed again by the time model at the
    built-in H100 table (the strategy as its row names it, AdamW's place as it says)."""
    import torch

    import longtrain as lt
    from longtrain.models.presets import preset_config
    from longtrain.plan.bounds import _state_bytes
    from longtrain.plan.time_model import H100, step_time

    for row in rows:
        if not row.get("strategy"):
            continue
        label = row["strategy"].split(" --optimizer-offload")[0].split(" · ")[0]
        offloaded = "--optimizer-offload" in row["strategy"] or "optimizer in host memory" in row["strategy"]
        config = preset_config(row["model"])
        params = _state_bytes(config, "none", torch.bfloat16)[0]
        tokens = int(row["tokens"].replace(",", ""))
        row["step_s"] = step_time(config, tokens, lt.Strategy.parse(label), H100, optimizer_offload=offloaded,
                                  trainable=params).seconds
    return rows


def _merged(rows: list[dict], out: str | None) -> list[dict]:
    """``rows`` in place of the report's rows of the same model, machine and mode."""
    import json

    path = Path(out or DOCS) / "max_context.json"
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    keys = {(r["model"], r["machine"], r["mode"]) for r in rows}
    return [r for r in old if (r["model"], r["machine"], r["mode"]) not in keys] + rows


def write(rows: list[dict], smoke: bool = False, out: str | None = None, command: str | None = None) -> None:
    """The report of ``rows`` (also to re-render docs/results/max_context.json after a change that
    moves only the predicted step times, e.g. refitted machine rates)."""
    columns = [("model", "model"), ("machine", "machine"), ("mode", "training"), ("tokens", "longest context"),
               ("strategy", "strategy"), ("binds", "binds there"), ("step_s", "predicted s/step (H100 rates)"),
               ("anchor", "anchors (their figures)")]
    notes = """Simulated, not measured: the longest context of any candidate strategy of `longtrain plan`
(FPDT at 8K-token chunks with checkpoint segments, with and without offload; checkpointing + MsT;
Memo + MsT; under LoRA, each also with `stream` — the frozen layer weights in host memory, a layer
at a time on the device — where those weights fill a quarter of the device or more), found by a search over whole-length simulations on fake tensors (plan/longest.py: FPDTOptions
exact to the chunk, the others within 1/64), the device side with the allocator's fragmentation margin
measured on the H100; host memory 128 GB = 119.2 GiB; the H200's usable memory taken as 139 GiB).
"Either place" weighs AdamW on the device (fp32 masters and moments, 12 bytes per parameter, as
`--optimizer adamw` trains) against AdamW in host memory (fp32 masters and moments) and reports the longer; QLoRA is LoRA over a base held in 4 bits as bitsandbytes'
NF4 holds it (`plan --lora --4bit`); `others` in the JSON lists every candidate's limit. Step times from the time model at the H100 table
(refitted on 2026-11-30 to every H100 step measured at 16K-128K; not checked on a GPU at these lengths). Confirm a row with `longtrain plan --model M --seq-len N
--device-memory D --host-memory H [--optimizer-offload | --lora]`."""
    write_report("max_context_smoke" if smoke else "max_context", "Longest context per machine (planner)", columns,
                 rows, notes, command or "python benchmarks/max_context.py" + (" --smoke" if smoke else ""), out_dir=out)


if __name__ == "__main__":
    main()
