"""The longest contexts, measured where a whole model's step would take hours: one training
step of a depth-truncated model (a few of its layers, its whole embedding and head) at the
target lengths, its peak beside ``simulate`` of the same truncated model, and the full-depth
longest context the simulator gives for the machine.

A step's memory is layer by layer the same (the simulator's extrapolation rests on it), so
a truncated model at the full length holds what the whole model's step holds at the same
place, less the other layers' share; what it measures is the part of the simulator a GPU
run could contradict — the chunked engines' per-chunk transients, the head's tiles, the
allocator's reserve. Per length: the exact tracker's peak (live storages: what the simulator
counts) and, on a GPU, the allocator's allocated and reserved peaks; the simulated peak of
the same truncated model; the simulated peak over the tracker's and the allocator's
reserved peak over the simulated one. Then, simulated: the whole model's longest context on
``--device-memory`` and ``--host-memory`` with this strategy and optimizer and what binds
past it — by default full fine-tuning with AdamW's float32 state in host memory, the first
column of docs/planner.md's longest-context table.

The report is written after every length, so a command stopped at its time limit keeps
what it measured; no length starts after ``--budget-s`` seconds (the full-depth search
follows the steps, a few minutes on one core).

    python benchmarks/measured_longest.py --lengths 512K,1M --layers 2 --strategy fpdt:chunk=8192:segment=6,mst
    python benchmarks/measured_longest.py --device-memory 79.1GiB --lengths 512K   # an H100 80 GB's limit, on an H200
    python benchmarks/measured_longest.py --smoke   # tiny-llama on the CPU: the tracker against the simulator
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # the source tree, installed or not
from _report import write_report  # noqa: E402

import longtrain as lt  # noqa: E402
from longtrain.memory.units import format_bytes, parse_bytes, parse_tokens  # noqa: E402
from longtrain.models.adapters import adapter_class  # noqa: E402
from longtrain.models.loading import build_from_config, default_dtype  # noqa: E402
from longtrain.models.presets import preset_config  # noqa: E402
from longtrain.plan.bounds import budgets_for  # noqa: E402
from longtrain.plan.longest import longest_context  # noqa: E402
from longtrain.plan.simulate import run_training_steps, simulate  # noqa: E402

GIB = 2**30


def truncated(config, layers: int, length: int):
    """``config`` with its first ``layers`` layers (embedding and head whole), positions to ``length``."""
    small = adapter_class(config.model_type).with_layers(config, layers)
    small.max_position_embeddings = max(small.max_position_embeddings, length)
    small.use_cache = False
    return small


def measure(config, length: int, strategy: lt.Strategy, device: torch.device, dtype: torch.dtype,
            optimizer: str) -> dict:
    """One training step of ``config`` at ``length`` tokens on ``device``: the exact tracker's
    peak and, on CUDA, the allocator's."""
    def build():
        with torch.device(device):
            return build_from_config(config, dtype)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    report, _ = run_training_steps(build, seq_len=length, strategy=strategy, optimizer=optimizer, dtype=dtype,
                                   iterations=1, fake=False, device=device)
    row = {"tracker_bytes": report.peak_device_bytes, "tracker_gib": report.peak_device_bytes / GIB,
           "step_s": time.perf_counter() - started,
           "allocated_gib": None, "reserved_gib": None}
    if device.type == "cuda":
        row["allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        gc.collect()
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", help="preset (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the truncated model (default %(default)s)")
    parser.add_argument("--lengths", default="512K,1M", help="comma list of lengths (default %(default)s)")
    parser.add_argument("--strategy", default="fpdt:chunk=32768:offload,mst", help="(default %(default)s)")
    parser.add_argument("--optimizer", default="adamw", choices=("none", "adamw"),
                        help="adamw: float32 masters and moments, as train runs it; none: gradients only, as the "
                             "peers are timed (default %(default)s)")
    parser.add_argument("--optimizer-offload", action=argparse.BooleanOptionalAction, default=True,
                        help="AdamW's state in host memory, for the step and the full-depth limit (default: on)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no new length after this many seconds (default %(default)s)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="the device of the full-depth limit, and the allocator's cap on a GPU (default: this "
                             "GPU's memory)")
    parser.add_argument("--host-memory", default="128GB", metavar="SIZE", help="host of the full-depth limit "
                                                                                "(default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama at 256 and 512 tokens on the CPU, float32")
    parser.add_argument("--out", default=None, help="folder for the JSON and markdown (default docs/results/, or a "
                                                    "temporary one with --smoke)")
    args = parser.parse_args(argv)

    if args.smoke:
        device, dtype, model_name, dtype_name = torch.device("cpu"), torch.float32, "tiny-llama", "float32"
        lengths = [parse_tokens(x) for x in (args.lengths if args.lengths != "512K,1M" else "256,512").split(",")]
        strategy = lt.Strategy.parse(args.strategy if args.strategy != parser.get_default("strategy")
                                     else "fpdt:chunk=64:offload,mst")
        layers = min(args.layers, 2)
    elif not torch.cuda.is_available():
        print("measured_longest: no CUDA device here; run it on a GPU machine, or pass --smoke")
        return 0
    else:
        device, dtype, model_name, dtype_name = torch.device("cuda"), torch.bfloat16, args.model, "bfloat16"
        lengths = [parse_tokens(x) for x in args.lengths.split(",")]
        strategy, layers = lt.Strategy.parse(args.strategy), args.layers
    device_memory = (parse_bytes(args.device_memory) if args.device_memory else
                     torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 16 * GIB)
    if device.type == "cuda" and args.device_memory:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, device_memory / total), device)
    host_memory = parse_bytes(args.host_memory)
    full = preset_config(model_name)
    full.use_cache = False

    offloaded = args.optimizer == "adamw" and args.optimizer_offload
    stepped = "adamw-offload" if offloaded else args.optimizer
    out = Path(args.out) if args.out else (Path(__import__("tempfile").mkdtemp(prefix="measured_longest_"))
                                           if args.smoke else None)
    command = "python benchmarks/measured_longest.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = _Report(model_name, layers, dtype_name, strategy, stepped, device, device_memory, host_memory, out,
                     command.strip())
    try:  # before any step: a machine the states alone do not fit is refused at once
        _, budgets = budgets_for(full, device_memory=device_memory, host_memory=host_memory, optimizer=args.optimizer,
                                 dtype=dtype, optimizer_offload=offloaded if args.optimizer == "adamw" else None)
    except lt.LongtrainError as error:
        print(f"measured_longest: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    for length in lengths:
        if time.perf_counter() - started >= args.budget_s:
            report.skipped.append(f"{length:,} tokens (time budget of {args.budget_s:.0f} s spent)")
            continue
        config = truncated(full, layers, length)
        row = {"tokens": length, "layers": layers, "status": "ok"}
        try:
            row.update(measure(config, length, strategy, device, dtype, stepped))
        except torch.OutOfMemoryError:
            row.update(status="out of memory", tracker_gib=None, allocated_gib=None, reserved_gib=None, step_s=None)
        if row["status"] != "ok":  # outside the handler: its traceback no longer holds the step's tensors
            gc.collect()
            torch.cuda.empty_cache()
        with default_dtype(dtype):
            simulated = simulate(config, length, strategy=strategy, optimizer=stepped, dtype=dtype_name, iterations=1)
        row["simulated_bytes"], row["simulated_gib"] = simulated.device_peak_bytes, simulated.device_peak_bytes / GIB
        measured, reserved = row.get("tracker_gib"), row.get("reserved_gib")
        row["difference_pct"] = 100 * (row["simulated_gib"] - measured) / measured if measured else None
        row["reserved_over_simulated_pct"] = 100 * (reserved / row["simulated_gib"] - 1) if reserved else None
        report.rows.append(row)
        report.write()  # kept if the command is stopped at its time limit
        print(f"  {length:>9,} tokens, {layers} layers: {row['status']}, tracker {measured or 0:.3f} GiB, "
              f"simulated {row['simulated_gib']:.3f} GiB", flush=True)

    report.longest, report.binds = longest_context(full, strategy, budgets[0], dtype_name)
    report.write()
    print(f"measured_longest: full depth {report.longest:,} tokens ({report.binds}); wrote "
          f"{out or 'docs/results'}/measured_longest.*")
    return 0


class _Report:
    """The report so far: the rows measured, the lengths skipped, the full-depth limit once found."""

    COLUMNS = [("tokens", "tokens"), ("layers", "layers"), ("status", "status"), ("tracker_gib", "tracker GiB"),
               ("allocated_gib", "allocated GiB"), ("reserved_gib", "reserved GiB"), ("simulated_gib", "simulated GiB"),
               ("difference_pct", "simulated / tracker − 1, %"),
               ("reserved_over_simulated_pct", "reserved / simulated − 1, %"), ("step_s", "step s")]

    def __init__(self, model_name, layers, dtype_name, strategy, optimizer, device, device_memory, host_memory, out,
                 command):
        self.model_name, self.layers, self.dtype_name, self.strategy = model_name, layers, dtype_name, strategy
        self.optimizer, self.device, self.out, self.command = optimizer, device, out, command
        self.device_memory, self.host_memory = device_memory, host_memory
        self.rows: list[dict] = []
        self.skipped: list[str] = []
        self.longest: int | None = None
        self.binds: str | None = None

    def write(self) -> None:
        optimizer = {"adamw-offload": "AdamW, float32 state in host memory", "adamw": "AdamW, float32 state on the "
                     "device", "none": "none (gradients only)"}[self.optimizer]
        where = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "the CPU")
        limit = (f"trains at most **{self.longest:,} tokens** on {format_bytes(self.device_memory)} of device and "
                 f"{format_bytes(self.host_memory)} of host memory (device side with the allocator's fragmentation "
                 f"margin); past it: {self.binds}" if self.longest is not None else "not computed (the steps ran "
                 "first; the search had not finished)")
        notes = f"""
{self.model_name} truncated to {self.layers} of its layers (embedding and head whole), {self.dtype_name}, batch 1,
strategy `{self.strategy.name}`, optimizer {optimizer}, one training step per length on {where}. tracker: the exact
tracker's peak of live device storages (what the simulator counts); allocated / reserved: the CUDA allocator's peaks;
simulated: `simulate` of the same truncated model.

Full depth (simulated): {self.model_name} with `{self.strategy.name}` and the same optimizer {limit}.

Not run: {'; '.join(self.skipped) or 'nothing'}."""
        write_report("measured_longest", "Longest contexts: a truncated model measured, the whole model simulated",
                     self.COLUMNS, self.rows, notes, self.command, out_dir=self.out,
                     meta={"full_depth_longest": self.longest, "binds": self.binds, "device_memory": self.device_memory,
                           "host_memory": self.host_memory, "strategy": self.strategy.name, "optimizer": self.optimizer,
                           "skipped": self.skipped}, quiet=True)


if __name__ == "__main__":
    sys.exit(main())
