"""Ulysses sequence parallelism: what one of P ranks holds, and how long a context fits.

Llama-3-8B, bf16 weights and gradients, AdamW (bf16 moments), parameters, gradients and
optimizer state sharded over the P = 8 ranks (FSDP2), simulated on fake tensors — one
rank's share, on a fake process group (the simulator's --sp; it equals an exact CPU
measurement of each rank of a real 2-process run, tests/test_sequence_parallel.py):

- ``checkpoint+mst``: whole-sequence attention after the all-to-all, layer checkpointing,
  mini-sequence MLP and head (DeepSpeed ALST's recipe, its checkpoints kept on the device);
- ``fpdt+offload+mst``: chunked attention after the all-to-all (16K tokens per rank per
  chunk), K/V and layer inputs parked in host memory (FPDT).

Per-rank device and host peaks at 256K–2M tokens; bytes per token from the two longest
lengths; the longest context whose per-rank device peak fits 80 GiB (H100) and 141 GiB
(H200) with at most 224 GiB of host memory per rank (an 8-GPU node with 2 TB), and
what binds. For ``checkpoint+mst`` that is a search over whole-length simulations
(plan/longest.py's, from the line through the two longest lengths: the peaks are convex
in the length, so a line through shorter ones can overestimate); for
``fpdt+offload+mst`` the line itself (what binds, the parked bytes in host memory, is
linear in the length: the host peak doubles exactly with it from 256K to 2M tokens).
Writes docs/results/sequence_parallel_llama3_8b.{json,md}.

    python benchmarks/sequence_parallel.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from _report import write_report  # noqa: E402

import longtrain as lt  # noqa: E402

GIB = 2**30
DEGREE = 8
STRATEGIES = {  # name: (strategy, lengths simulated, whether the longest context is searched)
    "checkpoint+mst": (lambda: lt.Strategy(checkpoint=True, mst=True, sequence_parallel=DEGREE), (262144, 524288, 1048576),
                       True),
    "fpdt+offload+mst": (lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 16384, "offload": True}, mst=True,
                                             sequence_parallel=DEGREE), (262144, 524288, 1048576, 2097152), False),
}
DEVICES = {"80 GiB (H100)": 80 * GIB, "141 GiB (H200)": 141 * GIB}
HOST_PER_RANK = 224 * GIB
GRANULE = 8 * 1024  # searched lengths: multiples of this many tokens (every rank an equal share)


def _searched(make, start: int, budget: int) -> dict:
    """The longest context within ``budget`` per rank (and the host cap), searched from
    ``start`` over whole-length simulations; the row's figures at that length."""
    from longtrain.plan.longest import search

    reports = {}

    def over(n):
        reports[n] = lt.simulate("llama3-8b", n, strategy=make(), optimizer="adamw")
        print(f"  simulated {n:,} tokens: {reports[n].device_peak_bytes / GIB:.2f} GiB", flush=True)
        over_device = reports[n].device_peak_bytes - budget
        over_host = reports[n].peak.peak_host_bytes - HOST_PER_RANK
        return (over_device, "device memory") if over_device >= over_host else (over_host, "host memory (224 GiB per rank)")

    start_time = time.perf_counter()
    tokens, binds = search(over, start - start % GRANULE, GRANULE)
    report = reports[tokens]
    return {"tokens": tokens, "device_gib": report.device_peak_bytes / GIB, "host_gib": report.peak.peak_host_bytes / GIB,
            "seconds": time.perf_counter() - start_time, "binds": binds + f" (searched: {len(reports)} simulations)"}


def main() -> None:
    rows = []
    for name, (make, lengths, searched) in STRATEGIES.items():
        peaks = []
        for n in lengths:
            start = time.perf_counter()
            report = lt.simulate("llama3-8b", n, strategy=make(), optimizer="adamw")
            peak = report.peak
            peaks.append((n, report.device_peak_bytes, peak.peak_host_bytes))
            rows.append({"strategy": name, "kind": "simulated", "tokens": n, "device_gib": report.device_peak_bytes / GIB,
                         "host_gib": peak.peak_host_bytes / GIB,
                         "params_gib": peak.device_bytes("parameters") / GIB,
                         "optimizer_gib": peak.device_bytes("optimizer_state") / GIB,
                         "activations_gib": (peak.device_bytes("activations") + peak.device_bytes("temporaries")) / GIB,
                         "seconds": time.perf_counter() - start, "binds": None})
            print(rows[-1], flush=True)
        (n1, d1, h1), (n2, d2, h2) = peaks[-2], peaks[-1]
        device_slope, host_slope = (d2 - d1) / (n2 - n1), (h2 - h1) / (n2 - n1)
        host_bound = n2 + (HOST_PER_RANK - h2) / host_slope if host_slope > 0 else float("inf")
        for device, budget in DEVICES.items():
            device_bound = n2 + (budget - d2) / device_slope if device_slope > 0 else float("inf")
            longest = min(device_bound, host_bound)
            row = {"strategy": name, "kind": f"longest on {device}", "tokens": int(longest),
                   "device_gib": d2 / GIB + device_slope * (longest - n2) / GIB,
                   "host_gib": (h2 + host_slope * (longest - n2)) / GIB, "params_gib": None, "optimizer_gib": None,
                   "activations_gib": None, "seconds": None,
                   "binds": "device memory" if device_bound <= host_bound else "host memory (224 GiB per rank)"}
            if searched:
                row.update(_searched(make, int(longest), budget))
            rows.append(row)
            print(rows[-1], flush=True)
    notes = "\n\n".join(__doc__.split("\n\n")[1:4])
    write_report(
        "sequence_parallel_llama3_8b", f"Llama-3-8B under Ulysses sequence parallelism over {DEGREE} ranks (one rank, simulated)",
        [("strategy", "strategy"), ("kind", "row"), ("tokens", "tokens"), ("device_gib", "device GiB / rank"),
         ("host_gib", "host GiB / rank"), ("params_gib", "params"), ("optimizer_gib", "AdamW state"),
         ("activations_gib", "activations + temporaries"), ("seconds", "simulation s"), ("binds", "limited by")],
        rows, notes=notes, command="python benchmarks/sequence_parallel.py")


if __name__ == "__main__":
    main()
