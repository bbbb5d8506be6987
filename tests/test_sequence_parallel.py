"""Ulysses sequence parallelism with FSDP2: the head and token layouts, and torchrun runs of
2 and 4 gloo processes whose loss and every gradient equal one process of stock Hugging
Face autograd in float64 (tests/sp_worker.py), and failures that end in one line."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import longtrain as lt
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.parallel.ulysses import HeadLayout, ShardLayout

HERE = Path(__file__).resolve().parent
TOL = 1e-10


@pytest.mark.parametrize("heads,kv_heads,degree", [(32, 8, 8), (4, 2, 4), (10, 2, 4), (6, 6, 4), (3, 1, 2), (4, 4, 8)])
def test_head_layout_gives_every_query_head_to_one_rank_and_its_kv_heads_along(heads, kv_heads, degree):
    group = heads // kv_heads
    seen = []
    for rank in range(degree):
        layout = HeadLayout(heads, kv_heads, degree, rank)
        q, kv = layout.q_heads(rank), layout.kv_heads_of(rank)
        seen += list(q)
        assert all(h // group in kv for h in q)
        index = layout.local_kv_index()
        if index is not None:  # repeated K/V: one per query head, the right one
            assert [kv[i] for i in index] == [h // group for h in q]
        else:
            assert len(q) % max(1, len(kv)) == 0
    assert seen == list(range(heads))
    sizes = [len(HeadLayout(heads, kv_heads, degree, r).q_heads(r)) for r in range(degree)]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("length,degree,chunk", [(101, 4, None), (100, 4, None), (101, 2, 13), (7, 4, 3)])
def test_shard_layout_partitions_the_padded_sequence_and_gathers_contiguous_chunks(length, degree, chunk):
    layout = ShardLayout(length, degree, chunk)
    assert layout.padded >= length and layout.padded % (degree * (chunk or 1)) == 0
    shards = [layout.local_positions(r) for r in range(degree)]
    assert sorted(torch.cat(shards).tolist()) == list(range(layout.padded))
    n = chunk or layout.local_length
    for i, (start, end) in enumerate(layout.gathered_bounds()):  # local chunk i of every rank, in rank order
        gathered = torch.cat([s[i * n:(i + 1) * n] for s in shards])
        assert gathered.tolist() == list(range(start, end))


def test_sequence_parallel_options_are_checked_when_the_strategy_is_built_and_applied():
    with pytest.raises(lt.LongtrainError, match="adjoint engine does not run under sequence parallelism"):
        lt.Strategy(engine="adjoint", sequence_parallel=2)
    with pytest.raises(lt.LongtrainError, match="degree must be a positive integer"):
        lt.Strategy(sequence_parallel={"degree": 0})
    model = build_from_config(preset_config("tiny-llama"))
    with pytest.raises(lt.LongtrainError, match="needs 2 processes: launch with torchrun --nproc-per-node 2"):
        lt.apply(model, lt.Strategy(sequence_parallel=2))
    assert lt.Strategy.parse("checkpoint", sequence_parallel=4).name == "checkpoint+sp4"


def _torchrun(processes: int, cases: str, tmp_path, timeout=300, env=None):
    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    out = tmp_path / f"sp{processes}.json"
    cmd = [launcher, "--standalone", f"--nproc-per-node={processes}", str(HERE / "sp_worker.py"), str(out), cases]
    result = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return result, out


# Each case: model, batch, engine, sequence-parallel degree, full fine-tuning or LoRA.
# Every case steps two accumulated micro-batches; with 4 processes and degree 2, two
# data-parallel groups step different batches. Rows of 101 and 77 tokens divide no degree.
CASES = {
    2: ["llama-gqa2,padded,backprop,2,full", "llama-gqa2,packed,checkpoint+mst,2,full", "mistral-mha3,padded,backprop,2,full",
        "mistral-mha3,packed,fpdt+offload+mst,2,full", "llama-gqa2,packed,seco+checkpoint,2,full",
        "gemma2,padded,fpdt+offload+mst,2,full", "llama-gqa2,padded,checkpoint+mst,2,lora",
        "llama-gqa2,padded,checkpoint+mst/bf16,2,full", "llama-gqa2,padded,fpdt+offload+mst/bf16-params,2,full",
        "qwen3-moe,padded,fpdt+offload+mst,2,full", "gpt-oss,padded,fpdt+offload+mst,2,full"],
    # (2 × 2 with a chunked engine runs inside the Trainer: tests/test_hf_distributed.py)
    4: ["llama-gqa2,packed,fpdt+offload+mst,4,full",
        "qwen2-uneven,packed,checkpoint+mst,4,full", "qwen2-uneven,padded,seco+checkpoint,4,lora",
        "mistral-mha3,padded,checkpoint+mst,2,lora", "qwen3-moe,packed,checkpoint+mst,2,full"],
}


@pytest.mark.parametrize("processes", [2, 4])
def test_sequence_parallel_equals_one_process_of_stock_autograd(processes, tmp_path):
    result, out = _torchrun(processes, ";".join(CASES[processes]), tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == set(CASES[processes])
    for case, errors in results.items():
        # Mixed precision (bf16 compute, float64 master weights) or bf16 parameters: bf16's error, not float64's.
        tol = 3e-2 if "/bf16" in case else TOL
        assert errors["loss"] <= tol and errors["grads"] <= tol, (case, errors)
        assert errors["every_rank_same_loss"], case


def test_ranks_reading_different_batches_stop_with_one_line(tmp_path):
    result, _ = _torchrun(2, "mismatch", tmp_path, timeout=120)
    assert result.returncode != 0
    assert "read different batches (rank 0: shape (2, 101), rank 1: shape (2, 90))" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_dies_stops_the_others_within_the_collective_timeout(tmp_path):
    """Started without torchrun (which would kill the survivors itself): rank 1 exits
    before the step; rank 0's collectives fail within the 10 s timeout and it ends with
    one line naming itself, exit code 2."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "LONGTRAIN_COLLECTIVE_TIMEOUT": "10", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(HERE / "sp_worker.py"), str(tmp_path / "x.json"), "die"]
    procs = [subprocess.Popen(cmd, cwd=HERE, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert procs[1].returncode == 3
    assert procs[0].returncode == 2, outputs[0][1][-3000:]
    lines = [line for line in outputs[0][1].splitlines() if line.startswith("longtrain: error:")]
    assert len(lines) == 1 and "rank 0 of 2: the sequence-parallel step stopped because another process failed" in lines[0]


MEASURED = [("checkpoint+mst", 1024), ("fpdt64+offload+mst", 512)]


def test_the_simulated_share_of_one_rank_is_what_each_rank_holds(tmp_path):
    """Exact CPU measurement of both ranks of a 2-process run (gloo, FSDP2) against the
    simulator's one-rank share (fake process group, fake tensors). Most runs equal it to the
    byte. What a loaded machine can add is bounded, not guessed: a collective's tensors
    (input and output) are released by the C++ work object, which the gloo worker thread that
    ran it drops only after marking it done (``ProcessGroupGloo::runLoop``), a moment after
    ``wait()`` returns — so a rank's peak may count finished collectives' buffers, but at
    most one collective per worker thread of each group (a thread takes its next collective
    only after dropping the last). The step communicates over two groups: FSDP2's mesh (a
    unit's all-gather or reduce-scatter: the unit's unsharded bytes and this rank's shard)
    and the Ulysses group (an all-to-all: one tensor of all heads over the tokens it
    exchanges, sent and received). So the measured peak lies between the simulated one and
    threads x the largest collective of each group above it, whatever the other rank's timing.
    Each rank reports the lowest of three steady steps' peaks. Both cases (MEASURED) run in
    one launch."""
    result, out = _torchrun(2, ";".join(f"measure:{length}:{engine}" for engine, length in MEASURED), tmp_path,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(out.read_text())
    for engine, length in MEASURED:
        _check_measured_share(measured[f"{length}:{engine}"], engine, length)


def _check_measured_share(measured: dict, engine: str, length: int) -> None:
    sys.path.insert(0, str(HERE))
    from sp_worker import strategy

    peaks, threads = measured["peaks"], measured["gloo_threads"]
    degree = 2
    simulated = lt.simulate("tiny-llama", length, strategy=strategy(engine, degree), dtype="float32", optimizer="adamw")
    model = build_from_config(preset_config("tiny-llama"), torch.float32)

    def unit_collective(unit) -> int:  # FSDP2 shards each parameter's dim 0, padded to a multiple of the degree
        shard = sum(-(-p.shape[0] // degree) * (p.numel() // p.shape[0]) * p.element_size() for p in unit.parameters())
        return degree * shard + shard  # unsharded (all-gather output, reduce-scatter input) and this rank's shard

    units = [*model.model.layers, model.model.embed_tokens, model.model.norm, model.lm_head]
    fsdp2 = max(unit_collective(unit) for unit in units)
    config = model.config
    exchanged = 64 if engine.startswith("fpdt64") else length // degree  # a rank's tokens per all-to-all (FPDT: a chunk)
    head_dim = config.hidden_size // config.num_attention_heads
    ulysses = 2 * exchanged * config.num_attention_heads * head_dim * 4  # queries or attention output, float32, both ways
    in_flight = threads["fsdp2"] * fsdp2 + threads["ulysses"] * ulysses
    assert all(simulated.device_peak_bytes <= peak <= simulated.device_peak_bytes + in_flight for peak in peaks), \
        (peaks, simulated.device_peak_bytes, in_flight)
    single = lt.simulate("tiny-llama", length, strategy=lt.Strategy(checkpoint=True, mst=True), dtype="float32", optimizer="adamw")
    assert simulated.peak.device_bytes("optimizer_state") < 0.6 * single.peak.device_bytes("optimizer_state")


def test_torchrun_training_with_sp_resumes_bit_for_bit_and_refuses_another_degree(tmp_path):
    """A 2-rank ``--sp 2`` run resumed from its step-2 checkpoint ends with the uninterrupted
    run's weights bit for bit: both are fresh torchrun launches pinned alike (one intra-op
    thread per rank, OMP_NUM_THREADS=1 in their environment, so no BLAS call splits its sums
    by thread count; the same seed, data and ranks, on this machine), and the checkpoint
    restores weights, optimizer state, schedule, RNG and data position. A run of another
    degree is refused in one line."""
    from safetensors.torch import load_file

    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    args = ["--model", "tiny-llama", "--seq-len", "200", "--steps", "4", "--save-every", "2",
            "--eval-samples", "1", "--no-progress", "--engine", "fpdt:chunk=40:offload=true", "--strategy", "mst"]

    def run(out, *extra, processes=2):
        cmd = [launcher, "--standalone", f"--nproc-per-node={processes}", "-m", "longtrain.cli", "train", *args, "--sp", "2",
               "--out", str(tmp_path / out), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})

    first = run("whole")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run("resumed", "--resume-from", str(tmp_path / "whole" / "checkpoints" / "step-00000002"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    manifest = (tmp_path / "whole" / "checkpoints" / "step-00000004" / "manifest.json").read_text()
    assert "weights-rank1.safetensors" in manifest and "trainer_state-rank1.pt" in manifest
    one = subprocess.run([sys.executable, "-m", "longtrain.cli", "train", *args, "--out", str(tmp_path / "other"),
                          "--resume-from", str(tmp_path / "whole" / "checkpoints" / "step-00000004")],
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 2 and one.stderr.count("\n") == 1
    assert "written with sp=2 but this run has sp=1" in one.stderr


def test_under_torchrun_each_process_takes_its_own_gpu_and_cpu_collectives_have_gloo(monkeypatch):
    """On CUDA (patched: no GPU here) init_from_env makes the local rank's GPU the current
    one before the group starts — FSDP2, device meshes and NCCL's object collectives use the
    current device, GPU 0 on every rank otherwise — and starts NCCL for CUDA tensors beside
    gloo for CPU ones (a gradient norm, pickled objects), which NCCL alone refuses."""
    import torch.distributed as dist

    from longtrain.parallel import distributed

    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed, "_joined", False)
    monkeypatch.setattr(dist, "is_initialized", lambda: "backend" in calls)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("current", device))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.setdefault("backend", backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert distributed.init_from_env(torch.device("cuda")) == (1, 2)
    assert calls == {"current": torch.device("cuda", 1), "backend": "cpu:gloo,cuda:nccl"}
    assert distributed.rank_device(torch.device("cuda")) == torch.device("cuda", 1)
    with pytest.raises(lt.LongtrainError, match="would put every process on GPU 0"):
        distributed.rank_device(torch.device("cuda", 0))
    # NCCL's word for this process's own misuse is not another process's failure.
    assert not distributed.is_peer_failure(RuntimeError("NCCL error in: ...: invalid usage (run with NCCL_DEBUG=WARN)"))
    assert distributed.is_peer_failure(RuntimeError("[gloo] Connection closed by peer"))


def test_simulate_command_line_takes_sp(capsys):
    from longtrain.cli import main

    assert main(["simulate", "--model", "tiny-llama", "--seq-len", "1K", "--sp", "2", "--engine", "fpdt:chunk=128",
                 "--strategy", "mst", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategy"]["sequence_parallel"]["degree"] == 2
    assert main(["simulate", "--model", "tiny-llama", "--seq-len", "1K", "--sp", "0"]) == 2
    assert "--sp must be a positive integer" in capsys.readouterr().err


def test_a_simulation_shards_over_the_data_parallel_groups_too():
    """`processes` (simulate --gpus): groups of `degree` processes share a sequence and FSDP2
    shards over all of them: one rank holds 1/processes of the optimizer state, whatever the
    degree; its activations are its group's share of the sequence (degree 1: the whole one,
    FSDP2 data parallel as in the Trainer) — at the peak, within the units' gathered
    parameters that the sharding changes (a few percent here)."""
    def peak(sp: dict | None):
        return lt.simulate("tiny-llama", 2048, strategy=lt.Strategy.parse("checkpoint,mst", sequence_parallel=sp),
                           dtype="float32", optimizer="adamw").peak

    one, two, two_of_four, one_of_four = (peak(None), peak({"degree": 2}), peak({"degree": 2, "processes": 4}),
                                          peak({"degree": 1, "processes": 4}))
    state = one.device_bytes("optimizer_state")
    assert two.device_bytes("optimizer_state") < 0.6 * state
    assert two_of_four.device_bytes("optimizer_state") == one_of_four.device_bytes("optimizer_state") < 0.3 * state
    assert one_of_four.device_bytes("activations") == pytest.approx(one.device_bytes("activations"), rel=0.05)
    assert two_of_four.device_bytes("activations") == pytest.approx(two.device_bytes("activations"), rel=0.05)
    assert two.device_bytes("activations") < 0.7 * one.device_bytes("activations")
    with pytest.raises(lt.LongtrainError, match=r"processes \(6\) must be a multiple of its degree \(4\)"):
        lt.Strategy(sequence_parallel={"degree": 4, "processes": 6})


def test_each_process_of_a_group_draws_its_own_dropout_and_the_generators_stay_in_step():
    """The ranks' streams differ (independent masks for their tokens), each is the same on
    a second call from the same state (recomputation and reruns reproduce it), and the shared
    generator is left advanced alike whatever the rank."""
    from longtrain.engines.sequence_parallel import rank_random_stream

    drawn, after = {}, {}
    for rank in (0, 1, 0):
        torch.manual_seed(7)
        with rank_random_stream(rank, torch.device("cpu")):
            mask = torch.nn.functional.dropout(torch.ones(64), p=0.5)
        assert drawn.setdefault(rank, mask).equal(mask)
        after[rank] = torch.rand(4)
    assert not drawn[0].equal(drawn[1]) and after[0].equal(after[1])
