"""Adjoint sharding on SSM-ResNet: memory, time and VJP counts against backprop.

1. ``cpu``: exact CPU measurement (tracked storages) of the peak of one training step
   and its time, vs context length, for two small SSM-ResNets at batch 2: plain
   backprop, layer checkpointing + MsT head (the field's usual memory baseline), the
   exact adjoint engine (default: keeps each layer's input, recomputes A, c, h), the
   adjoint engine keeping the paper's A, C, h, y, and truncated adjoint (T̄ = 64).
   Engines are alternated per length, so the time ratios come from one run.
2. ``count``: adjoint-state terms and token VJPs per layer vs T, read from the engine's
   counters (exact, and truncated with T̄ = 64 and 256).
3. ``ranks``: per-process peak of layer groups under torchrun (1, 2, 4 processes).
4. ``presets``: simulated peak (bf16, AdamW, batch 2, as the paper's Fig. 1) of the
   32M–1.27B presets at 8K and 16K tokens; every engine's peak is linear in T here (no
   attention), so the two points give bytes/token and the longest context on 80 GiB.
5. ``training``: the pass-key task trained with backprop, exact and truncated adjoint.
6. ``plot``: docs/results/adjoint.png from the JSON files.
7. ``gpu`` (not run by default; needs CUDA): allocator peak and step time of backprop,
   checkpoint + MsT and adjoint for ssm-127m at 16K and 64K tokens (not yet measured).
8. ``mamba``: Hugging Face Mamba. Exact CPU peak (tracked storages) and step time of a
   small Mamba under backprop, checkpoint + MsT and the adjoint engine at equal lengths;
   the simulated peak of mamba-130m and mamba-1.4b at two lengths per engine (and with the
   layer inputs parked in host memory), fitted linearly (no attention: every engine's peak
   is linear in T) to the longest context on 80 GiB and drawn to 1M tokens in
   docs/results/adjoint_mamba.png. ``mamba-presets`` runs the simulated part alone, keeping the rows
   docs/results/adjoint_mamba.json has (``--fresh``: all simulated again).

Writes docs/results/adjoint_{cpu,count,presets,ranks,training,mamba}.{json,md}, docs/results/adjoint.png
and docs/results/adjoint_mamba.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _report import DOCS, plot_series, write_report

import longtrain as lt
from longtrain.engines.adjoint import AdjointStats, adjoint_step
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.plan.simulate import run_training_steps, simulate
from longtrain.strategy import engine_context

MiB, GiB = 2**20, 2**30
SIZES = {
    "S (P=N=128, K=4)": dict(vocab_size=4096, hidden_size=128, state_size=128, num_hidden_layers=4),
    "M (P=N=256, K=8)": dict(vocab_size=4096, hidden_size=256, state_size=256, num_hidden_layers=8),
}
PRESETS = ["ssm-32m", "ssm-63m", "ssm-127m", "ssm-225m", "ssm-1.27b"]
BATCH = 2


def _strategies(truncate: int = 64) -> dict[str, lt.Strategy]:
    return {
        "backprop": lt.Strategy(),
        "checkpoint+mst": lt.Strategy(checkpoint=True, mst=True),
        "adjoint": lt.Strategy(engine="adjoint"),
        "adjoint, A/C/h kept": lt.Strategy(engine="adjoint", engine_options={"recompute": False}),
        f"adjoint, T̄={truncate}": lt.Strategy(engine="adjoint", engine_options={"truncate": truncate}),
    }


def _model(size: str):
    return build_from_config(preset_config("tiny-ssm", **SIZES[size]), torch.float32)


def cpu(lengths=(2048, 4096, 8192, 16384), repeats=2) -> list[dict]:
    rows = []
    for size in SIZES:
        for n in lengths:
            strategies = _strategies()
            batch = {"input_ids": torch.randint(0, 4096, (BATCH, n), generator=torch.Generator().manual_seed(0))}
            peaks = {}
            for name, strategy in strategies.items():
                report, _ = run_training_steps(lambda: _model(size), seq_len=n, batch_size=BATCH, strategy=strategy,
                                               optimizer="none", iterations=1, fake=False)
                peaks[name] = report.peak_device_bytes
            models = {}
            for name, strategy in strategies.items():
                torch.manual_seed(0)
                models[name] = lt.apply(_model(size), strategy)
            times = {name: [] for name in strategies}
            for _ in range(repeats + 1):  # alternated; the first round warms up
                for name, strategy in strategies.items():
                    t0 = time.perf_counter()
                    lt.step(models[name], batch, strategy)
                    times[name].append(time.perf_counter() - t0)
                    models[name].zero_grad(set_to_none=True)
            base_time = statistics.median(times["backprop"][1:])
            for name in strategies:
                seconds = statistics.median(times[name][1:])
                rows.append({"model": size, "engine": name, "tokens": n, "peak_mib": peaks[name] / MiB,
                             "peak_vs_backprop": peaks[name] / peaks["backprop"], "seconds": seconds,
                             "time_vs_backprop": seconds / base_time})
                print(rows[-1], flush=True)
    return rows


def count(lengths=(256, 1024, 4096, 16384), windows=(None, 64, 256)) -> list[dict]:
    rows = []
    model = build_from_config(preset_config("tiny-ssm", num_hidden_layers=1))
    for n in lengths:
        ids = torch.randint(0, 320, (1, n), generator=torch.Generator().manual_seed(0))
        exact = None
        for window in windows:  # None (exact) first: the truncated gradients are compared with it
            stats = AdjointStats()
            t0 = time.perf_counter()
            context = engine_context(model, lt.Strategy(engine="adjoint", engine_options={"truncate": window}))
            adjoint_step(context, {"input_ids": ids}, stats=stats)
            seconds = time.perf_counter() - t0
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            exact = exact or grads
            model.zero_grad(set_to_none=True)
            difference = max(float((grads[k] - exact[k]).norm() / exact[k].norm()) for k in exact)
            rows.append({"engine": "adjoint" if window is None else f"adjoint, T̄={window}", "tokens": n,
                         "adjoint_terms": stats.adjoint_terms, "terms_per_token": stats.adjoint_terms / n,
                         "token_vjps": stats.token_vjps, "vjp_calls": stats.vjp_calls, "seconds": seconds,
                         "gradient_vs_exact": difference})
            print(rows[-1], flush=True)
    return rows


def presets(lengths=(8192, 16384), device_bytes=80 * GiB) -> list[dict]:
    rows = []
    strategies = {"backprop": "none", "checkpoint+mst": "checkpoint,mst", "adjoint": None}
    for preset in PRESETS:
        peaks = {}
        for name, spec in strategies.items():
            engine = "adjoint" if spec is None else None
            for n in lengths:
                report = simulate(preset, n, batch_size=BATCH, strategy=lt.Strategy.parse(spec or "none", engine=engine))
                peaks[name, n] = report.device_peak_bytes
                print(preset, name, n, report.device_peak_bytes / GiB, flush=True)
        for name in strategies:
            (n0, n1) = lengths
            per_token = (peaks[name, n1] - peaks[name, n0]) / (n1 - n0)
            fixed = peaks[name, n0] - per_token * n0
            rows.append({"model": preset, "engine": name, "parameters_m": report.parameters / 1e6,
                         "peak_8k_gib": peaks[name, n0] / GiB, "peak_16k_gib": peaks[name, n1] / GiB,
                         "bytes_per_token": per_token, "fixed_gib": fixed / GiB,
                         "max_tokens_80gib": int((device_bytes - fixed) // per_token) if per_token > 0 else None,
                         "peak_16k_vs_backprop": peaks[name, n1] / peaks["backprop", n1]})
    return rows


MAMBA_SMALL = dict(vocab_size=4096, hidden_size=64, state_size=16, num_hidden_layers=4)
MAMBA_PRESETS = ["mamba-130m", "mamba-1.4b"]
MAMBA_STRATEGIES = {"backprop": "none", "checkpoint+mst": "checkpoint,mst", "adjoint": "adjoint"}
# Simulated only: the same with every layer's input parked in host memory.
MAMBA_PARKED = {"checkpoint:offload_inputs+mst": "checkpoint:offload_inputs,mst", "adjoint:offload_inputs": "adjoint:offload_inputs"}


def mamba_cpu(lengths=(256, 512, 1024)) -> list[dict]:
    """A small Mamba (float32, batch 1, no optimizer): exact peak and step time per engine."""
    rows = []
    for n in lengths:
        batch = {"input_ids": torch.randint(0, 4096, (1, n), generator=torch.Generator().manual_seed(0))}
        base = {}
        for name, spec in MAMBA_STRATEGIES.items():
            strategy = lt.Strategy.parse(spec)
            make = lambda: build_from_config(preset_config("tiny-mamba", **MAMBA_SMALL), torch.float32)  # noqa: E731
            report, _ = run_training_steps(make, seq_len=n, batch_size=1, strategy=strategy, optimizer="none",
                                           iterations=1, fake=False)
            model = lt.apply(make(), strategy)
            lt.step(model, batch)  # warm-up
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            lt.step(model, batch)
            seconds = time.perf_counter() - t0
            base = base or {"peak": report.peak_device_bytes, "seconds": seconds}
            rows.append({"engine": name, "tokens": n, "peak_mib": report.peak_device_bytes / MiB,
                         "peak_vs_backprop": report.peak_device_bytes / base["peak"], "seconds": seconds,
                         "time_vs_backprop": seconds / base["seconds"]})
            print(rows[-1], flush=True)
    return rows


# Every engine at long lengths: backprop and checkpointing run the stock scan, a Python step
# per token, simulated along blocks of tokens (DecoderAdapter.token_block); the adjoint engine
# sizes its VJP blocks to one layer's input once that passes 16 MiB (about 11K tokens of
# mamba-130m), so its peak is linear in T from there, with a steeper slope than below.
MAMBA_LENGTHS = (131072, 262144)


def mamba_presets(device_bytes=80 * GiB, fresh: bool = False) -> list[dict]:
    """Simulated peak (bf16, AdamW, batch 1) of the Mamba presets at two lengths per engine,
    fitted linearly in T. Rows already in docs/results/adjoint_mamba.json at these lengths are kept
    (each says when it was simulated) unless ``fresh``."""
    path = DOCS / "adjoint_mamba.json"
    kept = {} if fresh or not path.exists() else {(r["model"], r["engine"], r["lengths"]): r
                                                   for r in json.loads(path.read_text())["rows"]}
    (n0, n1), rows = MAMBA_LENGTHS, []
    for preset in MAMBA_PRESETS:
        for name, spec in {**MAMBA_STRATEGIES, **MAMBA_PARKED}.items():
            row = kept.get((preset, name, f"{n0:,}, {n1:,}"))
            if row is None:
                row = _simulated_line(preset, name, spec, device_bytes)
            rows.append(row)
        backprop = next(r for r in rows if r["model"] == preset and r["engine"] == "backprop")["bytes_per_token"]
        for row in rows:
            row["per_token_vs_backprop"] = row["bytes_per_token"] / backprop if row["model"] == preset else row["per_token_vs_backprop"]
    return rows


def _simulated_line(preset: str, name: str, spec: str, device_bytes: int) -> dict:
    peaks, hosts = [], []
    for n in MAMBA_LENGTHS:
        started = time.perf_counter()
        report = simulate(preset, n, batch_size=1, strategy=lt.Strategy.parse(spec))
        peaks.append(report.device_peak_bytes)
        hosts.append(report.peak.peak_host_bytes)
        print(preset, name, n, f"{report.device_peak_bytes / GiB:.2f} GiB in {time.perf_counter() - started:.0f} s", flush=True)
    (n0, n1), (p0, p1) = MAMBA_LENGTHS, peaks
    per_token = (p1 - p0) / (n1 - n0)
    fixed = p0 - per_token * n0
    return {"model": preset, "engine": name, "lengths": f"{n0:,}, {n1:,}", "peak_short_gib": p0 / GiB,
            "peak_long_gib": p1 / GiB, "bytes_per_token": per_token, "fixed_gib": fixed / GiB,
            "host_per_token": (hosts[1] - hosts[0]) / (n1 - n0),
            "max_tokens_80gib": int((device_bytes - fixed) // per_token) if per_token > 0 else None,
            "predicted_1m_gib": (fixed + per_token * 2**20) / GiB, "simulated": time.strftime("%Y-%m-%d")}


def mamba_plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu_rows = json.loads((DOCS / "adjoint_mamba_cpu.json").read_text())["rows"]
    preset_rows = json.loads((DOCS / "adjoint_mamba.json").read_text())["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    plot_series(axes[0], cpu_rows, "engine", "tokens", "peak_mib")
    axes[0].set(title="measured CPU peak, small Mamba (4 layers, d=64), float32", xlabel="context tokens", ylabel="MiB")
    tokens = [2**k for k in range(10, 21)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, preset in zip(colors, MAMBA_PRESETS):
        for engine, style in (("backprop", "--"), ("checkpoint+mst", ":"), ("checkpoint:offload_inputs+mst", (0, (1, 4))),
                              ("adjoint", "-"), ("adjoint:offload_inputs", "-.")):
            row = next(r for r in preset_rows if r["model"] == preset and r["engine"] == engine)
            axes[1].plot(tokens, [(row["fixed_gib"] * GiB + row["bytes_per_token"] * n) / GiB for n in tokens],
                         linestyle=style, color=color, label=f"{preset} {engine}")
    axes[1].axhline(80, color="gray", lw=0.8)
    axes[1].set(title="simulated peak, bf16 + AdamW, batch 1 (linear fits)", xlabel="context tokens", ylabel="GiB",
                xscale="log", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "adjoint_mamba.png", dpi=110)
    print(f"wrote {DOCS / 'adjoint_mamba.png'}")


def gpu(preset: str = "ssm-127m", lengths=(16384, 65536), repeats=3) -> list[dict]:
    """One CUDA device, bf16, AdamW, batch 2: allocator peak and median step time per
    engine, engines alternated per length; an engine that runs out of memory is recorded so."""
    if not torch.cuda.is_available():
        raise SystemExit("--only gpu needs a CUDA device")
    from longtrain.optimizers import make_optimizer

    device = torch.device("cuda")
    rows = []
    for n in lengths:
        batch = {"input_ids": torch.randint(0, 32000, (BATCH, n), device=device)}
        for name in ("backprop", "checkpoint+mst", "adjoint"):
            strategy = {"backprop": lt.Strategy(), "checkpoint+mst": lt.Strategy(checkpoint=True, mst=True),
                        "adjoint": lt.Strategy(engine="adjoint")}[name]
            torch.manual_seed(0)
            model = lt.apply(build_from_config(preset_config(preset), torch.bfloat16).to(device), strategy)
            optimizer = make_optimizer("adamw", model.parameters())
            times, peak, error = [], None, None
            try:
                for i in range(repeats + 1):
                    torch.cuda.reset_peak_memory_stats(device)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    lt.step(model, batch, strategy)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    end.record()
                    torch.cuda.synchronize(device)
                    times.append(start.elapsed_time(end) / 1e3)
                    peak = torch.cuda.max_memory_allocated(device)
            except torch.OutOfMemoryError:
                error = "out of memory"
            del model, optimizer
            torch.cuda.empty_cache()
            rows.append({"model": preset, "engine": name, "tokens": n, "peak_gib": None if peak is None else peak / GiB,
                         "seconds": statistics.median(times[1:]) if len(times) > 1 else None,
                         "tokens_per_s": BATCH * n / statistics.median(times[1:]) if len(times) > 1 else None, "note": error or ""})
            print(rows[-1], flush=True)
    return rows


def training(steps: int = 150, seq_len: int = 2048) -> list[dict]:
    """``longtrain train --model ssm-demo`` on the pass-key task, same seed and data, with
    backprop, exact adjoint and truncated adjoint: the loss curves (mean of 10 steps)."""
    import tempfile

    from longtrain.train.trainer import TrainConfig, Trainer

    rows = []
    cases = {"backprop": ("backprop", None), "adjoint": ("adjoint", None), "adjoint, T̄=16": ("adjoint", 16),
             "adjoint, T̄=128": ("adjoint", 128)}
    for name, (engine, truncate) in cases.items():
        with tempfile.TemporaryDirectory() as out:
            spec = engine if truncate is None else f"{engine}:truncate={truncate}"
            config = TrainConfig(model="ssm-demo", engine=spec, seq_len=seq_len, steps=steps,
                                 out=out, progress=False, eval_samples=8, save_every=steps)
            trainer = Trainer(config)
            summary = trainer.train()
            losses = [r["loss"] for r in trainer.history]
        row = {"engine": name, "first_loss": sum(losses[:10]) / 10, "final_loss": sum(losses[-10:]) / 10,
               "digit_accuracy": summary["task"]["digit_accuracy"], "tokens_per_s": summary["tokens_per_s"]}
        for step in (25, 50, 100):
            row[f"loss_{step}"] = sum(losses[step - 10: step]) / 10
        rows.append(row)
        print(row, flush=True)
    return rows


RANKS_MODEL = dict(vocab_size=4096, hidden_size=128, state_size=128, num_hidden_layers=16)


def ranks_worker(length: int = 8192) -> None:
    """One process of ``ranks``: two AdamW steps with the adjoint engine on this rank's
    layer group; rank 0 prints every rank's peak of the second step as JSON."""
    import torch.distributed as dist

    from longtrain.memory import MemoryTracker
    from longtrain.optimizers import make_optimizer
    from longtrain.parallel.distributed import init_from_env
    from longtrain.parallel.layer_groups import owned_parameters, shard_model
    from longtrain.strategy import applied_context

    rank, world = init_from_env()
    torch.manual_seed(0)
    model = lt.apply(build_from_config(preset_config("tiny-ssm", **RANKS_MODEL)), lt.Strategy(engine="adjoint"))
    if world > 1:
        shard_model(applied_context(model), rank, world)
    optimizer = make_optimizer("adamw", model.parameters())
    batch = {"input_ids": torch.randint(0, 4096, (BATCH, length), generator=torch.Generator().manual_seed(0))}
    with MemoryTracker(model, optimizer) as tracker:
        for _ in range(2):
            tracker.reset_peak()
            lt.step(model, batch)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = tracker.report().peak_device_bytes
    mine = {"rank": rank, "peak_bytes": peak, "parameters": sum(p.numel() for p in owned_parameters(model).values())}
    every = [None] * world
    if world > 1:
        dist.all_gather_object(every, mine)
        dist.destroy_process_group()
    else:
        every = [mine]
    if rank == 0:
        print("RANKS " + json.dumps(every), flush=True)


