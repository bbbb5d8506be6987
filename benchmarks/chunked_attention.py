"""Chunked attention with host offload (FPDT on one device): memory and time.

1. Device and host peak vs sequence length, exact CPU measurement on a 4-layer Llama at
   reduced width: checkpointing + MsT against chunked attention + MsT with nothing,
   K/V only, or K/V and layer inputs offloaded.
2. The same at Llama-3-8B scale, simulated (bf16 weights and gradients on the device,
   optimizer state in host memory): device and host bytes per token, and the longest
   context that fits one 80 GiB device with 120 GiB of host memory (the planner's search).
3. A chunk-size sweep at a fixed length: step time against device peak (CPU).

GPU step times are benchmarks/gpu_peers.py's. Writes
docs/results/chunked_attention_{memory,llama3_8b,chunk_sweep}.{json,md} and
docs/results/chunked_attention_memory.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from _report import DOCS, median_step_times, plot_series, write_report
from transformers import LlamaConfig

import longtrain as lt
from longtrain.models.loading import build_from_config, load_config
from longtrain.plan.simulate import run_training_steps, simulate

MiB, GiB = 2**20, 2**30
SMALL = dict(vocab_size=8192, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)  # Llama-3's ratios at width 256


def _fpdt(mst, **options) -> lt.Strategy:
    return lt.Strategy(engine="fpdt", engine_options=options, mst=mst)


def _strategies(chunk: int) -> dict[str, lt.Strategy]:
    mst = lt.MsTOptions()
    return {
        "checkpoint+mst": lt.Strategy(checkpoint=True, mst=mst),
        "chunked": _fpdt(mst, chunk=chunk),
        "chunked, K/V offloaded": _fpdt(mst, chunk=chunk, offload=True, offload_inputs=False),
        "chunked, all offloaded": _fpdt(mst, chunk=chunk, offload=True),
    }


def _small_model(seq_len):
    return build_from_config(LlamaConfig(**SMALL, max_position_embeddings=seq_len), torch.float32)


def cpu_memory(lengths=(2048, 4096, 8192, 16384), chunk=1024) -> list[dict]:
    rows = []
    for name, strategy in _strategies(chunk).items():
        for n in lengths:
            report, _ = run_training_steps(lambda: _small_model(n), seq_len=n, strategy=strategy,
                                           optimizer="none", iterations=1, fake=False)
            rows.append({"strategy": name, "tokens": n, "device_peak_mib": report.peak_device_bytes / MiB,
                         "host_peak_mib": report.peak_host_bytes / MiB})
            print(rows[-1], flush=True)
    return rows


def llama3_8b(lengths=(8192, 16384, 32768), chunk=4096, device_budget=80 * GiB, host_budget=120 * GiB) -> list[dict]:
    """Simulated peaks at three lengths with two accumulated micro-batches (so the
    gradients are alive while the second one's forward parks its chunks — the steady
    state of real training), bytes per token from the 16K→32K slope; and the longest
    context both budgets allow, searched (:func:`_longest`).
    """
    config = load_config("llama3-8b")
    peaks = {}
    for name, strategy in _strategies(chunk).items():
        for n in lengths:
            t0 = time.perf_counter()
            report = simulate(config, n, strategy=strategy, optimizer="none", dtype="bfloat16", grad_accum=2)
            peaks[name, n] = (report.peak.peak_device_bytes, report.peak.peak_host_bytes)
            print(name, n, [p / GiB for p in peaks[name, n]], f"{time.perf_counter() - t0:.0f}s", flush=True)
    a, b = lengths[-2], lengths[-1]

    def slope(name, where):
        return (peaks[name, b][where] - peaks[name, a][where]) / (b - a)

    rows = []
    longest = _longest(config, chunk, device_budget, host_budget)
    for name in _strategies(chunk):
        rows.append({
            "strategy": name, **{f"device_gib_{n // 1024}k": peaks[name, n][0] / GiB for n in lengths},
            "host_gib_32k": peaks[name, b][1] / GiB,
            "device_bytes_per_token": round(slope(name, 0)), "host_bytes_per_token": round(slope(name, 1)),
            "longest_tokens": longest[name][0], "limited_by": longest[name][1],
        })
    return rows


def _longest(config, chunk, device_budget, host_budget) -> dict[str, tuple[int, str]]:
    """The longest context of each strategy as the product trains it, with AdamW's state
    on the device or (``--optimizer-offload``, fp32 state and masters) in host memory,
    whichever reaches further, with the planner's allocator margins: its search over
    whole-length simulations (plan/longest.py). A line through two short lengths, as this
    benchmark extended before, overestimates where the peak moves from one place of the
    step to another as the length grows."""
    from longtrain.plan.longest import LIMIT, longest_context
    from longtrain.plan.planner import budgets_for

    config = copy.deepcopy(config)
    config.max_position_embeddings = max(config.max_position_embeddings, LIMIT)
    _, budgets = budgets_for(config, device_memory=device_budget, host_memory=host_budget, optimizer="adamw",
                             dtype=torch.bfloat16)
    result = {}
    for name, strategy in _strategies(chunk).items():
        t0 = time.perf_counter()
        for budget in budgets:
            tokens, binds = longest_context(config, strategy, budget, "bfloat16", label=name,
                                            progress=lambda line: print(f"  {line}", flush=True))
            place = "AdamW in host memory" if budget.optimizer == "adamw-offload" else "AdamW on the device"
            if name not in result or tokens > result[name][0]:
                result[name] = (tokens, f"{binds} ({place})")
        print(name, result[name], f"{time.perf_counter() - t0:.0f}s", flush=True)
    return result


def chunk_sweep(seq_len=8192, chunks=(256, 512, 1024, 2048, 4096, 8192), repeats=3) -> list[dict]:
    """Step time and device peak per chunk size, all alternated in one run; times are
    ratios to checkpointing + MsT (whole-sequence attention)."""
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, SMALL["vocab_size"], (1, seq_len))}
    cases = {"checkpoint+mst": lt.Strategy(checkpoint=True, mst=lt.MsTOptions())}
    for c in chunks:
        for offload in (False, True):
            cases[(c, offload)] = _fpdt(lt.MsTOptions(), chunk=c, offload=offload)
    models = {}
    for key, strategy in cases.items():
        torch.manual_seed(0)
        models[key] = lt.apply(_small_model(seq_len), strategy)
    medians = median_step_times(models, batch, repeats)
    base = medians["checkpoint+mst"]
    rows = []
    for key, strategy in cases.items():
        report, _ = run_training_steps(lambda: _small_model(seq_len), seq_len=seq_len, strategy=strategy,
                                       optimizer="none", iterations=1, fake=False)
        chunk, offload = ("whole sequence", False) if key == "checkpoint+mst" else key
        rows.append({"chunk": chunk, "offload": offload, "time_ratio": medians[key] / base,
                     "device_peak_mib": report.peak_device_bytes / MiB, "host_peak_mib": report.peak_host_bytes / MiB})
        print(rows[-1], flush=True)
    return rows


def plot(cpu_rows, sweep_rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    plot_series(axes[0], cpu_rows, "strategy", "tokens", "device_peak_mib")
    axes[0].set(xscale="log", xlabel="tokens", ylabel="device peak (MiB)", title="Device peak vs length (4-layer Llama, d=256, CPU exact)")
    axes[0].legend(fontsize=8)
    for offload in (False, True):
        rows = [r for r in sweep_rows if r["offload"] == offload and r["chunk"] != "whole sequence"]
        axes[1].plot([r["device_peak_mib"] for r in rows], [r["time_ratio"] for r in rows], marker="o",
                     label="offloaded" if offload else "on device")
        for r in rows:
            axes[1].annotate(str(r["chunk"]), (r["device_peak_mib"], r["time_ratio"]), fontsize=7)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set(xlabel="device peak (MiB)", ylabel="step time / checkpoint+MsT", title="Chunk size: time vs memory (8K tokens, CPU)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "chunked_attention_memory.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["cpu", "llama3-8b", "sweep", "plot"],
                        help="run one part (plot: redraw the PNG from the JSON files under docs/results/)")
    args = parser.parse_args()
    cmd = "python benchmarks/chunked_attention.py" + (f" --only {args.only}" if args.only else "")
    parts = [args.only] if args.only else ["cpu", "llama3-8b", "sweep"]  # GPU timings: benchmarks/gpu_peers.py
    cpu_rows = sweep_rows = None
    if "cpu" in parts:
        cpu_rows = cpu_memory()
        write_report(
            "chunked_attention_memory", "Chunked attention: device and host peak vs length (exact CPU measurement)",
            [("strategy", "strategy"), ("tokens", "tokens"), ("device_peak_mib", "device peak MiB"), ("host_peak_mib", "host peak MiB")],
            cpu_rows,
            notes="One forward + backward of a 4-layer Llama (d=256, I=896, V=8192, GQA 4/2 heads, float32, no optimizer), "
                  "every live tensor storage counted (device = what a GPU would hold; host = parked chunks). "
                  "Chunked attention runs 1,024-token chunks with MsT inside; `checkpoint+mst` is whole-sequence attention.",
            command=cmd)
    if "llama3-8b" in parts:
        rows = llama3_8b()
        write_report(
            "chunked_attention_llama3_8b", "Chunked attention at Llama-3-8B scale (simulated, one 80 GiB device + 120 GiB host)",
            [("strategy", "strategy"), ("device_gib_8k", "device GiB 8K"), ("device_gib_16k", "16K"), ("device_gib_32k", "32K"),
             ("host_gib_32k", "host GiB 32K"), ("device_bytes_per_token", "device B/token"), ("host_bytes_per_token", "host B/token"),
             ("longest_tokens", "longest context"), ("limited_by", "limited by")],
            rows,
            notes="Peak columns: bf16 weights and gradients on the device, no optimizer state; batch 1 with two accumulated "
                  "micro-batches (the gradients are alive while the second forward runs, as in real training); chunk 4,096 "
                  "with MsT and `recompute_kv`. Peaks are simulated (fake "
                  "tensors, same tracker as the exact CPU measurement) at 8K/16K/32K; bytes per token are the 16K→32K slopes. "
                  "The longest context is the planner's search (plan/longest.py: whole-length simulations, the length found "
                  "fits and one chunk or 1/64 more does not, with the planner's allocator margins) for training as the product "
                  "does it, one micro-batch, AdamW's state on the device (bf16 moments) or with `--optimizer-offload` in host "
                  "memory (fp32 state and masters), whichever reaches further; limited by: what binds one step beyond.",
            command=cmd)
    if "sweep" in parts:
        sweep_rows = chunk_sweep()
        write_report(
            "chunked_attention_chunk_sweep", "Chunked attention: chunk size, time vs memory (CPU, 8K tokens)",
            [("chunk", "chunk"), ("offload", "offload"), ("time_ratio", "time / checkpoint+MsT"), ("device_peak_mib", "device peak MiB"),
             ("host_peak_mib", "host peak MiB")],
            sweep_rows,
            notes="4-layer Llama (d=256) at 8,192 tokens on 2 CPU cores, every case alternated in one run (median of 3 after a "
                  "warm-up), time as a ratio to checkpointing + MsT. On CPU the store copies synchronously, so the offload "
                  "column shows the full copy cost; on a GPU the copies run on side streams under the compute.",
            command=cmd)
    if "plot" in parts:
        cpu_rows = json.loads((DOCS / "chunked_attention_memory.json").read_text())["rows"]
        sweep_rows = json.loads((DOCS / "chunked_attention_chunk_sweep.json").read_text())["rows"]
    if cpu_rows and sweep_rows:
        plot(cpu_rows, sweep_rows)

if __name__ == "__main__":
    main()
