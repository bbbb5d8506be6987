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
what binds. Writes docs/sequence_parallel_llama3_8b.{json,md}.

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
STRATEGIES = {
    "checkpoint+mst": (lambda: lt.Strategy(checkpoint=True, mst=True, sequence_parallel=DEGREE), (262144, 524288, 1048576)),
    "fpdt+offload+mst": (lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 16384, "offload": True}, mst=True,
                                             sequence_parallel=DEGREE), (262144, 524288, 1048576, 2097152)),
}
DEVICES = {"80 GiB (H100)": 80 * GIB, "141 GiB (H200)": 141 * GIB}
HOST_PER_RANK = 224 * GIB


def main() -> None:
    rows = []
    for name, (make, lengths) in STRATEGIES.items():
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
            rows.append({"strategy": name, "kind": f"longest on {device}", "tokens": int(longest),
                         "device_gib": d2 / GIB + device_slope * (longest - n2) / GIB,
                         "host_gib": (h2 + host_slope * (longest - n2)) / GIB, "params_gib": None, "optimizer_gib": None,
                         "activations_gib": None, "seconds": None,
                         "binds": "device memory" if device_bound <= host_bound else "host memory (224 GiB per rank)"})
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
