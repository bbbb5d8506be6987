"""SeCO and SpaCO: memory, time and training.

1. Device peak vs sequence length, SeCO against checkpointing: exact CPU measurement on
   a 4-layer Llama at reduced width, and simulated at Llama-3-8B scale.
2. Step time vs length for plain backprop, checkpointing, SeCO and SpaCO with t = 8, 16,
   32: measured side by side on CPU, and at Llama-3-8B scale as the FLOPs each engine
   actually executes (counted on fake tensors; a time model for compute-bound GPUs).
3. SpaCO's bias with the paper's cap (2) and without, exactly: the expectation over all
   chunk selections of a small case, against SeCO's gradient.
4. Training on the built-in pass-key task: SpaCO vs SeCO over the same steps.

Writes docs/results/seco_{memory,time,llama3_8b,bias,training}.{json,md} and docs/results/seco.png.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _report import DOCS, median_step_times, plot_series, write_report
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig

import longtrain as lt
from longtrain.models.flops import count_flops
from longtrain.models.loading import build_from_config, default_dtype, load_config
from longtrain.plan.simulate import run_training_steps, simulate

MiB, GiB = 2**20, 2**30
SMALL = dict(vocab_size=8192, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)


def _small_model(seq_len):
    return build_from_config(LlamaConfig(**SMALL, max_position_embeddings=seq_len), torch.float32)


def _engines(seco_chunk: int, spaco_chunk: int, budgets=(8, 16, 32)) -> dict[str, lt.Strategy]:
    cases = {
        "backprop": lt.Strategy(),
        "checkpoint": lt.Strategy(checkpoint=True),
        "seco": lt.Strategy(engine="seco", engine_options={"chunk": seco_chunk}),
    }
    for t in budgets:
        cases[f"spaco t={t}"] = lt.Strategy(engine="spaco", engine_options={"chunk": spaco_chunk, "budget": t})
    return cases


def cpu_memory(lengths=(2048, 4096, 8192, 16384)) -> list[dict]:
    rows = []
    cases = {"checkpoint": lt.Strategy(checkpoint=True), "seco (chunk 512)": lt.Strategy(engine="seco", engine_options={"chunk": 512}),
             "seco, K/V offloaded": lt.Strategy(engine="seco", engine_options={"chunk": 512, "offload": True})}
    for name, strategy in cases.items():
        for n in lengths:
            report, _ = run_training_steps(lambda: _small_model(n), seq_len=n, strategy=strategy, optimizer="none",
                                           iterations=1, fake=False)
            rows.append({"engine": name, "tokens": n, "device_peak_mib": report.peak_device_bytes / MiB,
                         "host_peak_mib": report.peak_host_bytes / MiB})
            print(rows[-1], flush=True)
    return rows


def cpu_time(lengths=(4096, 8192, 16384), repeats=2) -> list[dict]:
    """All engines alternated in one run per length; ratios to plain backprop."""
    rows = []
    for n in lengths:
        cases = _engines(seco_chunk=1024, spaco_chunk=256)
        batch = {"input_ids": torch.randint(0, SMALL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(0))}
        models = {}
        for name, strategy in cases.items():
            torch.manual_seed(0)
            models[name] = lt.apply(_small_model(n), strategy)
        medians = median_step_times(models, batch, repeats)
        for name in cases:
            rows.append({"engine": name, "tokens": n, "ratio_to_backprop": medians[name] / medians["backprop"]})
            print(rows[-1], flush=True)
    return rows


def _fake_flops(config, seq_len, strategy, step=None) -> int:
    step = step or (lambda model, batch, **kw: lt.step(model, batch, strategy, **kw))
    with contextlib.ExitStack() as stack:
        stack.enter_context(FakeTensorMode())
        stack.enter_context(default_dtype(torch.bfloat16))
        model = lt.apply(build_from_config(config, torch.bfloat16), strategy)
        ids = torch.randint(0, config.vocab_size, (1, seq_len))
        flops, _ = count_flops(step, model, {"input_ids": ids}, num_label_tokens=seq_len - 1)
    return flops


def llama3_8b(lengths=(8192, 16384, 32768), flop_lengths=(32768,), flop_chunk=1024, budgets=(8, 16, 32)) -> list[dict]:
    config = load_config("llama3-8b")
    config.max_position_embeddings = max(flop_lengths)
    rows = []
    seco = {"chunk": 4096}
    seco_offload = {"chunk": 4096, "offload": True}
    for name, strategy in {"checkpoint": lt.Strategy(checkpoint=True),
                           "checkpoint+mst": lt.Strategy(checkpoint=True, mst=True),
                           "seco (chunk 4096)": lt.Strategy(engine="seco", engine_options=seco),
                           "seco+checkpoint+mst": lt.Strategy(engine="seco", engine_options=seco, checkpoint=True, mst=True),
                           "seco+checkpoint+mst, K/V offloaded": lt.Strategy(engine="seco", engine_options=seco_offload,
                                                                             checkpoint=True, mst=True)}.items():
        for n in lengths:
            report = simulate(config, n, strategy=strategy, optimizer="none", dtype="bfloat16")
            rows.append({"kind": "memory", "engine": name, "tokens": n, "device_gib": report.peak.peak_device_bytes / GiB,
                         "host_gib": report.peak.peak_host_bytes / GiB, "flops_ratio": None})
            print(rows[-1], flush=True)
    # FLOPs executed, counted on fake tensors. SpaCO's expectation is exact by linearity:
    # each chunk is backpropagated with probability t/k, so E[FLOPs] = forward pass +
    # (t/k) · (SeCO's recomputation and backward), both counted with the same chunks.
    from longtrain.engines.spaco import spaco_step
    from longtrain.strategy import engine_context

    for n in flop_lengths:
        k = n // flop_chunk
        flops = {name: _fake_flops(config, n, strategy) for name, strategy in {
            "backprop": lt.Strategy(), "checkpoint": lt.Strategy(checkpoint=True),
            "seco": lt.Strategy(engine="seco", engine_options={"chunk": flop_chunk})}.items()}
        spaco = lt.Strategy(engine="spaco", engine_options={"chunk": flop_chunk})
        forward_only = _fake_flops(config, n, spaco,
                                   step=lambda m, b, **kw: spaco_step(engine_context(m, spaco), b, selected=set(), **kw))
        flops["forward only (chunked)"] = forward_only
        for t in budgets:
            flops[f"spaco t={t}"] = forward_only + min(1.0, t / k) * (flops["seco"] - forward_only)
        for name, value in flops.items():
            rows.append({"kind": "flops", "engine": name, "tokens": n, "device_gib": None, "host_gib": None,
                         "flops_ratio": value / flops["backprop"]})
            print(rows[-1], flush=True)
    return rows


def _grad_vector(model):
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
                      for p in model.parameters()])


def spaco_bias(k=6, budget=2) -> list[dict]:
    """Exact expectation over all 2^k selections (float64, norms in float64 so that
    combining runs does not add float32 rounding) vs SeCO's gradient."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import llama_norm_in_float64, padded_batch, stock_and_ours

    from longtrain.engines.seco import seco_step
    from longtrain.engines.spaco import spaco_step
    from longtrain.strategy import engine_context

    rows = []
    with llama_norm_in_float64():
        _, model = stock_and_ours("tiny-llama")
        batch = padded_batch(model.config.vocab_size, lengths=(120, 97))
        chunk = -(-120 // k)
        seco_step(engine_context(model, lt.Strategy(engine="seco", engine_options={"chunk": chunk})), batch)
        exact = _grad_vector(model)
        model.zero_grad(set_to_none=True)
        rho = budget / k
        for cap in (None, 2.0):
            mean = torch.zeros_like(exact)
            second = 0.0
            for r in range(k + 1):
                for subset in itertools.combinations(range(k), r):
                    weight = rho**r * (1 - rho) ** (k - r)
                    options = {"chunk": chunk, "budget": budget, "cap": cap}
                    spaco_step(engine_context(model, lt.Strategy(engine="spaco", engine_options=options)), batch,
                               selected=set(subset))
                    g = _grad_vector(model)
                    model.zero_grad(set_to_none=True)
                    mean += weight * g
                    second += weight * float((g - exact).norm() ** 2)
            rows.append({"cap": "off" if cap is None else cap, "k": k, "t": budget, "relay_factor": min(k / budget, cap or k / budget),
                         "bias_rel": float((mean - exact).norm() / exact.norm()),
                         "std_rel": (second - float((mean - exact).norm() ** 2)) ** 0.5 / float(exact.norm())})
            print(rows[-1], flush=True)
    return rows


def training(steps=60, seq_len=2048) -> list[dict]:
    """`longtrain train` on the pass-key task with SeCO and SpaCO, same seed and steps."""
    rows = []
    runs = {"seco": ["--engine", "seco:chunk=256"],
            "spaco t=2": ["--engine", "spaco:chunk=256:budget=2"],
            "spaco t=2, cap 2": ["--engine", "spaco:cap=2:chunk=256:budget=2"]}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in runs.items():
            out = Path(tmp) / name.replace(" ", "_").replace(",", "").replace("=", "")
            cmd = [sys.executable, "-m", "longtrain.cli", "train", "--steps", str(steps), "--seq-len", str(seq_len),
                   "--out", str(out), "--no-progress", "--eval-samples", "4", "--warmup-steps", "5", *extra]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            seconds = time.perf_counter() - t0
            losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
            rows.append({"engine": name, "steps": steps, "first_loss": statistics.mean(losses[:5]),
                         "last_loss": statistics.mean(losses[-5:]), "wall_s": seconds, "curve": losses})
            print({k: v for k, v in rows[-1].items() if k != "curve"}, flush=True)
    return rows


def plot(memory_rows, time_rows, training_rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    plot_series(axes[0], memory_rows, "engine", "tokens", "device_peak_mib")
    axes[0].set(xscale="log", xlabel="tokens", ylabel="device peak (MiB)", title="Device peak (4-layer Llama, CPU exact)")
    plot_series(axes[1], time_rows, "engine", "tokens", "ratio_to_backprop")
    axes[1].set(xscale="log", xlabel="tokens", ylabel="step time / backprop", title="Step time (CPU, one run per length)")
    for row in training_rows:
        axes[2].plot(row["curve"], label=row["engine"])
    axes[2].set(xlabel="step", ylabel="loss", title="Pass-key task, demo model, 2K tokens")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "seco.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["memory", "time", "llama3-8b", "bias", "training", "plot"],
                        help="run one part (plot: redraw the PNG from the JSON files under docs/results/)")
    args = parser.parse_args()
    cmd = "python benchmarks/seco.py" + (f" --only {args.only}" if args.only else "")
    parts = [args.only] if args.only else ["memory", "time", "llama3-8b", "bias", "training"]
    results = {}
    if "memory" in parts:
        results["memory"] = cpu_memory()
        write_report("seco_memory", "SeCO: device peak vs length (exact CPU measurement)",
                     [("engine", "engine"), ("tokens", "tokens"), ("device_peak_mib", "device peak MiB"), ("host_peak_mib", "host peak MiB")],
                     results["memory"],
                     notes="One forward + backward of a 4-layer Llama (d=256, I=896, V=8192, float32, no optimizer), every live "
                           "storage counted. SeCO keeps one chunk's activations; what grows is every layer's K/V (2·n·d_kv per "
                           "token, here 2 KiB/token in float32), which offload moves to host memory.",
                     command=cmd)
    if "time" in parts:
        results["time"] = cpu_time()
        write_report("seco_time", "SeCO and SpaCO: CPU step time vs length (ratios to plain backprop)",
                     [("engine", "engine"), ("tokens", "tokens"), ("ratio_to_backprop", "time / backprop")], results["time"],
                     notes="4-layer Llama (d=256) on 2 CPU cores; all engines alternated in one run per length, median of 2 "
                           "after a warm-up. SeCO chunk 1,024; SpaCO chunk 256 (k = tokens/256 = 16, 32, 64 chunks; t backpropagated on average, all of them when t ≥ k).",
                     command=cmd)
    if "llama3-8b" in parts:
        rows = llama3_8b()
        write_report("seco_llama3_8b", "SeCO at Llama-3-8B scale: simulated memory and executed FLOPs",
                     [("kind", "kind"), ("engine", "engine"), ("tokens", "tokens"), ("device_gib", "device GiB"),
                      ("host_gib", "host GiB"), ("flops_ratio", "FLOPs / backprop")], rows,
                     notes="Memory: simulated steady-state device peak with bf16 weights and gradients and no optimizer state on "
                           "the device (batch 1). Plain SeCO holds a whole 4,096-token chunk's activations through all 32 layers "
                           "(and its full logits); with checkpointing and MsT inside the chunk that falls to one layer's. FLOPs: every FLOP the engine executes in one step (forward, recomputation, "
                           "backward), counted by FlopCounterMode on fake tensors, as a ratio to plain backprop at the same "
                           "length — the time model of a compute-bound GPU. SeCO and SpaCO use 1,024-token chunks here (k = 32); SpaCO's "
                           "rows are its exact expected FLOPs (forward + t/k of SeCO's recomputation and backward, by linearity).",
                     command=cmd)
    if "bias" in parts:
        rows = spaco_bias()
        write_report("seco_bias", "SpaCO: exact bias and spread with and without the cap",
                     [("cap", "cap"), ("k", "k"), ("t", "t"), ("relay_factor", "relay factor"), ("bias_rel", "‖E[g] − ∇‖/‖∇‖"),
                      ("std_rel", "std/‖∇‖")], rows,
                     notes="tiny-llama in float64, batch 2 with padding, 120 tokens in k = 6 chunks, budget t = 2. The expectation "
                           "and the spread are exact: every one of the 2^k selections is run and weighted by its probability.",
                     command=cmd)
    if "training" in parts:
        results["training"] = training()
        write_report("seco_training", "SpaCO vs SeCO training on the pass-key task (CPU)",
                     [("engine", "engine"), ("steps", "steps"), ("first_loss", "loss, first 5"), ("last_loss", "loss, last 5"),
                      ("wall_s", "wall s")], results["training"],
                     notes="`longtrain train` (demo model, 2,048 tokens, 256-token chunks: k = 8) with the same seed and steps; "
                           "SpaCO backpropagates 2 chunks per step on average.",
                     command=cmd)
    if "plot" in parts:
        for part in ("memory", "time", "training"):
            results[part] = json.loads((DOCS / f"seco_{part}.json").read_text())["rows"]
    if {"memory", "time", "training"} <= results.keys():
        plot(results["memory"], results["time"], results["training"])


if __name__ == "__main__":
    main()
