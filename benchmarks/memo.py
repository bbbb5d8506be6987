"""Memo on Llama-3-8B: device and host peaks against checkpointing and chunked attention +
offload, a step-time model, and the memory planner on recorded traces.

Memory and time (``--only memory``): ``longtrain plan`` for Llama-3-8B, bf16 weights,
gradients and AdamW moments, one sequence of 32K–256K tokens, one 80 GiB GPU and 120 GiB of
host memory — every candidate strategy: layer checkpointing + MsT; Memo + MsT (α by Memo's
rule within the 120 GiB budget, its layer time from FLOPs at 600 TFLOP/s and a 25 GB/s host
link, since nothing is timed under fake tensors); FPDT with host offload at 8K–32K-token chunks,
with and without kept attention outputs. Device and host peaks are simulated on fake tensors
(FPDT's extended from two and four chunks), the optimizer state added exactly, and the device
figure multiplied by the allocator's fragmentation margin measured on the H100 (1.43 with
offload, 1.06 without) to decide what fits.

Step time is predicted, not measured, by longtrain's time model
(``longtrain.plan.time_model``, rates from the H100 run: within 15% of each of its longtrain
rows): matmuls, fused or block attention and what each strategy recomputes — checkpoint the
layer forward and, under MsT, the MLP forward a third time; fpdt the same plus attention's
forward a second time (not with ``keep_output``); memo the (1 − α) share of the token-wise
forward, never attention — plus the known slow spots (MsT's tiled MLP backward, the chunked
head's weight gradient) and copies to host a layer's compute cannot hide. MFU = model FLOPs
(6·s·P + 6·n·w·s²) / (time × 989 TFLOP/s).

Planner (``--only planner``): device allocation traces of one training step recorded by the
tracker — a Llama layer (exact, CPU) and the whole of Llama-3-8B at 4K (simulated) — planned
by CP-SAT (two levels for the whole model), by greedy best-fit, and by online first-fit (an
allocator without the plan), each plan checked overlap-free.

    python benchmarks/memo.py [--only memory|planner]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import torch  # noqa: E402
from _report import write_report  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import longtrain as lt  # noqa: E402
from longtrain.memory import placement as P  # noqa: E402
from longtrain.memory.tracker import MemoryTracker  # noqa: E402
from longtrain.models.loading import build_from_config, default_dtype  # noqa: E402
from longtrain.models.presets import preset_config  # noqa: E402
from longtrain.plan.planner import PlanRequest, plan  # noqa: E402

GIB = 2**30
LENGTHS = (32768, 65536, 131072, 262144)


def memory() -> None:
    rows = []
    for tokens in LENGTHS:
        started = time.perf_counter()
        result = plan(PlanRequest("llama3-8b", tokens, device_memory=80 * GIB, host_memory=120 * GIB, optimizer="adamw"),
                      progress=lambda line: print(line, flush=True))
        for row in result.rows:
            rows.append({"tokens": tokens, "strategy": row.name + (" --optimizer-offload" if row.optimizer_offload else ""),
                         "device_gib": row.device_bytes / GIB if row.device_bytes else None,
                         "reserved_gib": row.reserved_bytes / GIB if row.reserved_bytes else None,
                         "host_gib": row.host_bytes / GIB if row.host_bytes is not None else None,
                         "alpha": row.notes.get("memo_alpha"), "fits": "yes" if row.fits else "no",
                         "step_s": row.step_seconds, "tokens_per_s": row.tokens_per_s, "mfu": row.mfu})
            print(rows[-1], flush=True)
        print(f"{tokens}: planned in {time.perf_counter() - started:.0f} s", flush=True)
    write_report(
        "memo_llama3_8b", "Memo against checkpointing and FPDT + offload: Llama-3-8B on one 80 GiB GPU + 120 GiB host (planned)",
        [("tokens", "tokens"), ("strategy", "strategy"), ("device_gib", "device GiB"), ("reserved_gib", "× margin GiB"),
         ("host_gib", "host GiB"), ("alpha", "α"), ("fits", "fits 80/120"), ("step_s", "predicted step s"),
         ("tokens_per_s", "predicted tokens/s"), ("mfu", "predicted MFU")],
        rows, notes="\n\n".join(__doc__.split("\n\n")[1:3]), command="python benchmarks/memo.py --only memory")


def _trace(config, tokens: int, strategy, fake: bool) -> list[P.Block]:
    with contextlib.ExitStack() as stack:
        if fake:
            stack.enter_context(FakeTensorMode())
        dtype = torch.bfloat16 if fake else torch.float32
        stack.enter_context(default_dtype(dtype))
        model = build_from_config(config, dtype)
        lt.apply(model, strategy)
        batch = {"input_ids": torch.randint(0, 256, (1, tokens))}
        with MemoryTracker(model) as tracker:
            lt.step(model, batch, num_label_tokens=tokens - 1)  # the first step allocates the gradients
            model.zero_grad(set_to_none=True)
            tracker.reset_peak()
            lt.step(model, batch, num_label_tokens=tokens - 1)
            return tracker.trace()


def planner() -> None:
    cases = [
        ("Llama layer, 1K tokens, fp32 (exact)", preset_config("demo", num_hidden_layers=1), 1024, lt.Strategy(), False),
        ("Llama layer + memo α=0.5, 1K (exact)", preset_config("demo", num_hidden_layers=1), 1024,
         lt.Strategy(memo=lt.MemoOptions(alpha=0.5, keep_last=0)), False),
        ("Llama-3-8B, 4K, checkpoint (simulated)", preset_config("llama3-8b"), 4096, lt.Strategy(checkpoint=True), True),
        ("Llama-3-8B, 4K, memo+mst (simulated)", preset_config("llama3-8b"), 4096,
         lt.Strategy(memo=lt.MemoOptions(alpha=0.5), mst=True), True),
    ]
    rows = []
    for name, config, tokens, strategy, fake in cases:
        blocks = _trace(config, tokens, strategy, fake)
        best, greedy = P.plan_memory(blocks)
        online = P.first_fit_online(blocks)
        for placed in (best, greedy, online):
            P.check_plan(blocks, placed)
        live = P.live_peak(blocks)
        rows.append({"trace": name, "tensors": len(blocks), "live_mib": live / 2**20,
                     "planned": 100 * (best.peak / live - 1), "method": best.method, "solve_s": best.seconds,
                     "greedy": 100 * (greedy.peak / live - 1), "online": 100 * (online.peak / live - 1)})
        print(rows[-1], flush=True)
    write_report(
        "memo_planner", "Memory planning on recorded step traces: planned, greedy and online peaks over the bytes alive at once",
        [("trace", "trace"), ("tensors", "tensors"), ("live_mib", "most alive at once (MiB)"),
         ("planned", "planned: % over"), ("method", "plan"), ("solve_s", "solve s"), ("greedy", "greedy: % over"),
         ("online", "online first-fit: % over")],
        rows, notes=__doc__.split("\n\n")[3], command="python benchmarks/memo.py --only planner")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["memory", "planner"])
    args = parser.parse_args()
    if args.only in (None, "planner"):
        planner()
    if args.only in (None, "memory"):
        memory()
