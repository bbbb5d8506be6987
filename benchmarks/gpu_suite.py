"""Everything that needs a GPU, in one command: the CUDA test tier and the GPU benchmarks.

    python benchmarks/gpu_suite.py            # on a GPU machine: ~10 minutes on one H100
    python benchmarks/gpu_suite.py --smoke    # on a CPU: checks the suite's plumbing at toy sizes

It needs nothing but the repository and a CUDA build of torch with transformers (peft
and liger-kernel are used when present, skipped with a note otherwise), and runs:

1. the CUDA tier (``pytest -m cuda``: every engine and technique on the device against
   float64, see tests/test_cuda.py);
2. ``benchmarks/gpu_peers.py``: Llama-3-8B step time, MFU, allocated and reserved peak
   of longtrain's main strategies beside Hugging Face (+ Liger, + offload) at 16K, each
   case in its own process (the full sweep, 16K to 512K in commands of 10 minutes each,
   is in docs/speed.md);
3. ``benchmarks/adjoint.py --only gpu``: the SSM-ResNet under the adjoint engine.

Each part has a time budget so the whole stays within 10 minutes; what did not run is
listed. Results go to docs/results/gpu_suite.md/.json (device, driver, torch, CUDA,
transformers; the CUDA tier's outcome per test), docs/results/gpu_peers.*, docs/results/adjoint_gpu.*.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "results"
# A GPU machine may have the repository and no installed longtrain: use the source tree.
sys.path.insert(0, str(ROOT / "src"))
# The suite's share of gpu_peers.py: what fits its 3 minutes, the most telling first.
SUITE_PEER_CASES = "hf+liger,hf+liger+sac,lt:checkpoint+mst+liger,lt:auto,lt:checkpoint+mst,lt:fpdt+offload+keep+mst+liger,hf+liger+offload,lt:memo+mst,hf"
SOURCE_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _peers_folder(device: str, scratch: Path) -> Path:
    """docs/results where its gpu_peers.json holds this device's rows (or none), else a folder
    of this run's own: the stored rows are one device's, and gpu_peers refuses to mix two."""
    stored = DOCS / "gpu_peers.json"
    if not stored.exists() or json.loads(stored.read_text())["meta"].get("device") == device:
        return DOCS
    return scratch / "peers"


def environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": _version("transformers"), "peft": _version("peft"), "liger_kernel": _version("liger-kernel"),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "driver": None}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            info["driver"], info["device_memory"] = [x.strip() for x in out.stdout.splitlines()[0].split(",")]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, float, str]:
    """Run a part; (exit code or None on timeout, seconds, the output's tail). The part runs
    in its own process group: at its limit the whole group gets SIGINT (pytest then writes
    the results it has; gpu_peers keeps the rows it wrote), and 20 s later SIGKILL — a
    case process of gpu_peers must not go on holding the GPU while the next part runs."""
    start = time.perf_counter()
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **SOURCE_ENV, **(env or {})}, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        code = None
    output = output or ""
    print(output[-4000:], flush=True)
    return code, time.perf_counter() - start, output[-4000:]


def _smoke_peer_cases() -> str:
    """Every gpu_peers case but the expert peers, which a smoke test of their own runs."""
    import gpu_peers  # beside this script

    return ",".join(name for name in gpu_peers.BY_NAME if name not in gpu_peers.EXPERT_PEERS)


def cuda_tier(timeout: float, smoke: bool, scratch: Path) -> dict:
    report = scratch / "cuda_tier.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/test_cuda.py", f"--junitxml={report}", "-p", "no:cacheprovider"]
    if smoke:  # no GPU: the tier only collects (every test is skipped), which checks its imports
        cmd.insert(4, "--co")
    code, seconds, tail = _run(cmd, timeout)
    tests = []
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            tests.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0)})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {"exit_code": code, "seconds": seconds, "counts": counts, "tests": tests,
            "timed_out": code is None, "tail": tail if code not in (0, 5) else ""}


def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="no GPU needed: toy sizes on the CPU, results in a temporary folder")
    parser.add_argument("--skip", default="", help="comma list of parts to leave out: cuda-tier, peers, adjoint")
    parser.add_argument("--lengths", default="16K", help="the peers' sequence lengths (default %(default)s)")
    parser.add_argument("--cases", default=SUITE_PEER_CASES, help="the peers' cases, most telling first (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here. On a GPU machine run `python benchmarks/gpu_suite.py`; "
              "`--smoke` exercises the suite on the CPU.")
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    scratch = Path(tempfile.mkdtemp(prefix="gpu_suite_"))
    out = scratch if args.smoke else DOCS
    start = time.perf_counter()
    summary = {"environment": environment(), "generated": time.strftime("%Y-%m-%d %H:%M"), "parts": {}, "skipped": []}

    if "cuda-tier" in skip:
        summary["skipped"].append("the CUDA tier (--skip)")
    elif importlib.util.find_spec("pytest") is None:
        summary["skipped"].append("the CUDA tier (pytest is not installed here: pip install pytest, or carry its wheel)")
    else:
        summary["parts"]["cuda_tier"] = cuda_tier(200, args.smoke, scratch)

    peers = [sys.executable, "benchmarks/gpu_peers.py", "--budget-s", "180"] + (
        # The plumbing at toy sizes, one length; the expert peers have a smoke test of their own.
        ["--smoke", "--out", str(scratch), "--cases", _smoke_peer_cases(), "--lengths", "128"] if args.smoke
        else ["--lengths", args.lengths, "--cases", args.cases, "--append",  # --append: other lengths stay
              "--out", str(_peers_folder(summary["environment"]["device"], scratch))])
    adjoint = [sys.executable, "benchmarks/adjoint.py", "--only", "gpu"]
    for name, cmd, timeout in (("peers", peers, 260), ("adjoint", adjoint, 80)):
        if name in skip:
            summary["skipped"].append(f"{name} (--skip)")
            continue
        if name == "adjoint" and args.smoke:
            summary["skipped"].append("adjoint (needs a CUDA device)")
            continue
        code, seconds, tail = _run(cmd, timeout)
        summary["parts"][name] = {"command": " ".join(cmd[1:]), "exit_code": code, "seconds": seconds,
                                  "tail": tail if code != 0 else ""}
        if code is None:
            summary["skipped"].append(f"the rest of {name} (its {timeout:.0f} s limit was reached)")
    peers_json = Path(peers[peers.index("--out") + 1]) / "gpu_peers.json"
    if "peers" in summary["parts"] and peers_json.exists():
        summary["skipped"] += json.loads(peers_json.read_text())["meta"].get("skipped", [])
    summary["seconds"] = time.perf_counter() - start
    _write(summary, out)
    tier = summary["parts"].get("cuda_tier", {})
    failed = tier.get("counts", {}).get("failed", 0) + tier.get("counts", {}).get("error", 0)
    broken = [n for n, p in summary["parts"].items() if p.get("exit_code") not in (0, 5)]
    print(f"gpu_suite: {summary['seconds']:.0f} s; results in {out}/gpu_suite.md" + (f"; FAILED: {', '.join(broken)}" if broken else ""))
    return 1 if failed or broken else 0


def _write(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_suite.json").write_text(json.dumps(summary, indent=2) + "\n")
    env = summary["environment"]
    lines = ["# GPU suite", "",
             f"{env['device']} ({env.get('device_memory') or 'memory unknown'}), driver {env['driver']}, torch {env['torch']} "
             f"(CUDA {env['cuda']}), transformers {env['transformers']}, peft {env['peft']}, liger-kernel {env['liger_kernel']}; "
             f"{summary['generated']}, {summary['seconds']:.0f} s in all.", "",
             "Reproduce: `python benchmarks/gpu_suite.py`.", "", "| part | exit | seconds | outcome |", "|---|---|---|---|"]
    for name, part in summary["parts"].items():
        outcome = ", ".join(f"{n} {k}" for k, n in part.get("counts", {}).items() if n) if "counts" in part else part.get("command", "")
        lines.append(f"| {name} | {part['exit_code']} | {part['seconds']:.0f} | {outcome} |")
    lines += ["", "Not run: " + ("; ".join(summary["skipped"]) or "nothing") + "."]
    tier = summary["parts"].get("cuda_tier")
    if tier and tier["tests"]:
        lines += ["", "## CUDA tier", "", "| test | outcome | seconds |", "|---|---|---|"]
        lines += [f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} |" for t in tier["tests"]]
    for name, part in summary["parts"].items():
        if part.get("tail"):
            lines += ["", f"## {name}: output", "", "```", part["tail"][-2000:], "```"]
    (out / "gpu_suite.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
