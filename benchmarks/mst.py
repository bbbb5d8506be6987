"""MsT benchmark: memory of the MLP and of the LM head alone vs length and chunk count
(exact CPU measurement at reduced widths, the shape of the paper's Tables 16 and 14),
the simulated longest context that trains on one 80 GiB device, and the CPU step-time
ratio of checkpointing + MsT against checkpointing alone.

Writes docs/results/mst_{mlp,head,max_context,speed}.{json,md} and docs/results/mst_memory.png.
"""

from __future__ import annotations

import copy

import torch
from _report import DOCS, median_step_times, write_report
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import longtrain as lt
from longtrain.memory import MemoryTracker
from longtrain.models.loading import build_from_config, load_config
from longtrain.ops.chunked_loss import chunked_causal_lm_loss
from longtrain.ops.loss import causal_lm_loss
from longtrain.ops.tiled_mlp import tiled_mlp
from longtrain.plan.simulate import simulate

MiB, GiB = 2**20, 2**30
LENGTHS = [2048, 4096, 8192, 16384, 32768]
D, INTERMEDIATE, VOCAB = 256, 896, 8192  # Llama-3's ratios: I/d = 3.5, V/d = 32


def mlp_memory() -> list[dict]:
    mlp = LlamaMLP(LlamaConfig(hidden_size=D, intermediate_size=INTERMEDIATE, num_attention_heads=4))
    params = list(mlp.parameters())
    rows = []
    for n in LENGTHS:
        x = torch.randn(1, n, D, requires_grad=True)
        grad = torch.randn(1, n, D)
        for m in (1, 2, 4, 8):
            x.grad = None
            mlp.zero_grad(set_to_none=True)
            with MemoryTracker() as tracker:
                out = mlp(x) if m == 1 else tiled_mlp(mlp, x, params, chunk_tokens=-(-n // m))
                out.backward(grad)
                del out
                peak = tracker.peak_bytes
            rows.append({"tokens": n, "M": m, "peak_mib": peak / MiB})
    return rows


def head_memory() -> list[dict]:
    weight = torch.randn(VOCAB, D, requires_grad=True)
    rows = []
    for n in LENGTHS:
        x = torch.randn(1, n, D, requires_grad=True)
        labels = torch.randint(0, VOCAB, (1, n))
        for m in (1, 2, 4, 8, 16, 32):
            x.grad = weight.grad = None
            with MemoryTracker() as tracker:
                if m == 1:  # stock: full logits, then cross-entropy
                    loss = causal_lm_loss(x @ weight.t(), labels, n - 1)
                else:
                    loss = chunked_causal_lm_loss(x, weight, labels, chunks=m)
                loss.backward()
                del loss
                peak = tracker.peak_bytes
            rows.append({"tokens": n, "M": m, "peak_mib": peak / MiB})
    return rows


def _peak(model_config, seq_len, strategy):
    return simulate(model_config, seq_len, strategy=strategy, optimizer="adamw", dtype="bfloat16").device_peak_bytes


def longest_fitting(peak_of, budget, grid=1024, limit=1 << 22) -> tuple[int, dict]:
    """Longest multiple of ``grid`` tokens whose peak fits ``budget``, for a peak that
    grows with length (piecewise linearly): secant steps between the closest fitting and
    non-fitting lengths, bisection when the secant makes no progress."""
    known = {s: peak_of(s) for s in (8 * grid, 16 * grid)}
    for _ in range(12):
        fitting = [s for s, p in known.items() if p <= budget]
        failing = [s for s, p in known.items() if p > budget]
        lo, hi = max(fitting, default=0), min(failing, default=None)
        if hi is not None and hi - lo <= grid:
            return lo, known
        if lo and hi:
            a, b = lo, hi
        elif hi is None:
            a, b = sorted(known)[-2:]
        else:
            a, b = sorted(known)[:2]
        slope = (known[b] - known[a]) / (b - a)
        guess = b + (budget - known[b]) / slope if slope > 0 else 2 * b
        guess = int(guess) // grid * grid
        upper = hi - grid if hi is not None else limit
        guess = min(max(guess, lo + grid), upper)
        if guess in known:
            guess = (lo + (hi if hi is not None else 2 * lo)) // 2 // grid * grid
        if guess <= 0 or guess in known:
            return lo, known
        known[guess] = peak_of(guess)
    return max((s for s, p in known.items() if p <= budget), default=0), known


def max_context(budget=80 * GiB) -> list[dict]:
    """Longest context (multiple of 1K) whose simulated steady-state peak fits ``budget``."""
    rows = []
    for name in ("llama3-8b", "qwen2-7b", "gemma2-9b"):
        config = load_config(name)
        note = ""
        if getattr(config, "attn_logit_softcapping", None):
            # Model attention as a flash kernel (FlashAttention-2 implements Gemma-2's
            # soft-capping); eager attention would add s×s scores to every strategy.
            config = copy.deepcopy(config)
            config.attn_logit_softcapping = None
            note = "attention as a flash kernel"
        for strategy in ("none", "checkpoint", "checkpoint,mst"):
            best, known = longest_fitting(lambda s: _peak(config, s, strategy), budget)
            rows.append({"model": name, "strategy": strategy, "max_tokens": best,
                         "peak_gib": known.get(best, 0) / GiB, "simulations": len(known), "note": note})
            print(rows[-1], flush=True)
    return rows


def speed(seq_len=8192, repeats=3) -> list[dict]:
    """Step time of checkpointing + MsT vs checkpointing, alternated in one run."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len)
    models = {}
    for strategy in ("checkpoint", "checkpoint,mst"):
        torch.manual_seed(0)
        models[strategy] = lt.apply(build_from_config(copy.deepcopy(config)), lt.Strategy.parse(strategy))
    batch = {"input_ids": torch.randint(0, VOCAB, (1, seq_len))}
    medians = median_step_times(models, batch, repeats)
    base = medians["checkpoint"]
    return [{"strategy": s, "tokens": seq_len, "median_s": t, "ratio_to_checkpoint": t / base} for s, t in medians.items()]


def plot(mlp_rows, head_rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, rows, title in ((axes[0], mlp_rows, f"MLP alone (d={D}, I={INTERMEDIATE})"), (axes[1], head_rows, f"LM head + loss (d={D}, V={VOCAB})")):
        for m in sorted({r["M"] for r in rows}):
            pts = [(r["tokens"], r["peak_mib"]) for r in rows if r["M"] == m]
            ax.plot(*zip(*pts), marker="o", label="stock" if m == 1 else f"M={m}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("peak MiB (exact, CPU, fp32)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "mst_memory.png", dpi=110)


def main() -> None:
    import sys

    cmd = "python benchmarks/mst.py"
    if sys.argv[1:] == ["--max-context-only"]:
        return _max_context_report(cmd)
    mlp_rows = mlp_memory()
    write_report("mst_mlp", "MsT: peak memory of the MLP alone (forward + backward)",
                 [("tokens", "tokens"), ("M", "mini-sequences M"), ("peak_mib", "peak MiB")], mlp_rows,
                 notes=f"Exact CPU measurement (live tensor storages), float32, a Llama MLP at d={D}, I={INTERMEDIATE}. M=1 is the stock module.",
                 command=cmd)
    head_rows = head_memory()
    write_report("mst_head", "MsT: peak memory of the LM head + cross-entropy alone (forward + backward)",
                 [("tokens", "tokens"), ("M", "mini-sequences M"), ("peak_mib", "peak MiB")], head_rows,
                 notes=f"Exact CPU measurement, float32, d={D}, V={VOCAB} (V/d = 32 as in Llama-3). M=1 is stock: full logits, then cross-entropy.",
                 command=cmd)
    plot(mlp_rows, head_rows)
    speed_rows = speed()
    write_report("mst_speed", "MsT: CPU step time, checkpointing + MsT vs checkpointing",
                 [("strategy", "strategy"), ("tokens", "tokens"), ("median_s", "median step s"), ("ratio_to_checkpoint", "ratio")],
                 speed_rows,
                 notes=f"Forward + backward of a 2-layer Llama (d={D}, I={INTERMEDIATE}, V={VOCAB}) on 2 CPU cores, the two strategies alternated in one run, median of 3 after a warm-up. Ratios only; absolute CPU times mean little.",
                 command=cmd)
    _max_context_report(cmd)


def _max_context_report(cmd: str) -> None:
    rows = max_context()
    write_report("mst_max_context", "MsT: longest context that trains on one 80 GiB device (simulated)",
                 [("model", "model"), ("strategy", "strategy"), ("max_tokens", "max tokens"), ("peak_gib", "peak GiB at max"),
                  ("simulations", "simulations"), ("note", "note")], rows,
                 notes="Simulated steady-state peak with bf16 weights, gradients and AdamW state (8 bytes per parameter), batch 1, "
                       "SDPA flash-style attention. The maximum is the longest multiple of 1,024 tokens whose peak fits 80 GiB.",
                 command=cmd)


if __name__ == "__main__":
    main()
