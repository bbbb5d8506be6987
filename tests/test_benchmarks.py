"""The GPU suite's plumbing, on the CPU: `gpu_suite.py --smoke` collects the CUDA tier and
runs gpu_peers.py at toy sizes, writing its reports where it says."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_suite_smoke_runs_end_to_end_on_the_cpu():
    result = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--smoke"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = Path(result.stdout.strip().splitlines()[-1].split("results in ")[1].rsplit("/", 1)[0])
    summary = json.loads((folder / "gpu_suite.json").read_text())
    assert summary["parts"]["cuda_tier"]["exit_code"] == 0
    assert summary["parts"]["peers"]["exit_code"] == 0
    rows = json.loads((folder / "gpu_peers.json").read_text())["rows"]
    cases = {r["case"] for r in rows}
    assert {"hf", "hf+offload", "lt:checkpoint+mst", "lt:fpdt+offload+mst", "lt:seco+checkpoint+mst"} <= cases
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)
    assert "Not run:" in (folder / "gpu_suite.md").read_text()
