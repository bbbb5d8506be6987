"""Layer groups over 2 and 3 gloo ranks launched with torchrun equal one process (SSM-ResNet, Mamba, Mamba-2;
embeddings tied and untied)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from adjoint_ranks_worker import build_model_and_batch, case_name

import longtrain as lt
from longtrain.errors import LongtrainError
from longtrain.parallel.layer_groups import layer_ranges

WORKER = Path(__file__).with_name("adjoint_ranks_worker.py")


# (preset, truncate, tied) by rank count; the cases of one rank count run in one launch.
# Three ranks split the four layers unevenly (2, 1, 1), with a middle rank holding neither end.
CASES = {2: [("tiny-ssm", 5, False), ("tiny-mamba", None, False), ("tiny-mamba2", 5, False), ("tiny-mamba", None, True)],
         3: [("tiny-mamba2", None, True), ("tiny-ssm", None, False)]}


def torchrun(ranks: int, out: Path) -> dict[str, list[dict]]:
    """Every case of ``ranks`` in one launch: each rank's results by case name."""
    names = [case_name(truncate, preset, tied) for preset, truncate, tied in CASES[ranks]]
    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent)}
    result = subprocess.run([launcher, "--standalone", f"--nproc-per-node={ranks}", str(WORKER), str(out), *names],
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: [torch.load(out / name / f"rank{r}.pt") for r in range(ranks)] for name in names}


@pytest.mark.parametrize("ranks", sorted(CASES))
def test_layer_groups_equal_one_process(tmp_path, ranks):
    """Two micro-batches accumulated; every gradient and the loss equal this process's to
    float64 rounding (relative 1e-12), a tied embedding's two copies (rank 0's, the last
    rank's) carrying the one-process gradient. Not bit for bit: the reference runs in this
    process and the ranks in others, with their own thread counts (pytest's, one per rank),
    and a BLAS matmul may split its sums differently with another thread count or memory
    alignment — the same float64 values summed in another order. The two tied copies are
    compared bit for bit: both ranks form them from the same two tensors with the same
    additions (``LayerGroup.sum_tied``), so they agree in every bit wherever they run."""
    launched = torchrun(ranks, tmp_path)
    for preset, truncate, tied in CASES[ranks]:
        assert_equal_to_one_process(launched[case_name(truncate, preset, tied)], preset, truncate, tied)


def assert_equal_to_one_process(results: list[dict], preset: str, truncate: int | None, tied: bool) -> None:
    model, batches, options = build_model_and_batch(truncate, preset, tied)
    applied = lt.apply(model, lt.Strategy(engine="adjoint", engine_options=options))
    loss = torch.stack([lt.step(applied, batch) for batch in batches])
    single = {name: p.grad for name, p in model.named_parameters()}
    merged = {}
    for result in results:
        assert not merged.keys() & result["grads"].keys(), "a parameter is held by two ranks"
        merged.update(result["grads"])
        torch.testing.assert_close(result["loss"].to(loss.dtype), loss, rtol=1e-12, atol=0)
    embedding = model.get_input_embeddings().weight.numel()
    if tied:  # the head's copy on the last rank: the same gradient as the embedding's on rank 0
        assert torch.equal(merged.pop("lm_head.weight"), merged[next(k for k in single if "embed" in k)])
    assert merged.keys() == single.keys()
    for name, grad in single.items():
        # Relative to the tensor's norm: an element summed from terms that cancel has no relative precision.
        error = float((merged[name] - grad).norm() / grad.norm().clamp_min(1e-300))
        assert error <= 1e-12, (preset, truncate, tied, name, error)
    # Each rank holds a share of the parameters, not all of them.
    total = sum(p.numel() for p in model.parameters())
    assert max(r["parameters"] for r in results) < total
    assert sum(r["parameters"] for r in results) == total + tied * embedding


