"""Step time, MFU and memory of longtrain's strategies beside the peers users would pick.

One GPU, bf16 weights and gradients, batch 1, random token ids, forward + backward per
step, no optimizer step (gradients freed between steps) — the method of
../shared/gpu/h100-2026-11-22.md. Peers, side by side in one run:

- ``hf``: stock Hugging Face, SDPA attention, non-reentrant gradient checkpointing,
  the loss from ``labels``;
- ``hf+offload``: the same with the forward under ``torch.autograd.graph.save_on_cpu``
  (checkpointed layer inputs in pinned host memory);
- ``hf+liger`` / ``hf+liger+offload``: the same plus Liger's kernels (rope, swiglu,
  rms_norm, fused linear cross-entropy), where ``liger-kernel`` is installed (the
  optional ``bench`` extra); skipped with a note otherwise.

Per case: a warm-up step, then the median of ``--repeats`` steps timed with CUDA events;
tokens/s; MFU = (6·s·P + 6·n·h·s²) / time / peak (dense bf16: 989 TFLOP/s on H100/H200);
the allocator's peak allocated and reserved bytes; longtrain's pinned host bytes. A case
that runs out of memory is reported as such. Writes docs/gpu_peers.json, .md and a
tokens/s-vs-length PNG.

    python benchmarks/gpu_peers.py                        # Llama-3-8B at 16K and 32K
    python benchmarks/gpu_peers.py --lengths 64K,128K --cases lt:fpdt+offload+mst,hf+offload
    python benchmarks/gpu_peers.py --smoke                # tiny model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # the source tree, installed or not
from _report import DOCS, write_report  # noqa: E402

import longtrain as lt  # noqa: E402
from longtrain.memory.flops import device_peak_flops, model_flops_per_sample  # noqa: E402
from longtrain.memory.units import parse_tokens  # noqa: E402
from longtrain.models.loading import build_from_config, default_dtype  # noqa: E402
from longtrain.models.presets import preset_config  # noqa: E402
from longtrain.strategy import pinned_host_bytes  # noqa: E402

GIB = 2**30


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "peer" or "longtrain"
    make: Callable  # peer: (config, device, dtype) -> (model, step); longtrain: (length) -> Strategy


def _liger():
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401

        return apply_liger_kernel_to_llama
    except ImportError:
        return None


def _hf_peer(liger: bool, offload: bool):
    def make(config, device, dtype):
        from transformers import AutoModelForCausalLM

        if liger:
            _liger()(rope=True, swiglu=True, rms_norm=True, fused_linear_cross_entropy=True, cross_entropy=False)
        with torch.device(device), default_dtype(dtype):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()

        def step(ids):
            saving = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
            with saving:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()

        return model, step

    return make


def _fpdt_chunk(length: int) -> int:
    return max(1, min(16384 if length > 32768 else 8192, length // 4))


CASES = [
    Case("hf", "peer", _hf_peer(liger=False, offload=False)),
    Case("hf+offload", "peer", _hf_peer(liger=False, offload=True)),
    Case("hf+liger", "peer", _hf_peer(liger=True, offload=False)),
    Case("hf+liger+offload", "peer", _hf_peer(liger=True, offload=True)),
    Case("lt:checkpoint+mst", "longtrain", lambda n: lt.Strategy(checkpoint=True, mst=True)),
    Case("lt:fpdt+mst", "longtrain", lambda n: lt.Strategy(engine="fpdt", engine_options={"chunk": _fpdt_chunk(n)}, mst=True)),
    Case("lt:fpdt+offload+mst", "longtrain",
         lambda n: lt.Strategy(engine="fpdt", engine_options={"chunk": _fpdt_chunk(n), "offload": True}, mst=True)),
    Case("lt:seco+checkpoint+mst", "longtrain",
         lambda n: lt.Strategy(engine="seco", engine_options={"chunk": _fpdt_chunk(n) // 2, "offload": True},
                               checkpoint=True, mst=True)),
]
BY_NAME = {case.name: case for case in CASES}


def _build_longtrain(config, device, dtype, strategy):
    with torch.device(device):
        model = build_from_config(config, dtype)
    lt.apply(model.train(), strategy)
    return model, lambda ids: lt.step(model, {"input_ids": ids})


class _Timer:
    """CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def run_case(case: Case, config, length: int, device: torch.device, dtype, repeats: int) -> dict:
    row = {"tokens": length, "case": case.name, "status": "ok", "step_s": None, "tokens_per_s": None, "mfu_pct": None,
           "alloc_gib": None, "reserved_gib": None, "host_pinned_gib": None}
    model = None
    try:
        if case.kind == "peer":
            model, step = case.make(config, device, dtype)
        else:
            model, step = _build_longtrain(config, device, dtype, case.make(length))
        ids = torch.randint(0, config.vocab_size, (1, length), device=device)
        timer = _Timer(device)

        def one_step():
            step(ids)
            model.zero_grad(set_to_none=True)

        timer.time(one_step)  # warm-up: kernels, the pinned pool, the allocator's segments
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = [timer.time(one_step) for _ in range(repeats)]
        seconds = statistics.median(times)
        row.update(step_s=seconds, tokens_per_s=length / seconds)
        peak = device_peak_flops(device)
        if peak:
            row["mfu_pct"] = 100 * model_flops_per_sample(model, length) / seconds / peak
        if device.type == "cuda":
            row["alloc_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            row["reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        if case.kind == "longtrain":
            row["host_pinned_gib"] = pinned_host_bytes(model) / GIB
    except torch.OutOfMemoryError:
        row["status"] = "out of memory"
    finally:
        model = step = None  # drop the model before the next case builds its own
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _add_ratios(rows: list[dict]) -> None:
    """tokens/s of each case over the best peer that ran at the same length."""
    for length in {r["tokens"] for r in rows}:
        peers = [r["tokens_per_s"] for r in rows if r["tokens"] == length and not r["case"].startswith("lt:") and r["tokens_per_s"]]
        best = max(peers) if peers else None
        for r in rows:
            if r["tokens"] == length:
                r["vs_best_peer"] = r["tokens_per_s"] / best if best and r["tokens_per_s"] else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", help="preset (default %(default)s)")
    parser.add_argument("--lengths", default="16K,32K", help="comma list of sequence lengths (default %(default)s)")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma list of cases (default: all)")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per case after the warm-up (default %(default)s)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new case after this many seconds (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama at 256/512 tokens on the CPU, written to a temporary folder")
    parser.add_argument("--out", default=None, help="folder for the JSON/markdown/PNG (default docs/, or a temporary one with --smoke)")
    args = parser.parse_args(argv)

    if args.smoke:
        device, dtype, model_name, lengths = torch.device("cpu"), torch.float32, "tiny-llama", [256, 512]
        out = Path(args.out) if args.out else Path(__import__("tempfile").mkdtemp(prefix="gpu_peers_smoke_"))
    else:
        if not torch.cuda.is_available():
            print("gpu_peers: no CUDA device here; run it on a GPU machine, or pass --smoke to exercise the script on the CPU")
            return 0
        device, dtype, model_name = torch.device("cuda"), torch.bfloat16, args.model
        lengths = [parse_tokens(x) for x in args.lengths.split(",")]
        out = Path(args.out) if args.out else DOCS
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"gpu_peers: unknown case {unknown[0]!r}; cases: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    config = preset_config(model_name)
    config.max_position_embeddings = max(config.max_position_embeddings, max(lengths))
    config.use_cache = False
    skipped, rows, start = [], [], time.perf_counter()
    if _liger() is None and any("liger" in n for n in names):
        skipped.append("hf+liger cases (liger-kernel is not installed: pip install liger-kernel)")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for length in lengths:
        for name in names:
            if "liger" in name and _liger() is None:
                continue
            if time.perf_counter() - start > args.budget_s:
                skipped.append(f"{name} at {length:,} tokens (time budget of {args.budget_s:.0f} s spent)")
                continue
            row = run_case(BY_NAME[name], config, length, device, dtype, args.repeats)
            rows.append(row)
            print(f"  {length:>8,} {name:<24} {row['status']:<14} "
                  + (f"{row['step_s']:.3f} s  {row['tokens_per_s']:,.0f} tok/s" if row["step_s"] else ""), flush=True)
            # Written after every case, so a run stopped at its time limit keeps what it measured.
            _report(rows, skipped, out, model_name, dtype, device_name, args.repeats, argv)
    _report(rows, skipped, out, model_name, dtype, device_name, args.repeats, argv)
    _plot(rows, out / "gpu_peers.png")
    print(f"gpu_peers: wrote {out}/gpu_peers.json, .md, .png")
    return 0