def ranks(processes=(1, 2, 4)) -> list[dict]:
    """Per-process peak of layer groups launched with torchrun (gloo), exact CPU measurement."""
    import os
    import shutil
    import subprocess
    import sys

    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    rows, single = [], None
    for world in processes:
        cmd = [launcher, "--standalone", f"--nproc-per-node={world}", __file__, "--only", "ranks-worker"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
        every = json.loads(next(line for line in out.splitlines() if line.startswith("RANKS "))[6:])
        largest = max(r["peak_bytes"] for r in every)
        single = single or largest
        simulated = simulate(preset_config("tiny-ssm", **RANKS_MODEL), 8192, batch_size=BATCH, dtype="float32",
                             strategy=lt.Strategy(engine="adjoint"), layer_groups=world if world > 1 else None)
        rows.append({"processes": world, "per_rank_mib": ", ".join(f"{r['peak_bytes'] / MiB:.0f}" for r in every),
                     "largest_mib": largest / MiB, "vs_one_process": largest / single,
                     "simulated_mib": simulated.device_peak_bytes / MiB,
                     "simulated_vs_measured": simulated.device_peak_bytes / largest,
                     "parameters_per_rank": ", ".join(str(r["parameters"]) for r in every)})
        print(rows[-1], flush=True)
    return rows


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu_rows = json.loads((DOCS / "adjoint_cpu.json").read_text())["rows"]
    count_rows = json.loads((DOCS / "adjoint_count.json").read_text())["rows"]
    preset_rows = json.loads((DOCS / "adjoint_presets.json").read_text())["rows"]
    fig, axes = plt.subplots(1, 4, figsize=(24, 5.2))
    big = [r for r in cpu_rows if r["model"] == list(SIZES)[-1]]
    plot_series(axes[0], big, "engine", "tokens", "peak_mib")
    axes[0].set(title=f"CPU peak, {list(SIZES)[-1]}, batch {BATCH}", xlabel="context tokens", ylabel="MiB", xscale="log")
    plot_series(axes[1], big, "engine", "tokens", "seconds")
    axes[1].set(title="CPU step time (Fig. 6 shape)", xlabel="context tokens", ylabel="s", xscale="log", yscale="log")
    for row in count_rows:
        row["terms_per_layer"] = row["adjoint_terms"]
    plot_series(axes[2], count_rows, "engine", "tokens", "terms_per_layer")
    axes[2].set(title="adjoint-state terms per layer", xlabel="context tokens", xscale="log", yscale="log")
    # Fig. 1 shape: peak vs context per model size, backprop (dashed) and adjoint (solid),
    # from each engine's linear fit (simulated at 8K and 16K; markers there).
    tokens = [2**k for k in range(13, 21)]
    for color, preset in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], PRESETS):
        for engine, style in (("backprop", "--"), ("adjoint", "-")):
            row = next(r for r in preset_rows if r["model"] == preset and r["engine"] == engine)
            fit = [(row["fixed_gib"] * GiB + row["bytes_per_token"] * n) / GiB for n in tokens]
            axes[3].plot(tokens, fit, style, color=color, label=f"{preset} {engine}")
            axes[3].plot([8192, 16384], [row["peak_8k_gib"], row["peak_16k_gib"]], "o", color=color)
    axes[3].axhline(80, color="gray", lw=0.8)
    axes[3].set(title=f"simulated peak, bf16 + AdamW, batch {BATCH} (Fig. 1 shape)", xlabel="context tokens",
                ylabel="GiB", xscale="log", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7 if ax is axes[3] else 8, ncol=2 if ax is axes[3] else 1)
    fig.tight_layout()
    fig.savefig(DOCS / "adjoint.png", dpi=110)
    print(f"wrote {DOCS / 'adjoint.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["cpu", "count", "presets", "ranks", "training", "plot", "gpu", "ranks-worker", "mamba",
                                           "mamba-presets"],
                        help="run one part (default: all but gpu and mamba; mamba-presets: mamba's simulated part alone)")
    parser.add_argument("--fresh", action="store_true",
                        help="mamba: simulate every preset row again (default: keep the rows docs/results/adjoint_mamba.json has)")
    args = parser.parse_args()
    if args.only == "ranks-worker":
        ranks_worker()
        return
    todo = [args.only] if args.only else ["cpu", "count", "presets", "ranks", "training", "plot"]
    if "mamba" in todo:
        write_report(
            "adjoint_mamba_cpu", "Hugging Face Mamba: exact CPU peak and step time per engine", [
                ("engine", "engine"), ("tokens", "tokens"), ("peak_mib", "peak MiB"), ("peak_vs_backprop", "peak / backprop"),
                ("seconds", "step s"), ("time_vs_backprop", "time / backprop")],
            mamba_cpu(), """
Exact CPU measurement (tracked storages, float32, batch 1, no optimizer) of one forward +
backward of a small Hugging Face Mamba (4 layers, hidden 64, state 16, vocabulary 4,096,
its PyTorch path). Backprop is the model's own autograd graph (its scan runs token by token);
`checkpoint+mst` recomputes each layer in backward and runs the head in mini-sequences;
`adjoint` keeps each layer's input and runs token-wise VJPs in blocks. One timed step after
a warm-up, on two shared CPU cores: times are indicative.""",
            "python benchmarks/adjoint.py --only mamba")
    if "mamba" in todo or "mamba-presets" in todo:
        write_report(
            "adjoint_mamba", "Hugging Face Mamba presets: simulated peak vs context", [
                ("model", "model"), ("engine", "engine"), ("lengths", "simulated at"), ("peak_short_gib", "peak GiB (shorter)"),
                ("peak_long_gib", "peak GiB (longer)"),
                ("bytes_per_token", "bytes/token"), ("per_token_vs_backprop", "bytes/token / backprop"),
                ("host_per_token", "host bytes/token"), ("fixed_gib", "fixed GiB"), ("max_tokens_80gib", "longest on 80 GiB"),
                ("predicted_1m_gib", "1M tokens GiB"), ("simulated", "simulated on")],
            mamba_presets(fresh=args.fresh), """
Simulated (fake tensors, the training step's code path; bf16, AdamW on the device, batch 1)
at 128K and 256K tokens, extrapolated along the layers from 4–6 (backprop and checkpointing,
whose stock scan runs a Python step per token, also along blocks of 16 tokens; the adjoint
engine's VJP blocks are sized to one layer's input past 16 MiB, so its short-length slope
would understate long contexts, and so would the stock scan's); every engine's peak is linear in
T (no attention), so two lengths give bytes/token, the longest context on 80 GiB and the
peak at 1M tokens (predicted, not simulated there). Mamba's state is I × N = 2·hidden × 16
numbers per token and layer: backprop keeps it (and the scan's inputs) for every layer; the
adjoint engine keeps each layer's input and the state entering each scan chunk, and
rebuilds one chunk of one layer's decays, states and adjoint states at a time (chunks
sized to one layer's input), so its bytes/token are about the layer inputs. `:offload_inputs` parks the layer inputs in pinned host memory
(host bytes/token; the adjoint engine all but the top layer's), each fetched while the
layer above runs its backward; host memory is taken to hold them. Rows already in adjoint_mamba.json
are kept (simulated on: the date); `--fresh` simulates them all again.""",
            "python benchmarks/adjoint.py --only mamba-presets")
        mamba_plot()
    if "cpu" in todo:
        write_report(
            "adjoint_cpu", "Adjoint sharding vs backprop: exact CPU peak and step time", [
                ("model", "model"), ("engine", "engine"), ("tokens", "tokens"), ("peak_mib", "peak MiB"),
                ("peak_vs_backprop", "peak / backprop"), ("seconds", "step s"), ("time_vs_backprop", "time / backprop")],
            cpu(), f"""
Exact CPU measurement (tracked storages, float32, no optimizer) of one forward + backward
at batch {BATCH}; times are medians of engines alternated in one run. `adjoint` keeps
each layer's input and recomputes A, c, h when the layer's turn comes; `A/C/h kept`
keeps what the paper lists; `T̄=64` is truncated adjoint sharding (approximate).
`checkpoint+mst` is per-layer checkpointing with the mini-sequence LM head.""",
            "python benchmarks/adjoint.py --only cpu")
    if "count" in todo:
        write_report(
            "adjoint_count", "Adjoint sharding: adjoint-state terms and VJPs vs context length", [
                ("engine", "engine"), ("tokens", "T"), ("adjoint_terms", "terms per layer"),
                ("terms_per_token", "terms / T"), ("token_vjps", "token VJPs per layer"), ("vjp_calls", "batched VJP calls"),
                ("seconds", "step s"), ("gradient_vs_exact", "gradient vs exact")],
            count(), """
Counters of the engine (`AdjointStats`) for one layer at batch 1. A term is one
g^t λ^{t,i} of Prop. 3, i.e. one of the paper's per-(t, i) VJPs; the engine sums the
terms of each token i before its single VJP (a VJP is linear in its vector), so it
takes T token VJPs per layer in every mode. Exact: T(T+1)/2 terms, summed implicitly
by the reverse recurrence in T steps. Truncated: T̄·T − T̄(T̄−1)/2 terms, accumulated
explicitly, so terms / T tends to T̄ (linear in T). Note the paper prints
T̄·T + T̄(T̄−1)/2; counting its sum gives the minus sign. "gradient vs exact": the
largest relative difference of a parameter's gradient from the exact one (this model's
decays are initialized with memories of 10 to 1,000 tokens, so windows shorter than
that lose real paths).""",
            "python benchmarks/adjoint.py --only count")
    if "presets" in todo:
        write_report(
            "adjoint_presets", "Adjoint sharding at the paper's sizes: simulated peak memory", [
                ("model", "model"), ("parameters_m", "params (M)"), ("engine", "engine"), ("peak_8k_gib", "8K GiB"),
                ("peak_16k_gib", "16K GiB"), ("peak_16k_vs_backprop", "16K / backprop"), ("bytes_per_token", "bytes/token"),
                ("max_tokens_80gib", "longest context on 80 GiB")],
            presets(), f"""
Simulated (fake tensors, same code path as the training step) at bf16 with AdamW, batch
{BATCH}, one device. Peak memory of every engine is linear in T for an SSM, so bytes/token
and the longest context on an 80 GiB device follow from 8K and 16K. Backprop materializes
the logits (vocabulary 32,000) and every layer's activations; checkpoint+mst keeps each
layer's input and computes the head in mini-sequences; adjoint keeps each layer's input,
computes the head in mini-sequences too, and replaces the recomputed layer's autograd
graph by its A, c, h, the adjoint states and one block of token VJPs.""",
            "python benchmarks/adjoint.py --only presets")
    if "ranks" in todo:
        write_report(
            "adjoint_ranks", "Adjoint sharding over processes: peak memory per rank", [
                ("processes", "processes"), ("per_rank_mib", "peak per rank (MiB)"), ("largest_mib", "largest MiB"),
                ("vs_one_process", "largest / 1 process"), ("simulated_mib", "simulated busiest MiB"),
                ("simulated_vs_measured", "simulated / measured"), ("parameters_per_rank", "parameters per rank")],
            ranks(), f"""
`torchrun --nproc-per-node R` (gloo, CPU), a 16-layer SSM-ResNet (P = N = 128,
vocabulary 4,096), {BATCH} × 8,192 tokens, exact CPU measurement of the second of two
AdamW steps on each rank (parameters, gradients, optimizer state, records and working
set). Rank 0 holds the embedding, the last rank the head. What does not shrink with R
is each rank's whole-sequence working set: the residual stream it receives, the
gradient it sends, one chunk of one layer's A, c, h, μ and one VJP block. "simulated
busiest": `longtrain simulate --layer-groups R` (float32), the busiest rank as one
process running its layers with the embedding and the head.""",
            "python benchmarks/adjoint.py --only ranks")
    if "training" in todo:
        write_report(
            "adjoint_training", "Training the SSM with backprop, exact and truncated adjoint", [
                ("engine", "engine"), ("first_loss", "loss, steps 1–10"), ("loss_25", "steps 16–25"), ("loss_50", "steps 41–50"),
                ("loss_100", "steps 91–100"), ("final_loss", "last 10 steps"), ("digit_accuracy", "pass-key digits"),
                ("tokens_per_s", "tokens/s")],
            training(), """
`longtrain train --model ssm-demo --seq-len 2048 --steps 150` on the built-in pass-key
task (loss on all text), same seed and batches for every engine, float32 on CPU. Exact
adjoint and backprop compute the same gradient, so their curves differ only by
floating-point rounding; truncated adjoint follows its approximate gradient.""",
            "python benchmarks/adjoint.py --only training")
    if "gpu" in todo:  # not in the default list: needs a CUDA device
        write_report(
            "adjoint_gpu", "Adjoint sharding on one GPU: allocator peak and step time", [
                ("model", "model"), ("engine", "engine"), ("tokens", "tokens"), ("peak_gib", "peak GiB"),
                ("seconds", "step s"), ("tokens_per_s", "tokens/s"), ("note", "note")],
            gpu(), f"""
bf16, AdamW, batch {BATCH}; `torch.cuda.max_memory_allocated` of the last step and the
median step time (CUDA events) of three after a warm-up.""",
            "python benchmarks/adjoint.py --only gpu")
    if "plot" in todo:
        plot()


if __name__ == "__main__":
    main()
