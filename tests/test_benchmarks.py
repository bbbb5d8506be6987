"""The GPU suite's plumbing, on the CPU: `gpu_suite.py --smoke` collects the CUDA tier and
runs gpu_peers.py at toy sizes, writing its reports where it says."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert {"hf", "hf+offload", "lt:checkpoint+mst", "lt:fpdt+offload+mst", "lt:memo+mst", "lt:seco+checkpoint+mst"} <= cases
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["notes"].startswith("memo alpha ") for r in rows if r["case"] == "lt:memo+mst")  # what it chose, measured
    assert "Not run:" in (folder / "gpu_suite.md").read_text()


def test_gpu_peers_isolates_cases_and_stops_a_case_at_its_first_failure(tmp_path):
    """--isolate runs each case in its own process (longtrain's with expandable segments,
    its attention kernel recorded); --append merges with an earlier run, and a case that
    failed at a shorter length there is not tried again: the report names the longest
    length each case ran."""
    def row(tokens, case, status):
        return {"tokens": tokens, "case": case, "status": status, "step_s": None, "tokens_per_s": None, "mfu_pct": None,
                "alloc_gib": None, "reserved_gib": None, "reserved_over_alloc": None, "host_peak_gib": None,
                "host_pinned_gib": None, "alloc_conf": "default", "attention_kernel": None}

    earlier = {"meta": {"skipped": [], "device": "NVIDIA H100 80GB HBM3"}, "rows": [row(128, "lt:checkpoint+mst", "out of memory")]}
    (tmp_path / "gpu_peers.json").write_text(json.dumps(earlier))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_peers

    # Another device's rows are not merged: ratios and longest lengths would mix two machines.
    assert gpu_peers.main(["--smoke", "--append", "--cases", "hf", "--lengths", "128", "--out", str(tmp_path)]) == 2
    earlier["meta"]["device"] = "cpu"
    (tmp_path / "gpu_peers.json").write_text(json.dumps(earlier))
    cases = "hf,lt:checkpoint+mst,lt:fpdt+offload+keep+mst"
    result = subprocess.run([sys.executable, "benchmarks/gpu_peers.py", "--smoke", "--isolate", "--append", "--cases", cases,
                             "--lengths", "256", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_peers.json").read_text())
    got = {(r["tokens"], r["case"]): r for r in report["rows"]}
    assert set(got) == {(128, "lt:checkpoint+mst"), (256, "hf"), (256, "lt:fpdt+offload+keep+mst")}
    assert got[(256, "hf")]["status"] == "ok" and got[(256, "hf")]["host_peak_gib"] > 0
    fpdt = got[(256, "lt:fpdt+offload+keep+mst")]
    assert fpdt["status"] == "ok" and "expandable_segments:True" in fpdt["alloc_conf"] and fpdt["attention_kernel"] == "flash"
    assert report["meta"]["longest_fit"]["lt:checkpoint+mst"] == {"longest_ok": None, "first_failure": 128}
    assert any("lt:checkpoint+mst at 256 tokens (out of memory at 128)" in s for s in report["meta"]["skipped"])
    assert "Longest length each case ran:" in (tmp_path / "gpu_peers.md").read_text()


def test_a_case_longtrain_refuses_is_reported_as_refused_not_a_crash():
    """Memo refuses a length whose kept activations exceed the host budget; the sweep
    records the refusal (and, like an out-of-memory, tries no longer length)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_peers

    import longtrain as lt

    case = gpu_peers.Case("lt:memo-tiny-host", "longtrain", lambda n: lt.Strategy(memo=lt.MemoOptions(host_memory=1024), mst=True))
    config = gpu_peers._config("tiny-llama", [128])
    row = gpu_peers.run_case(case, config, 128, torch.device("cpu"), torch.float32, repeats=1, warmup=0)
    assert row["status"].startswith("refused: memo keeps every layer's input and attention output in host memory")
    assert gpu_peers.longest_fit([row])["lt:memo-tiny-host"] == {"longest_ok": None, "first_failure": 128}


