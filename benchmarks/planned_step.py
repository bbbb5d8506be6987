"""A planned full fine-tuning step, run: does the plan's memory and time hold on the device?

    python benchmarks/planned_step.py                       # GPU: Llama-3-8B (random weights), AdamW where the plan puts it
    python benchmarks/planned_step.py --seq-len 128K        # a length the 10-minute limit allows
    python benchmarks/planned_step.py --smoke               # CPU: a tiny Llama, seconds (CI)

Plans the run with ``longtrain plan`` for this machine (the GPU's memory, 80% of host
memory, AdamW's state where the plan puts it unless ``--optimizer-on-device`` or
``--optimizer-offload`` says), builds the model
from its config with random weights on the device, and runs ``--steps`` optimizer steps
with the plan's winner and :class:`~longtrain.optimizer_offload.HostAdamW`. The last
step's time (wall clock, synchronized), allocated and reserved device peaks and the
host's resident-memory peak are compared with the plan's predictions in
docs/results/planned_step.{json,md}.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import torch  # noqa: E402
from _report import write_report  # noqa: E402

import longtrain as lt  # noqa: E402
from longtrain.memory.units import format_bytes, parse_tokens, physical_memory  # noqa: E402
from longtrain.models.loading import build_from_config, load_config  # noqa: E402
from longtrain.optimizer_offload import streaming  # noqa: E402
from longtrain.optimizers import make_optimizer  # noqa: E402
from longtrain.plan.planner import PlanRequest, plan  # noqa: E402


def _host_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--seq-len", type=parse_tokens, default=65536)
    parser.add_argument("--steps", type=int, default=2)
    place = parser.add_mutually_exclusive_group()
    place.add_argument("--optimizer-on-device", action="store_true", help="AdamW's state on the device only")
    place.add_argument("--optimizer-offload", action="store_true", help="AdamW's state in host memory only")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    model_name, seq_len = ("tiny-llama", 2048) if args.smoke else (args.model, args.seq_len)
    dtype = torch.bfloat16 if cuda else torch.float32
    host = int(0.8 * physical_memory())
    device_memory = torch.cuda.get_device_properties(device).total_memory if cuda else host
    # Both places unless one is asked for: the planner picks (with AdamW in host memory an 8B
    # model's fp32 state and masters take ~105 GiB, more than 80% of a 128 GB host).
    offload = True if args.optimizer_offload else False if args.optimizer_on_device else None
    print(f"planning {model_name} at {seq_len:,} tokens ...", file=sys.stderr, flush=True)
    result = plan(PlanRequest(model_name, seq_len, device_memory=device_memory, host_memory=host,
                              dtype=str(dtype).split(".")[1], optimizer_offload=offload))
    best = result.best
    if best is None:
        raise SystemExit(f"planned_step: {result.verdict()}")
    print(result.verdict(), file=sys.stderr, flush=True)
    offload = best.optimizer_offload
    strategy = lt.Strategy.from_dict(best.strategy)

    config = load_config(model_name)
    config.max_position_embeddings = max(config.max_position_embeddings or 0, seq_len)
    with torch.device(device):
        model = build_from_config(config, dtype)
    lt.apply(model, strategy)
    optimizer = make_optimizer("adamw-offload" if offload else "adamw", model.parameters(), lr=1e-5, model=model)
    seconds = []
    for step in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        batch = {"input_ids": torch.randint(0, config.vocab_size, (1, seq_len), device=device)}
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with streaming(optimizer, last=True):
            lt.step(model, batch, strategy)
        if offload:
            optimizer.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        print(f"step {step + 1}: {seconds[-1]:.1f} s", file=sys.stderr, flush=True)
    allocated = torch.cuda.max_memory_allocated() if cuda else None
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    row = {
        "model": model_name, "tokens": f"{seq_len:,}", "strategy": best.name + (" --optimizer-offload" if offload else ""), "device": torch.cuda.get_device_name() if cuda else "cpu",
        "step_s": seconds[-1], "planned_step_s": best.step_seconds, "time_ratio": seconds[-1] / best.step_seconds,
        "allocated": format_bytes(allocated) if allocated else None, "planned_allocated": format_bytes(best.device_bytes),
        "reserved": format_bytes(reserved) if reserved else None, "planned_reserved": format_bytes(best.reserved_bytes),
        "host_rss_peak": format_bytes(_host_peak()), "planned_host": format_bytes(best.host_bytes),
    }
    columns = [(k, k) for k in row]
    notes = ("One planned full fine-tuning step run on the device with random weights: measured (CUDA allocator "
             "peaks, wall clock of the last of the steps, the process's resident-memory peak) beside the plan's "
             "prediction. On CPU (`--smoke`) the device peaks are not measured and the time ratio is meaningless "
             "(the time model has H100 rates).")
    write_report("planned_step_smoke" if args.smoke else "planned_step", "A planned step, run", columns, [row], notes,
                 "python benchmarks/planned_step.py" + (" --smoke" if args.smoke else f" --seq-len {seq_len}"),
                 out_dir=args.out)


if __name__ == "__main__":
    main()