def _report(rows, skipped, out, model_name, dtype, device_name, repeats, argv) -> None:
    _add_ratios(rows)
    notes = f"""
{model_name}, {str(dtype).replace('torch.', '')}, batch 1, forward + backward, no optimizer step, on {device_name}.
Median of {repeats} steps after a warm-up ({'CUDA events' if device_name != 'cpu' else 'wall clock'}); MFU against
dense bf16 peak; allocator peaks of the timed steps. `× best peer`: tokens/s over the fastest peer at that length.
Not run: {'; '.join(skipped) or 'nothing'}."""
    columns = [("tokens", "tokens"), ("case", "case"), ("status", "status"), ("step_s", "step s"),
               ("tokens_per_s", "tokens/s"), ("vs_best_peer", "× best peer"), ("mfu_pct", "MFU %"),
               ("alloc_gib", "alloc GiB"), ("reserved_gib", "reserved GiB"), ("host_pinned_gib", "pinned host GiB")]
    command = "python benchmarks/gpu_peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report("gpu_peers", "longtrain vs Hugging Face (+ Liger, + offload) on one GPU", columns, rows, notes, command.strip(),
                 out_dir=out, meta={"device": device_name, "skipped": skipped}, quiet=True)


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from _report import plot_series

    fig, ax = plt.subplots(figsize=(7, 4))
    plot_series(ax, [r for r in rows if r["tokens_per_s"]], "case", "tokens", "tokens_per_s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
