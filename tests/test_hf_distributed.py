"""LongtrainTrainer under several processes (torchrun, accelerate launch; gloo on CPU):
plain data parallel, each process training the whole model on its own micro-batches, and
FSDP2 (the Trainer's ``fsdp``/``fsdp_config``), equal one process of the stock Trainer on the
same global batch. Float64 tiny-llama, two AdamW
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


def launch(command: list[str], out: Path, accumulation: int, runs: dict, **env_vars: str) -> dict:
    """``runs``: {(kind, name): strategy}, run one after another in each process of one launch
    (a name ``NAME@1`` stops after its first step, saving a checkpoint)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent), "HF_HUB_OFFLINE": "1", **env_vars}
    args = command + [str(WORKER), str(out), str(accumulation)] + [f"{k}/{n}={s}" for (k, n), s in runs.items()]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {(kind, name): torch.load(out / f"{kind}-{name.partition('@')[0]}.pt") for kind, name in runs}


def torchrun(processes: int) -> list[str]:
    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    return [launcher, "--standalone", f"--nproc-per-node={processes}"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The stock Trainer in one process, accumulating the four micro-batches of each step."""
    found = launch([sys.executable], tmp_path_factory.mktemp("one"), 4, {(kind, "stock"): "stock" for kind in ("full", "lora", "unlabelled")})
    return {kind: result for (kind, _), result in found.items()}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """`torchrun --nproc-per-node 2`, two accumulated micro-batches per process: every strategy
    in full fine-tuning; LoRA; a run whose second process has no label token in its last
    micro-batch of the first step; and a run stopped after its first step (a checkpoint)."""
    out = tmp_path_factory.mktemp("two")
    runs = {**{("full", name): strategy for name, strategy in STRATEGIES.items()},
            ("lora", "checkpoint"): "checkpoint,mst", ("lora", "fpdt"): "fpdt:chunk=32",
            ("unlabelled", "checkpoint"): "checkpoint,mst", ("unlabelled", "metrics"): "seco:chunk=32",
            ("full", "first@1"): "checkpoint,mst"}
    return launch(torchrun(2), out, 2, runs), out


def assert_same_training(ours: dict, stock: dict) -> None:
    assert ours["params"].keys() == stock["params"].keys() and ours["params"]
    for name, expected in stock["params"].items():
        torch.testing.assert_close(ours["params"][name], expected, rtol=1e-10, atol=1e-12, msg=name)
    assert ours["losses"] == pytest.approx(stock["losses"], rel=1e-6)  # logged in float32


def test_data_parallel_over_two_processes_equals_one_process(one_process, two_processes):
    """Every strategy, full and LoRA; the process whose last micro-batch has no label token
    skips its backward but joins the gradient sum, and — where TRL's token metrics are
    logged — their gathering (the step counts none there, the other process some)."""
    stock = one_process
    for (kind, name), result in two_processes[0].items():
        if name != "first@1":
            assert_same_training(result, stock[kind])
    metrics = two_processes[0][("unlabelled", "metrics")]["metrics"]
    assert len(metrics["entropy"]) == len(metrics["mean_token_accuracy"]) == 4  # a value per micro-batch
    assert all(e > 0 for e in metrics["entropy"]) and all(0 <= a <= 1 for a in metrics["mean_token_accuracy"])
    assert metrics["num_tokens"][0] > 0


def test_fsdp2_over_two_processes_equals_one_process(one_process, tmp_path):
    """The Trainer's FSDP2 (each decoder layer a unit, the embeddings and the final norm with
    the head carved out by Accelerate) under `torchrun --nproc-per-node 2`: the whole-sequence
    strategies, full and LoRA (whose final norm stays in the root: gathered by the step); the
    chunked engines, whose micro-batches are padded to the longest process's so that each
    calls its units as often (micro-batch 6, of 32 tokens, is one 32-token chunk; the other
    process's, of 48, two); and a process whose last micro-batch has no label token (it runs
    its step all the same, so that the units' gathers and reductions meet), with TRL's token
    metrics gathered."""
    runs = {("full", "checkpoint"): "checkpoint,mst", ("full", "memo"): "memo", ("full", "fpdt"): "fpdt:chunk=32",
            ("full", "seco"): "seco:chunk=32", ("lora", "checkpoint"): "checkpoint,mst",
            ("unlabelled", "checkpoint"): "checkpoint,mst", ("unlabelled", "metrics"): "fpdt:chunk=32"}
    for (kind, _), result in launch(torchrun(2), tmp_path, 2, runs, FSDP="1").items():
        assert_same_training(result, one_process[kind])


def test_a_checkpoint_resumes_under_another_process_count(one_process, two_processes, tmp_path):
    """A run saved after its first step under two processes goes on in one (the same global
    batch: four micro-batches a step) to the parameters and second loss of an uninterrupted
    one-process run; the checkpoint loads in stock Transformers."""
    runs, out = two_processes
    saved = runs[("full", "first@1")]
    checkpoint = out / "full-first" / "checkpoint-1"
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)  # loads in stock Transformers
    assert all(torch.equal(p, saved["params"][n]) for n, p in stock.named_parameters())
    resumed = launch([sys.executable], tmp_path, 4, {("full", "resumed"): "checkpoint,mst"},
                     RESUME=str(checkpoint))[("full", "resumed")]
    assert_resumed(resumed, one_process["full"])


@pytest.fixture(scope="module")
def sequence_parallel(tmp_path_factory):
    """`torchrun --nproc-per-node 2` with ``ParallelismConfig(sp_size=2)``: one group of two
    processes sharing each micro-batch, four accumulated a step (the one process's global
    batch); a run stopped after its first step (a checkpoint)."""
    out = tmp_path_factory.mktemp("sp")
    runs = {("full", "checkpoint"): "checkpoint,mst", ("full", "seco"): "seco:chunk=32", ("lora", "fpdt"): "fpdt:chunk=32",
            ("unlabelled", "metrics"): "fpdt:chunk=32", ("full", "first@1"): "fpdt:chunk=32"}
    return launch(torchrun(2), out, 4, runs, SP="2"), out


def test_sequence_parallel_inside_the_trainer_equals_one_process(one_process, sequence_parallel, tmp_path):
    """Ulysses over the two processes of a group (FSDP2 sharding the model over both): whole-
    sequence and chunked engines, full and LoRA, a micro-batch without a label token, TRL's
    token metrics; the checkpoint (the model's and the optimizer's shards gathered whole)
    loads in stock Transformers and goes on in one process to the uninterrupted run."""
    runs, out = sequence_parallel
    for (kind, name), result in runs.items():
        if name != "first@1":
            assert_same_training(result, one_process[kind])
        if name != "first@1":  # each process evaluates its own batches whole; their losses gathered
            assert result["eval_loss"] == pytest.approx(one_process[kind]["eval_loss"], rel=1e-6)
    metrics = runs[("unlabelled", "metrics")]["metrics"]
    assert len(metrics["entropy"]) == 8 and all(0 <= a <= 1 for a in metrics["mean_token_accuracy"])
    checkpoint = out / "full-first" / "checkpoint-1"
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    assert all(torch.equal(p, runs[("full", "first@1")]["params"][n]) for n, p in stock.named_parameters())
    resumed = launch([sys.executable], tmp_path, 4, {("full", "resumed"): "checkpoint,mst"}, RESUME=str(checkpoint))
    assert_resumed(resumed[("full", "resumed")], one_process["full"])


def test_accelerate_launch_runs_sequence_parallel_groups_and_resumes_under_another_count(one_process, sequence_parallel,
                                                                                      tmp_path):
    """Four processes started by `accelerate launch --multi_gpu --num_processes 4` (torchrun's
    launcher underneath; on a machine without GPUs the training arguments' use_cpu makes it
    gloo) in two groups of two (2 × 2, two micro-batches a group a step): the run saved by one
    group of two goes on here to the uninterrupted one-process run."""
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    command = [launcher, "launch", "--multi_gpu", "--num_processes", "4", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", "0"]
    checkpoint = sequence_parallel[1] / "full-first" / "checkpoint-1"
    resumed = launch(command, tmp_path, 2, {("full", "resumed"): "fpdt:chunk=32"}, SP="2", RESUME=str(checkpoint))
    assert_resumed(resumed[("full", "resumed")], one_process["full"])


def assert_resumed(resumed: dict, whole: dict) -> None:
    for name, expected in whole["params"].items():
        torch.testing.assert_close(resumed["params"][name], expected, rtol=1e-10, atol=1e-12, msg=name)
    assert resumed["losses"][-1] == pytest.approx(whole["losses"][-1], rel=1e-6)


def test_sequence_parallel_is_set_as_hugging_face_sets_it():
    """The degree comes from ``parallelism_config``'s sp_size; a strategy's ``+spN``, and the
    parallelism longtrain does not run inside the Trainer, are refused in one line."""
    from accelerate import ParallelismConfig

    from longtrain import LongtrainError
    from longtrain.hf import _parse_strategy
    from longtrain.hf_sequence_parallel import degree_of

    assert degree_of(None) is None and degree_of(ParallelismConfig(sp_size=1)) is None
    assert degree_of(ParallelismConfig(sp_size=4)) == 4
    with pytest.raises(LongtrainError, match=r"drop \+sp2 and set parallelism_config=ParallelismConfig\(sp_size=2\)"):
        _parse_strategy("checkpoint,mst+sp2")
    with pytest.raises(LongtrainError, match="tp_size=2 is not supported inside the Trainer"):
        degree_of(ParallelismConfig(tp_size=2))


def test_a_groups_micro_batches_reach_each_of_its_processes_in_rank_order_and_resume_past_a_skip(monkeypatch):
    """GroupBatches, its all-gather stood in for (rank 1 of the group read each batch + 100):
    every micro-batch of the group in rank order, and the Trainer's skip on resumption (by
    micro-batches, as many as it counts) landing inside a gathered round; processes of a
    group reading different numbers of micro-batches are refused in one line."""
    import torch.distributed as dist

    from longtrain import LongtrainError
    from longtrain.hf_sequence_parallel import GroupBatches

    def all_gather_object(every, mine, group=None):
        every[:] = [mine, mine + lag if isinstance(mine, int) else {k: v + 100 for k, v in mine.items()}]

    lag = 0

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    loader = torch.utils.data.DataLoader([{"input_ids": torch.tensor([k])} for k in range(3)], batch_size=1)
    whole = [int(b["input_ids"]) for b in GroupBatches(loader, None, 2, 0)]
    assert whole == [0, 100, 1, 101, 2, 102] and len(GroupBatches(loader, None, 2, 0)) == 6
    for n in range(6):
        assert [int(b["input_ids"]) for b in GroupBatches(loader, None, 2, 0).skip(n)] == whole[n:]
    lag = 1  # the other process reads one micro-batch more: one line, before any gather of batches
    with pytest.raises(LongtrainError, match=r"read \[3, 4\] micro-batches per epoch"):
        next(iter(GroupBatches(loader, None, 2, 0)))


def test_the_loss_normaliser_of_a_group_is_the_stock_data_parallel_ones():
    """Counted over every process, the Trainer's count (divided by the group's size) is the
    step's; counted per process, it is multiplied back and the groups' means are averaged."""
    from longtrain.hf_sequence_parallel import group_loss_normaliser

    def rule(labels, num_items):  # the one-process rule: the Trainer's count, else 10 own tokens × 4 steps
        return 40 if num_items is None else int(num_items)

    assert group_loss_normaliser(rule, None, 96, True, 2, 3) == 96
    assert group_loss_normaliser(rule, None, 24.5, False, 2, 3) == 49 * 3
    assert group_loss_normaliser(rule, None, None, False, 2, 3) == 40 * 3