def test_a_case_killed_by_sigkill_is_reported_as_out_of_host_memory(monkeypatch):
    """Nothing of gpu_peers sends SIGKILL to a case: the kernel's out-of-memory killer does
    (Memo at 128K on the H100 host, 2026-11-23). That is a measured limit, not a crash."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_peers

    monkeypatch.setattr(gpu_peers.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, -9, stdout="", stderr=""))
    args = gpu_peers.argparse.Namespace(model="llama3-8b", repeats=1, warmup=0, smoke=True, profile=None,
                                        expandable_segments="longtrain", attention_kernel=None)
    row = gpu_peers.run_isolated(gpu_peers.BY_NAME["lt:memo+mst"], 131072, args, timeout=10)
    assert row["status"] == "out of host memory (killed by SIGKILL)"


def test_step_work_counts_fpdt_matmuls_as_checkpointing_and_writes_its_report(tmp_path):
    """benchmarks/step_work.py at toy size: FPDTOptions without the K/V re-park does exactly layer
    checkpointing's matmul work (its recomputed layers skip the MLP output nobody reads, its
    head runs backward in the forward pass); kept outputs run each attention block forward once."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_work

    step_work.main(["--tokens", "200", "--chunk", "64", "--layers", "2", "--width", "32", "--out", str(tmp_path)])
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "step_work.json").read_text())["rows"]}
    assert rows["fpdt:recompute_kv=false,mst"]["matmul_vs_backprop"] == rows["checkpoint,mst"]["matmul_vs_backprop"]
    assert rows["fpdt,mst"]["matmul_vs_backprop"] > rows["checkpoint,mst"]["matmul_vs_backprop"]  # q/k/v again
    kept = rows["fpdt:keep_output,mst"]
    assert kept["attention_forward_calls"] == kept["attention_backward_calls"] == rows["fpdt,mst"]["attention_forward_calls"] // 2
    assert rows["checkpoint,mst"]["attention_forward_calls"] == 2 and (tmp_path / "step_work.md").exists()


