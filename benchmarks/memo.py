"""Memo on Llama-3-8B: device and host peaks against checkpointing and chunked attention +
offload, a step-time model, and the memory planner on recorded traces.

Memory (``--only memory``): Llama-3-8B, bf16 weights, gradients and AdamW moments, one
sequence of 32K–256K tokens, simulated on fake tensors (the simulator equals an exact CPU
measurement for memo too: tests/test_memo.py). Strategies: ``checkpoint+mst`` (layer
checkpointing, mini-sequence MLP and head), ``fpdt+offload+mst`` (chunked attention, 16K-token
chunks, K/V and layer inputs in host memory), ``memo+mst`` (α by Memo's rule with a
120 GiB host budget; the layer time from FLOPs at 400 TFLOP/s and a 25 GB/s host link,
since nothing is timed under fake tensors).

Step time is a *model*, not a measurement (no GPU was lent): every FLOP at 400 TFLOP/s
(45% of the H100's bf16 peak, what HF + Liger sustained in our H100 run), plus what each
strategy recomputes — checkpoint: the layer forward again and, under MsT, the MLP forward a
third time; fpdt: the same plus attention's forward a second time; memo: the MLP forward
again (MsT's tiled backward) and the (1 − α) share of the other token-wise forward work,
never attention — plus copies to host that one layer's compute cannot hide. MFU = model
FLOPs (6·s·P + 6·n·w·s²) / (time × 989 TFLOP/s).

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
from _report import write_report  # noqa: E402

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import longtrain as lt  # noqa: E402
from longtrain.memory import plan as P  # noqa: E402
from longtrain.memory.flops import attention_width, causal_lm_flops  # noqa: E402
from longtrain.memory.tracker import MemoryTracker  # noqa: E402
from longtrain.models.loading import build_from_config, default_dtype  # noqa: E402
from longtrain.models.presets import preset_config  # noqa: E402
from longtrain.techniques.memo import DEFAULT_FLOPS_PER_S, DEFAULT_HOST_BANDWIDTH  # noqa: E402

GIB = 2**30
PEAK = 989e12
LENGTHS = (32768, 65536, 131072, 262144)
STRATEGIES = {
    "checkpoint+mst": lambda: lt.Strategy(checkpoint=True, mst=True),
    "fpdt+offload+mst": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 16384, "offload": True}, mst=True),
    "memo+mst": lambda: lt.Strategy(memo=lt.Memo(host_memory="120GiB"), mst=True),
}


def _step_seconds(name: str, config, tokens: int, notes: dict) -> tuple[float, float]:
    """(modelled step seconds, model FLOPs) of one sequence (module docstring)."""
    n, d, width = config.num_hidden_layers, config.hidden_size, attention_width(config)
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    attn_params = 2 * d * width + 2 * d * kv
    mlp_params = 3 * d * config.intermediate_size
    params = n * (attn_params + mlp_params) + config.vocab_size * d
    model = causal_lm_flops(tokens, params, n, width)
    layer_forward = n * 2 * tokens * (attn_params + mlp_params)
    attention_forward = n * 2 * width * tokens**2
    mlp_forward = n * 2 * tokens * mlp_params
    exposed = 0.0
    if name == "checkpoint+mst":
        extra = layer_forward + attention_forward + mlp_forward
    elif name == "fpdt+offload+mst":
        extra = layer_forward + 2 * attention_forward + mlp_forward
    else:
        alpha = notes["memo_alpha"]
        extra = mlp_forward + (1 - alpha) * n * 2 * tokens * attn_params
        moved = notes["memo_input_bytes"] + notes["memo_attention_bytes"] + alpha * notes["memo_other_bytes"]
        exposed = n * max(0.0, moved / DEFAULT_HOST_BANDWIDTH - notes["memo_layer_seconds"])
    return (model + extra) / DEFAULT_FLOPS_PER_S + exposed, model


def memory() -> None:
    config = preset_config("llama3-8b")
    rows = []
    for tokens in LENGTHS:
        for name, make in STRATEGIES.items():
            started = time.perf_counter()
            report = lt.simulate("llama3-8b", tokens, strategy=make(), optimizer="adamw")
            seconds, flops = _step_seconds(name, config, tokens, report.notes)
            rows.append({"tokens": tokens, "strategy": name, "device_gib": report.device_peak_bytes / GIB,
                         "host_gib": report.peak.peak_host_bytes / GIB, "alpha": report.notes.get("memo_alpha"),
                         "step_s": seconds, "tokens_per_s": tokens / seconds, "mfu": flops / (seconds * PEAK),
                         "sim_s": time.perf_counter() - started})
            print(rows[-1], flush=True)
    write_report(
        "memo_llama3_8b", "Memo against checkpointing and chunked attention + offload: Llama-3-8B, one sequence (simulated)",
        [("tokens", "tokens"), ("strategy", "strategy"), ("device_gib", "device GiB"), ("host_gib", "host GiB"),
         ("alpha", "α"), ("step_s", "modelled step s"), ("tokens_per_s", "modelled tokens/s"), ("mfu", "modelled MFU"),
         ("sim_s", "simulation s")],
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
         lt.Strategy(memo=lt.Memo(alpha=0.5, keep_last=0)), False),
        ("Llama-3-8B, 4K, checkpoint (simulated)", preset_config("llama3-8b"), 4096, lt.Strategy(checkpoint=True), True),
        ("Llama-3-8B, 4K, memo+mst (simulated)", preset_config("llama3-8b"), 4096,
         lt.Strategy(memo=lt.Memo(alpha=0.5), mst=True), True),
    ]
    rows = []
    for name, config, tokens, strategy, fake in cases:
        blocks = _trace(config, tokens, strategy, fake)
        best, greedy = P.plan_memory(blocks)
        online = P.first_fit_online(blocks)
        for plan in (best, greedy, online):
            P.check_plan(blocks, plan)
        live = P.live_peak(blocks)
        rows.append({"trace": name, "tensors": len(blocks), "live_mib": live / 2**20, "planned": best.peak / live,
                     "method": best.method, "solve_s": best.seconds, "greedy": greedy.peak / live,
                     "online": online.peak / live})
        print(rows[-1], flush=True)
    write_report(
        "memo_planner", "Memory planning on recorded step traces: planned, greedy and online peaks over the bytes alive at once",
        [("trace", "trace"), ("tensors", "tensors"), ("live_mib", "most alive at once (MiB)"), ("planned", "planned ×"),
         ("method", "plan"), ("solve_s", "solve s"), ("greedy", "greedy ×"), ("online", "online first-fit ×")],
        rows, notes=__doc__.split("\n\n")[3], command="python benchmarks/memo.py --only planner")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["memory", "planner"])
    args = parser.parse_args()
    if args.only in (None, "planner"):
        planner()
    if args.only in (None, "memory"):
        memory()
