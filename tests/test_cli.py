"""The command line end to end: training, resuming after a kill, simulation, and one
clear line for each kind of bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longtrain.cli import main
from longtrain.train.metrics import read_metrics

TINY = ["--model", "tiny-llama", "--seq-len", "256", "--eval-samples", "2", "--no-progress"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_writes_metrics_checkpoints_summary_and_final_model(tmp_path, capsys):
    code, out, err = run_cli(capsys, "train", *TINY, "--steps", "6", "--save-every", "3", "--out", str(tmp_path), "--batch-size", "2", "--grad-accum", "2")
    assert code == 0, err
    assert "pass-key accuracy" in out and "simulated stock peak" in out
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert all(r["peak_bytes"] > 0 for r in steps)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["simulated_stock_peak_bytes"] > 0
    assert summary["optimizer"] == "adamw"  # which AdamW ran: the run's settings say (float32 masters for 16-bit weights)
    assert summary["attention_kernel"] == "flash" and summary["measured_reserved_bytes"] is None  # CPU: its flash kernel
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000006"
    assert (tmp_path / "final" / "config.json").exists()
    assert (tmp_path / "metrics.png").exists() or "no metrics.png" in out  # matplotlib is an extra
    # The exported model trains again as a local model directory; --data runs report a held-out loss.
    code, out, err = run_cli(capsys, "train", "--model", str(tmp_path / "final"), "--data", str(Path(__file__)),
                             "--seq-len", "128", "--steps", "1", "--no-progress", "--out", str(tmp_path / "again"))
    assert code == 0, err
    assert "held-out loss" in out
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["task"]["loss"] > 0


def test_lora_and_checkpoint_strategy_train(tmp_path, capsys):
    """A LoRA run's final/ is the merged model; final/adapter loads with peft onto the
    base it names (a preset's random base is saved in final/base) and gives the same logits."""
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    code, _, err = run_cli(capsys, "train", *TINY, "--steps", "2", "--lora", "--strategy", "checkpoint,mst", "--out", str(tmp_path))
    assert code == 0, err
    assert err == ""  # no third-party progress bars or advice ("Writing model shards", peft's warnings)
    final = tmp_path / "final"
    assert json.loads((final / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(final / "base")
    ids = torch.randint(0, 259, (1, 16))
    merged = AutoModelForCausalLM.from_pretrained(final)(ids).logits
    adapted = AutoPeftModelForCausalLM.from_pretrained(final / "adapter")(ids).logits
    torch.testing.assert_close(merged, adapted)
    # ... and trains again as a model directory.
    code, _, err = run_cli(capsys, "train", "--model", str(final), "--data", str(Path(__file__)), "--seq-len", "64",
                           "--steps", "1", "--no-progress", "--lora", "--eval-samples", "1", "--out", str(tmp_path / "again"))
    assert code == 0, err
    assert err == ""  # nor transformers' "Loading weights" bar


@pytest.mark.parametrize("extra", [
    ["--strategy", "mst", "--engine", "fpdt:chunk=64:offload=true:host_memory=1GiB"],
    ["--engine", "seco:chunk=100"],
    ["--engine", "spaco:cap=2:chunk=32:budget=2"],
])
def test_chunked_engines_train_from_the_command_line(extra, tmp_path, capsys):
    code, out, err = run_cli(capsys, "train", *TINY, "--steps", "3", "--out", str(tmp_path), *extra)
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"]
    engine = extra[extra.index("--engine") + 1].split(":")[0]
    assert summary["strategy"].startswith(engine + ":")
    if "offload=true" in extra[-1]:
        assert "parked chunks" in out and "same memory as the device" in out  # on CPU, host and device are one memory


def test_packed_documents_train_with_position_resets(tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}: " + "words " * (7 * i + 3)}) + "\n" for i in range(40)))
    code, _, err = run_cli(capsys, "train", "--model", "tiny-llama", "--seq-len", "256", "--no-progress", "--steps", "2",
                           "--data", str(docs), "--packing", "documents", "--engine", "seco:chunk=100", "--out", str(tmp_path / "run"))
    assert code == 0, err


def test_spaco_resumes_drawing_the_same_chunks(tmp_path, capsys):
    """SpaCO's chunk draw comes from the global RNG, which checkpoints restore: a run
    resumed from step 3 reproduces steps 4-6 of the uninterrupted run."""
    spaco = ["--engine", "spaco:chunk=32:budget=2", "--steps", "6", "--save-every", "3", "--keep-checkpoints", "3"]
    code, _, err = run_cli(capsys, "train", *TINY, *spaco, "--out", str(tmp_path / "ref"))
    assert code == 0, err
    code, _, err = run_cli(capsys, "train", *TINY, *spaco, "--out", str(tmp_path / "resumed"),
                           "--resume-from", str(tmp_path / "ref" / "checkpoints" / "step-00000003"))
    assert code == 0, err

    def losses(path):
        return {r["step"]: r["loss"] for r in read_metrics(path / "metrics.jsonl") if "loss" in r}

    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "resumed")
    assert [got[s] for s in (4, 5, 6)] == [ref[s] for s in (4, 5, 6)]


def _train_process(out, *extra):
    cmd = [sys.executable, "-m", "longtrain.cli", "train", *TINY, "--steps", "40", "--save-every", "4", "--out", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_killed_run_resumes_onto_the_same_loss_curve(tmp_path):
    reference = _train_process(tmp_path / "ref")
    assert reference.wait(timeout=300) == 0, reference.stderr.read().decode()

    victim = _train_process(tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and time.time() < deadline and victim.poll() is None:
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)  # no chance to clean up
    victim.wait()
    killed_at = int(latest.read_text().split("-")[1])
    assert killed_at < 40, "the run finished before it could be killed"
    resumed = _train_process(tmp_path / "run", "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()

    def losses(path):
        return [(r["step"], r["loss"]) for r in read_metrics(path / "metrics.jsonl") if "loss" in r]

    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "run")
    assert [s for s, _ in got] == list(range(1, 41))
    for (_, a), (_, b) in zip(ref, got):
        assert abs(a - b) <= 1e-6 * abs(a)


def test_simulate_json(capsys):
    code, out, _ = run_cli(capsys, "simulate", "--model", "tiny-llama", "--seq-len", "1K", "--strategy", "checkpoint", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["seq_len"] == 1024
    assert report["peak"]["peak_device_bytes"] > report["peak"]["by_category"]["parameters"]["device"] > 0


def test_simulate_table(capsys):
    code, out, _ = run_cli(capsys, "simulate", "--model", "Llama-3-8B", "--seq-len", "512", "--optimizer", "none")
    assert code == 0
    assert "parameters" in out and "14.96 GiB" in out


BAD_INPUTS = [
    (["train", "--model", "llama-9000"], "unknown model preset 'llama-9000'"),
    (["train", "--model", "./no/such/dir"], "does not exist"),
    (["train", *TINY, "--seq-len", "0"], "--seq-len must be a positive integer"),
    (["train", *TINY, "--seq-len", "64M"], "exceeds the per-sample limit"),
    (["train", *TINY, "--strategy", "warp-drive"], "unknown technique 'warp-drive'"),
    (["train", *TINY, "--data", "/no/such/file.txt"], "does not exist"),
    (["simulate", "--model", "nope", "--seq-len", "1024"], "unknown model preset"),
    (["simulate", "--model", "tiny-llama", "--seq-len", "1"], "at least 2"),
    (["train", *TINY, "--engine", "spaco:budget=0"], "budget must be a positive integer"),
    (["train", *TINY, "--engine", "fpdt:chunk=64:offload=true:host_memory=1KiB"], "host memory"),
    (["train", *TINY, "--strategy", "attention:chunk=64"], "now the 'fpdt' engine"),
    (["train", *TINY, "--strategy", "checkpoint", "--engine", "fpdt"], "drop 'checkpoint'"),
    (["train", *TINY, "--engine", "fpdt:offload=maybe"], "offload must be true or false"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS)
def test_bad_input_gets_one_clear_line(argv, message, capsys, tmp_path):
    code, _, err = run_cli(capsys, *argv, *(["--out", str(tmp_path)] if argv[0] == "train" else []))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("longtrain: error: ")
    assert message in err


def test_data_problems(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    code, _, err = run_cli(capsys, "train", *TINY, "--data", str(short), "--out", str(tmp_path / "a"))
    assert code == 2 and "fewer than --seq-len 256" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    code, _, err = run_cli(capsys, "train", *TINY, "--data", str(bad), "--out", str(tmp_path / "b"))
    assert code == 2 and "line 2" in err
    unreadable = tmp_path / "locked.txt"
    unreadable.write_bytes(b"\xff\xfe\x00binary")
    code, _, err = run_cli(capsys, "train", *TINY, "--data", str(unreadable), "--out", str(tmp_path / "c"))
    assert code == 2 and "cannot read data file" in err


def test_resume_problems(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(capsys, "train", *TINY, "--steps", "2", "--save-every", "1", "--out", str(out))[0] == 0
    code, _, err = run_cli(capsys, "train", *TINY, "--steps", "2", "--out", str(out))
    assert code == 2 and "already holds a run" in err
    code, _, err = run_cli(capsys, "train", *TINY, "--steps", "3", "--seq-len", "128", "--resume", "--out", str(out))
    assert code == 2 and "seq_len=256" in err
    weights = out / "checkpoints" / "step-00000002" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])
    code, _, err = run_cli(capsys, "train", *TINY, "--steps", "3", "--resume", "--out", str(out))
    assert code == 2 and "corrupt" in err and "weights.safetensors" in err
    code, _, err = run_cli(capsys, "train", *TINY, "--steps", "3", "--resume-from", str(tmp_path / "empty"), "--out", str(out))
    assert code == 2 and "neither a checkpoint" in err


def _first_sample(tmp_path, packing: str):
    """Documents of 5, 9, 3 and 30 bytes in 16-token windows: the windows, the first
    training sample and that sample's position ids."""
    from longtrain.train.data import TokenWindows
    from longtrain.train.tokenizer import ByteTokenizer

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in (5, 9, 3, 30)))
    windows = TokenWindows(docs, ByteTokenizer(), seq_len=16, packing=packing)
    rows = {tuple(windows.windows[i].tolist()): i for i in range(len(windows))}
    first = windows.sample(0)
    return windows, first, windows.positions[rows[tuple(first["input_ids"].tolist())]]


def test_document_packing_restarts_positions_and_drops_cross_document_targets(tmp_path):
    windows, first, positions = _first_sample(tmp_path, "documents")
    assert positions[0] == 0 and ((positions[1:] == positions[:-1] + 1) | (positions[1:] == 0)).all()
    assert (first["labels"][positions == 0] == -100).all() and (first["labels"][positions != 0] >= 0).all()
    # documents of 5 and 9 bytes (each + EOS) then the third: window 0 restarts at 0, 6, 16...
    assert windows.positions[0].tolist()[:8] == [0, 1, 2, 3, 4, 5, 0, 1]


def test_best_fit_packing_keeps_documents_whole_and_restarts_positions(tmp_path):
    from longtrain.train.tokenizer import ByteTokenizer

    windows, first, positions = _first_sample(tmp_path, "best-fit")
    real = first["input_ids"] != ByteTokenizer.PAD  # a window's end may be padding, without labels
    assert positions[0] == 0 and ((positions[1:] == positions[:-1] + 1) | (positions[1:] == 0)).all()
    assert (first["labels"][positions == 0] == -100).all() and (first["labels"][real & (positions != 0)] >= 0).all()
    assert (first["labels"][~real] == -100).all()
    # documents of 5 and 9 bytes (each + EOS) fill one window whole (best fit): positions 0…5, then 0…9
    assert list(range(6)) + list(range(10)) in windows.positions.tolist()
