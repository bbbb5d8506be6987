"""LongtrainTrainer under several processes (torchrun, accelerate launch; gloo on CPU):
plain data parallel, each process training the whole model on its own micro-batches, equals
one process of the stock Trainer on the same global batch. Float64 tiny-llama, two AdamW
steps, packed and padded micro-batches with completion-only labels, a chunk that does not
divide them (tests/hf_ddp_worker.py). Not bit for bit: the reference runs in another process
with its own thread count, and the processes sum their gradients in another order."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

WORKER = Path(__file__).with_name("hf_ddp_worker.py")
STRATEGIES = {"checkpoint": "checkpoint,mst", "fpdt": "fpdt:chunk=32", "memo": "memo", "seco": "seco:chunk=32"}


def launch(command: list[str], out: Path, accumulation: int, kind: str, runs: dict, **env_vars: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent), "HF_HUB_OFFLINE": "1", **env_vars}
    args = command + [str(WORKER), str(out), str(accumulation), kind] + [f"{n}={s}" for n, s in runs.items()]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: torch.load(out / f"{name}.pt") for name in runs}


def torchrun(processes: int) -> list[str]:
    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    return [launcher, "--standalone", f"--nproc-per-node={processes}"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The stock Trainer in one process, accumulating the four micro-batches of each step."""
    out = tmp_path_factory.mktemp("one")
    return {kind: launch([sys.executable], out / kind, 4, kind, {"stock": "stock"})["stock"]
            for kind in ("full", "lora", "unlabelled")}


def assert_same_training(ours: dict, stock: dict) -> None:
    assert ours["params"].keys() == stock["params"].keys() and ours["params"]
    for name, expected in stock["params"].items():
        torch.testing.assert_close(ours["params"][name], expected, rtol=1e-10, atol=1e-12, msg=name)
    assert ours["losses"] == pytest.approx(stock["losses"], rel=1e-6)  # logged in float32


def test_data_parallel_over_two_processes_equals_one_process(one_process, tmp_path):
    """Every strategy, full fine-tuning: two accumulated micro-batches per process."""
    for name, result in launch(torchrun(2), tmp_path, 2, "full", STRATEGIES).items():
        assert_same_training(result, one_process["full"])


def test_data_parallel_lora_and_four_processes_equal_one_process(one_process, tmp_path):
    """LoRA over two processes; full fine-tuning over four, one micro-batch each per step."""
    lora = launch(torchrun(2), tmp_path / "lora", 2, "lora", {"checkpoint": "checkpoint,mst", "fpdt": "fpdt:chunk=32"})
    for result in lora.values():
        assert_same_training(result, one_process["lora"])
    four = launch(torchrun(4), tmp_path / "four", 1, "full", {"checkpoint": "checkpoint,mst"})
    assert_same_training(four["checkpoint"], one_process["full"])


def test_a_process_without_labels_in_its_last_micro_batch_still_reduces(one_process, tmp_path):
    """The second process's last micro-batch of the first step has no label token: its step
    skips the backward but joins the gradient sum, and the run equals one process."""
    result = launch(torchrun(2), tmp_path, 2, "unlabelled", {"checkpoint": "checkpoint,mst"})
    assert_same_training(result["checkpoint"], one_process["unlabelled"])


def test_accelerate_launch_runs_data_parallel(one_process, tmp_path):
    """The same run started by `accelerate launch --multi_gpu --num_processes 2`: on a machine
    without GPUs the training arguments' use_cpu makes it data parallel over gloo (its
    `--cpu` would start one process)."""
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    command = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", "0"]
    result = launch(command, tmp_path, 2, "full", {"fpdt": "fpdt:chunk=32"})
    assert_same_training(result["fpdt"], one_process["full"])


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["two-then-one", "one-then-two"])
def test_a_checkpoint_resumes_under_another_process_count(first, then, tmp_path):
    """A run saved after its first step under ``first`` processes goes on under ``then``
    (the same global batch: four micro-batches a step) to the parameters and second loss of
    an uninterrupted one-process run; the checkpoint loads in stock Transformers."""
    runs = {"checkpoint": "checkpoint,mst"}
    whole = launch([sys.executable], tmp_path / "whole", 4, "full", runs)["checkpoint"]
    command = {1: [sys.executable], 2: torchrun(2)}
    saved = launch(command[first], tmp_path / "first", 4 // first, "full", runs, MAX_STEPS="1")["checkpoint"]
    checkpoint = tmp_path / "first" / "checkpoint" / "checkpoint-1"
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)  # loads in stock Transformers
    assert all(torch.equal(p, saved["params"][n]) for n, p in stock.named_parameters())
    resumed = launch(command[then], tmp_path / "then", 4 // then, "full", runs, RESUME=str(checkpoint))["checkpoint"]
    for name, expected in whole["params"].items():
        torch.testing.assert_close(resumed["params"][name], expected, rtol=1e-10, atol=1e-12, msg=name)
    assert resumed["losses"][-1] == pytest.approx(whole["losses"][-1], rel=1e-6)