def test_expert_peers_interleaved_rounds_and_the_device_cap_run_in_the_smoke_test(tmp_path):
    """The peers experts run: selective checkpointing keeps attention's outputs (the forward
    kernel runs once per layer, not twice as under HF's checkpointing); TRL's offloading is
    refused on a CPU, as a limit; two rounds pool every timed step; --device-memory is
    recorded in every row and the report (enforced on CUDA only)."""
    cases = "hf,hf+sac,hf+top,hf+trl-offload"
    result = subprocess.run([sys.executable, "benchmarks/gpu_peers.py", "--smoke", "--cases", cases, "--lengths", "128",
                             "--rounds", "2", "--device-memory", "1GiB", "--out", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_peers.json").read_text())
    rows = {r["case"]: r for r in report["rows"]}
    forward = "_scaled_dot_product_flash_attention_for_cpu ×"
    count = {case: int(rows[case]["attention_ops"].split(forward)[1].split(",")[0]) for case in ("hf", "hf+sac")}
    assert count["hf"] == 2 * count["hf+sac"] == 4  # two layers: recomputed under HF's checkpointing, kept under SAC
    assert rows["hf+trl-offload"]["status"].startswith("refused: TRL's activation offloading")
    for case in ("hf", "hf+sac", "hf+top"):
        assert rows[case]["status"] == "ok" and len(rows[case]["step_times"]) == 4  # 2 rounds × 2 steps
        assert rows[case]["device_cap_gib"] == 1.0 and rows[case]["spread_pct"] >= 0 and rows[case]["rounds"] == 2
        assert rows[case]["device"] == "cpu"
    assert "layers unchecked" in rows["hf+top"]["notes"]
    assert report["meta"]["device_cap_gib"] == 1.0 and report["meta"]["rounds"] == 2
    assert "Rows with a `cap GiB` (1.0) name the cap they were asked for (on the CPU it is recorded, not enforced)" \
        in (tmp_path / "gpu_peers.md").read_text()


def test_best_peer_ratios_compare_rows_under_the_same_cap():
    """A capped row stands for a smaller card: its ratio is over the peers run under that cap."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_peers

    rows = [{"tokens": 8, "case": "hf", "tokens_per_s": 100.0, "device_cap_gib": None},
            {"tokens": 8, "case": "lt:auto", "tokens_per_s": 120.0, "device_cap_gib": None},
            {"tokens": 8, "case": "hf", "tokens_per_s": 50.0, "device_cap_gib": 79.1},
            {"tokens": 8, "case": "lt:auto", "tokens_per_s": 60.0, "device_cap_gib": 79.1}]
    gpu_peers._add_ratios(rows)
    assert [r["vs_best_peer"] for r in rows] == [1.0, 1.2, 1.0, 1.2]


def test_the_top_layers_peer_leaves_what_auto_leaves_whole_unchecked(monkeypatch):
    """hf+top: Hugging Face's checkpointing off in the top N layers, N as auto's
    ``checkpoint:except_last=N`` (here 1 of 2): attention runs three times, not four."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_peers

    monkeypatch.setattr(gpu_peers, "_top_layers_whole", lambda config, length, device, dtype, layers: 1)
    config = gpu_peers._config("tiny-llama", [128])
    model, step = gpu_peers._hf_peer(liger=False, top_whole=True)(config, torch.device("cpu"), torch.float32, 128)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]
    with gpu_peers._AttentionOps() as seen:
        step(torch.randint(0, config.vocab_size, (1, 128)))
    assert seen.seen["_scaled_dot_product_flash_attention_for_cpu"] == 3
    assert step.notes == "top 1 of 2 layers unchecked (auto's except_last)"


def test_the_truncated_depth_benchmark_simulates_what_the_exact_tracker_measures(tmp_path):
    """measured_longest.py --smoke: a two-layer tiny-llama under FPDT with offload and MsT, at a
    length of whole chunks and one that is not: the simulated peak equals the exact tracker's
    to the byte; the full-depth limit is reported with what binds."""
    result = subprocess.run([sys.executable, "benchmarks/measured_longest.py", "--smoke", "--lengths", "256,200",
                             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "measured_longest.json").read_text())
    assert [r["tokens"] for r in report["rows"]] == [256, 200]
    for row in report["rows"]:
        assert row["status"] == "ok" and row["simulated_bytes"] == row["tracker_bytes"] > 0
    assert report["meta"]["full_depth_longest"] > 256 and report["meta"]["binds"]
    assert "Full depth (simulated)" in (tmp_path / "measured_longest.md").read_text()
    assert report["meta"]["optimizer"] == "adamw-offload"  # full fine-tuning as the longest-context table counts it


def test_the_truncated_depth_benchmark_starts_no_length_past_its_budget(tmp_path):
    """Past --budget-s a length is skipped and said so; the full-depth limit is still found and
    the report written (it is written after every length too)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import measured_longest

    assert measured_longest.main(["--smoke", "--lengths", "256", "--budget-s", "0", "--optimizer", "none",
                                  "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "measured_longest.json").read_text())
    assert report["rows"] == [] and report["meta"]["skipped"] == ["256 tokens (time budget of 0 s spent)"]
    assert report["meta"]["full_depth_longest"] > 256 and report["meta"]["optimizer"] == "none"
    # A machine the model states alone do not fit is refused before any step.
    assert measured_longest.main(["--smoke", "--lengths", "256", "--device-memory", "64KiB", "--out", str(tmp_path)]) == 2


def _with_deepspeed() -> dict:
    """The environment of a process that imports DeepSpeed: `make install` puts it in the
    venv's alst folder, apart from the packages every test process imports (where it
    imports, Accelerate imports it on every save_pretrained). Skips where it does not import."""
    env = dict(os.environ)
    apart = Path(sys.prefix) / "alst"
    if apart.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(apart), env.get("PYTHONPATH")]))
    if subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True).returncode:
        pytest.skip("deepspeed does not import here (make install puts it in .venv/alst)")
    return env


_ALST_GRADIENTS = """
import sys, torch
sys.path.insert(0, "benchmarks")
import gpu_peers
gpu_peers.ALST_LOGITS_SHARD = 256 * 320 * 4 // 3 + 1  # 3 loss shards: 86, 86, 84 tokens
config = gpu_peers._config("tiny-llama", [256])
ids = torch.randint(0, config.vocab_size, (1, 256))
grads = {}
for name in ("hf", "hf+alst"):
    torch.manual_seed(0)
    model, step = gpu_peers.BY_NAME[name].make(config, torch.device("cpu"), torch.float32, 256)
    step(ids)
    grads[name] = {n: p.grad for n, p in model.named_parameters()}