def test_layer_ranges_are_balanced_and_refuse_too_many_ranks():
    assert layer_ranges(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(LongtrainError, match="at most 3"):
        layer_ranges(3, 4)


def test_torchrun_training_equals_one_process_and_resumes_bit_for_bit(tmp_path):
    """``longtrain train --engine adjoint`` under torchrun (2 layer groups) trains the same
    weights as one process, and a resumed 2-process run matches an uninterrupted one, bit for
    bit. Every run is a fresh process with the same pins: one intra-op thread
    (OMP_NUM_THREADS=1 in each one's environment, so no BLAS call splits its sums by thread
    count), the same seed and data order, on this machine; the ranks run the same
    operations on the same tensors as the one process."""
    from safetensors.torch import load_file

    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["train", "--model", "ssm-demo", "--engine", "adjoint", "--seq-len", "128", "--save-every", "4",
            "--eval-samples", "1", "--no-progress", "--lr", "1e-2", "--warmup-steps", "2"]

    def run(out, steps, ranks=1, *extra):
        prefix = [sys.executable, "-m"] if ranks == 1 else [launcher, "--standalone", f"--nproc-per-node={ranks}", "-m"]
        cmd = prefix + ["longtrain.cli", *args, "--steps", str(steps), "--out", str(tmp_path / out), *extra]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        return load_file(str(tmp_path / out / "final" / "model.safetensors"))

    one = run("one", 8)
    two = run("two", 8, 2)
    resumed = run("resumed", 8, 2, "--resume-from", str(tmp_path / "two" / "checkpoints" / "step-00000004"))
    assert one.keys() == two.keys() == resumed.keys()
    assert [k for k in one if not torch.equal(one[k], two[k])] == []
    assert [k for k in one if not torch.equal(two[k], resumed[k])] == []
    manifest = (tmp_path / "two" / "checkpoints" / "step-00000008" / "manifest.json").read_text()
    assert "weights-rank1.safetensors" in manifest
    losses = [json.loads(line)["loss"] for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses[-1] < losses[0] - 0.5  # the adjoint engine trains: the loss falls


def test_torchrun_trains_a_tied_mamba_as_one_process(tmp_path):
    """A saved Mamba whose head is its embedding (as published) trains under 2 layer groups
    to the weights one process reaches, reports the same gradient norms (the head's copy
    counted once), and its final/ reloads tied. The weights are compared bit for bit: both
    runs are fresh processes pinned alike (OMP_NUM_THREADS=1 in each one's environment: one
    intra-op thread, no BLAS sum split by thread count; same seed and data, this machine)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from longtrain.models.loading import build_from_config
    from longtrain.models.presets import preset_config

    torch.manual_seed(0)
    build_from_config(preset_config("tiny-mamba", num_hidden_layers=2, vocab_size=320), torch.float32).save_pretrained(
        tmp_path / "mamba")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["state space models scan long sequences"] * 30))
    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["train", "--model", str(tmp_path / "mamba"), "--engine", "adjoint", "--seq-len", "64", "--steps", "2",
            "--grad-accum", "2", "--data", str(text), "--tokenizer", "bytes", "--no-progress", "--lr", "1e-2"]

    def run(out, ranks):
        prefix = [sys.executable, "-m"] if ranks == 1 else [launcher, "--standalone", f"--nproc-per-node={ranks}", "-m"]
        result = subprocess.run(prefix + ["longtrain.cli", *args, "--out", str(tmp_path / out)], env=env,
                                capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        norms = [json.loads(line)["grad_norm"] for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()
                 if '"grad_norm"' in line]
        return load_file(str(tmp_path / out / "final" / "model.safetensors")), norms

    (one, one_norms), (two, two_norms) = run("one", 1), run("two", 2)
    assert one.keys() == two.keys()
    assert [k for k in one if not torch.equal(one[k], two[k])] == []
    # (the squares summed per rank first: equal to float64 rounding; clipping ran, the norms are over 1)
    assert len(one_norms) == 2 and min(one_norms) > 1 and two_norms == pytest.approx(one_norms, rel=1e-12)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final")
    assert reloaded.lm_head.weight is reloaded.get_input_embeddings().weight
