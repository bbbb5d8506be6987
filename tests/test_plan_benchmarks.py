"""The planner's benchmarks run end to end at toy sizes (their GPU and full-scale runs are
in docs/results/max_context.md and docs/results/planned_step.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["max_context.py", "planned_step.py"])
def test_benchmark_smoke(script, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert report["rows"] and all(row.get("strategy") for row in report["rows"])
    if script == "max_context.py":  # the longest of every candidate's limit (plan/longest.py), the others beside it
        row = report["rows"][0]
        best = int(row["tokens"].replace(",", ""))
        assert best > 0 and row["binds"].endswith("beyond it")
        assert {"checkpoint,mst", "memo,mst"} <= set(row["others"]) and max(row["others"].values()) <= best