assert "TiledFusedLogitsLoss in 3 shard(s)" in step.notes, step.notes
assert all(g is not None for g in grads["hf+alst"].values())
for name, grad in grads["hf"].items():
    torch.testing.assert_close(grads["hf+alst"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
print("same gradients")
"""


def test_the_alst_peer_runs_in_the_smoke_test_with_the_gradients_of_stock_hugging_face(tmp_path):
    """hf+alst: DeepSpeed's TiledMLP (4 shards of 64 tokens at 256), TiledFusedLogitsLoss and
    its checkpoint-input offloader (nothing to move on a CPU) give every parameter the
    gradient stock Hugging Face gives it, loss in uneven shards included."""
    env = _with_deepspeed()
    result = subprocess.run([sys.executable, "benchmarks/gpu_peers.py", "--smoke", "--cases", "hf+alst", "--lengths", "256",
                             "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [row] = json.loads((tmp_path / "gpu_peers.json").read_text())["rows"]
    assert row["case"] == "hf+alst" and row["status"] == "ok" and row["tokens_per_s"] > 0
    assert row["notes"].startswith("deepspeed ") and "TiledMLP in 4 shards" in row["notes"]
    result = subprocess.run([sys.executable, "-c", _ALST_GRADIENTS], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "same gradients" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


def test_the_alst_peer_is_refused_in_one_line_where_deepspeed_does_not_import(tmp_path, monkeypatch):
    """deepspeed is optional: where it does not import, hf+alst is refused (a limit, not a
    crash) with what to install, the other cases run, and the sweep exits 0."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ModuleNotFoundError
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_peers

    code = gpu_peers.main(["--smoke", "--cases", "hf,hf+alst", "--lengths", "128", "--budget-s", "1e6",
                           "--out", str(tmp_path)])
    assert code == 0
    rows = {r["case"]: r for r in json.loads((tmp_path / "gpu_peers.json").read_text())["rows"]}
    assert rows["hf"]["status"] == "ok"
    status = rows["hf+alst"]["status"]
    assert status.startswith("refused: DeepSpeed is not installed") and status.endswith("pip install deepspeed")
    assert "\n" not in status and rows["hf+alst"]["step_s"] is None


def test_gpu_peers_refuses_what_it_would_ignore_or_cannot_read_in_one_line(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_peers

    for argv, said in ((["--lengths", "12x"], "gpu_peers: --lengths: cannot read token count '12x'"),
                       (["--lengths", "-5"], "gpu_peers: --lengths: "),
                       (["--model", "tiny-qwen2"], "gpu_peers: --smoke runs tiny-llama, not --model tiny-qwen2")):
        assert gpu_peers.main(["--smoke", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(said) and err.count("\n") == 1, err


def test_gpu_suite_writes_another_cards_peers_apart_from_the_stored_rows(tmp_path):
    """docs/results/gpu_peers.json holds one card's rows (gpu_peers refuses to append another's):
    the suite appends there on that card and writes a folder of its own on any other."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite

    stored = json.loads((ROOT / "docs/results/gpu_peers.json").read_text())["meta"]["device"]
    assert gpu_suite._peers_folder(stored, tmp_path) == gpu_suite.DOCS
    assert gpu_suite._peers_folder("NVIDIA H200", tmp_path) == tmp_path / "peers"
