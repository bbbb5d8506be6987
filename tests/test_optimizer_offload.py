"""AdamW with its state in host memory (``--optimizer-offload``): the same update as
AdamW on the device, gradients streamed to the host during backward, checkpoints that
resume bit for bit."""

import copy
import json

import pytest
import torch
from conftest import backward_on_another_thread, padded_batch, stock_and_ours

import longtrain as lt
from longtrain.cli import main
from longtrain.optimizer_offload import HostAdamW, parameter_groups, streaming
from longtrain.train.metrics import read_metrics
from longtrain.train.ranks import Ranks


def _pair(preset, tie=False):
    from longtrain.models.presets import preset_config

    config = preset_config(preset)
    config.tie_word_embeddings = tie
    _, ours = stock_and_ours(config)
    _, reference = stock_and_ours(config)
    return ours, reference


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)


def _train(model, optimizer, strategy, steps=2, accumulate=2, clip=0.05):
    """Two steps of two micro-batches, clipped (the norm is well above ``clip``)."""
    ranks = Ranks.from_env(torch.device("cpu"), 1)
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for step in range(steps):
        batches = [padded_batch(model.config.vocab_size, lengths=(61, 45), seed=10 * step + k) for k in range(accumulate)]
        for k, batch in enumerate(batches):
            with streaming(optimizer, last=k == accumulate - 1), backward_on_another_thread():
                lt.step(model, batch, strategy, num_label_tokens=200)
        if isinstance(optimizer, HostAdamW):
            norms.append(optimizer.clip_grad_norm(clip))
        else:
            norms.append(ranks.clip_grad_norm(params, clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


@pytest.mark.parametrize("preset,strategy,tie", [
    ("tiny-llama", lambda: lt.Strategy(checkpoint=True), False),
    ("tiny-qwen2", lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40}, mst=lt.MsTOptions(loss_chunks=3)), True),
    ("tiny-mistral", lambda: lt.Strategy(engine="seco", engine_options={"chunk": 40}), False),
])
def test_offloaded_adamw_takes_the_same_steps_as_adamw_in_float64(preset, strategy, tie):
    ours, reference = _pair(preset, tie)
    lt.apply(ours, strategy()), lt.apply(reference, strategy())
    params = [p for p in ours.parameters() if p.requires_grad]
    offloaded = HostAdamW(params, parameter_groups(ours, params), lr=1e-2, weight_decay=0.1)
    norms = _train(ours, offloaded, strategy())
    expected = _train(reference, _adamw([p for p in reference.parameters() if p.requires_grad]), strategy())
    assert norms == pytest.approx(expected, rel=1e-12)
    for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
        assert float((p - q).detach().abs().max()) <= 1e-12 * max(1.0, float(q.detach().abs().max())), name


def test_gradients_leave_the_device_layer_by_layer():
    """While backward runs, at most about two layers' gradients are held beside the
    optimizer (plus the head's, until backward reaches the top layer)."""
    ours, _ = _pair("tiny-llama")
    params = [p for p in ours.parameters() if p.requires_grad]
    optimizer = HostAdamW(params, parameter_groups(ours, params))
    layer_bytes = sum(p.numel() * p.element_size() for p in ours.model.layers[0].parameters())
    head_bytes = sum(p.numel() * p.element_size() for p in ours.lm_head.parameters())
    held = []
    for p in params:  # registered after the optimizer's hooks: sees what they left
        p.register_post_accumulate_grad_hook(lambda _: held.append(sum(q.grad.numel() * q.grad.element_size()
                                                                       for q in params if q.grad is not None)))
    with streaming(optimizer, last=True):
        lt.step(ours, padded_batch(ours.config.vocab_size), lt.Strategy())
    assert max(held) <= head_bytes + 2 * layer_bytes
    assert all(p.grad is None for p in params) and all(optimizer._filled)


def test_half_precision_parameters_get_float32_masters():
    ours, _ = _pair("tiny-llama")
    ours.to(torch.bfloat16)
    params = [p for p in ours.parameters() if p.requires_grad]
    optimizer = HostAdamW(params, parameter_groups(ours, params), lr=1e-3)
    assert all(m.dtype == torch.float32 for m in optimizer.masters)
    lt.step(ours, padded_batch(ours.config.vocab_size), lt.Strategy())
    optimizer.step()
    # Small updates accumulate in the masters even where the bf16 weights cannot show them.
    for p, m in zip(params, optimizer.masters):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))


def test_streamed_gradients_are_fpdts_float32_sums():
    """FPDT sums a bf16 layer's chunk gradients in float32 and writes the sum to ``.grad``
    when the layer is done: the gradients streamed to the host during backward (two
    micro-batches) are exactly those the same steps leave on the device without offload,
    and each group leaves the device once, before the end of backward."""
    ours, _ = _pair("tiny-llama")
    ours.to(torch.bfloat16)
    reference = copy.deepcopy(ours)
    strategy = lt.Strategy(engine="fpdt", engine_options={"chunk": 16})
    lt.apply(ours, strategy), lt.apply(reference, strategy)
    batches = [padded_batch(ours.config.vocab_size, seed=s) for s in (1, 2)]
    params = [p for p in ours.parameters() if p.requires_grad]
    optimizer = HostAdamW(params, parameter_groups(ours, params))
    flushed = []
    flush = optimizer._flush
    optimizer._flush = lambda indices: (flushed.append(sorted(indices)), flush(indices))
    for k, batch in enumerate(batches):
        with streaming(optimizer, last=k == 1):
            lt.step(ours, batch, num_label_tokens=60)
        lt.step(reference, batch, num_label_tokens=60)
    for host, p in zip(optimizer.host_grads, reference.parameters()):
        assert torch.equal(host, p.grad)
    assert len(flushed) > 2 and len({i for indices in flushed for i in indices}) == sum(map(len, flushed))


def test_offloaded_run_resumes_bit_for_bit(tmp_path, capsys):
    tiny = ["train", "--model", "tiny-llama", "--seq-len", "128", "--eval-samples", "2", "--no-progress",
            "--optimizer-offload", "--steps", "4", "--save-every", "2", "--keep-checkpoints", "3"]
    assert main([*tiny, "--out", str(tmp_path / "ref")]) == 0
    assert main([*tiny, "--out", str(tmp_path / "resumed"),
                 "--resume-from", str(tmp_path / "ref" / "checkpoints" / "step-00000002")]) == 0
    capsys.readouterr()

    def losses(path):
        return {r["step"]: r["loss"] for r in read_metrics(path / "metrics.jsonl") if "loss" in r}

    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "resumed")
    assert [got[s] for s in (3, 4)] == [ref[s] for s in (3, 4)]
    assert json.loads((tmp_path / "ref" / "summary.json").read_text())["final_loss"] is not None


def test_a_float32_run_resumed_with_its_state_moved_to_the_host_keeps_its_trained_weights(tmp_path, capsys):
    """An on-device AdamW's checkpoint of float32 weights holds no masters (the weights are
    their own): resumed with --optimizer-offload, the host masters are the trained weights,
    not the ones the run started from, and the change is said."""
    tiny = ["train", "--model", "tiny-llama", "--seq-len", "128", "--eval-samples", "2", "--no-progress",
            "--dtype", "float32", "--steps", "4", "--save-every", "2", "--keep-checkpoints", "3"]
    assert main([*tiny, "--out", str(tmp_path / "ref")]) == 0
    capsys.readouterr()
    assert main([*tiny, "--out", str(tmp_path / "moved"), "--optimizer-offload",
                 "--resume-from", str(tmp_path / "ref" / "checkpoints" / "step-00000002")]) == 0
    assert "resuming with --optimizer-offload True (the checkpoint's run had False)" in capsys.readouterr().out

    def losses(path):
        return {r["step"]: r["loss"] for r in read_metrics(path / "metrics.jsonl") if "loss" in r}

    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "moved")
    assert [got[s] for s in (3, 4)] == pytest.approx([ref[s] for s in (3, 4)], rel=1e-5)


def test_offload_needs_adamw_and_one_process(capsys):
    code = main(["train", "--model", "tiny-llama", "--optimizer", "sgd", "--optimizer-offload", "--no-progress",
                 "--out", "/tmp/never-written"])
    err = capsys.readouterr().err
    assert code == 2 and "--optimizer-offload" in err and len(err.strip().splitlines()) == 1


def test_offload_is_refused_when_several_processes_run(monkeypatch, capsys, tmp_path):
    """Its clipping norm and state are one process's: with layer groups (the adjoint
    engine over several processes) the norm would be wrong, so it is refused."""
    from longtrain.train import trainer

    monkeypatch.setattr(trainer.Ranks, "from_env", classmethod(lambda cls, device, sp=1: cls(0, 2, 1)))
    monkeypatch.setattr(trainer, "check_distributed_engine", lambda ranks, engine: None)
    code = main(["train", "--model", "tiny-llama", "--optimizer-offload", "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "2 processes were launched" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("strategy", ["checkpoint", "fpdt"])
def test_simulated_offload_equals_the_cpu_measurement_and_moves_state_to_the_host(strategy):
    """The simulator runs the same optimizer on fake tensors: its device and host peaks equal
    an exact CPU measurement, and against AdamW on the device the device loses the state and
    all but about two layers' gradients, which the host gains (with fp32 masters)."""
    from longtrain.models.loading import build_from_config
    from longtrain.models.presets import preset_config
    from longtrain.plan.simulate import run_training_steps

    config = preset_config("tiny-llama", num_hidden_layers=4)
    build = lambda: build_from_config(config, torch.bfloat16)  # noqa: E731
    engine = lt.Strategy(engine="fpdt", engine_options={"chunk": 256}) if strategy == "fpdt" else strategy
    kw = dict(seq_len=1024, strategy=engine, dtype=torch.bfloat16)
    simulated, params = run_training_steps(build, optimizer="adamw-offload", fake=True, **kw)
    measured, _ = run_training_steps(build, optimizer="adamw-offload", fake=False, **kw)
    assert abs(simulated.peak_device_bytes - measured.peak_device_bytes) <= 0.02 * measured.peak_device_bytes
    assert abs(simulated.peak_host_bytes - measured.peak_host_bytes) <= 0.02 * measured.peak_host_bytes
    on_device, _ = run_training_steps(build, optimizer="adamw", fake=True, **kw)
    assert simulated.device_bytes("optimizer_state") == 0
    # Masters and moments in fp32, gradient buffers in bf16, and one step counter per parameter tensor.
    assert 0 <= simulated.host_bytes("optimizer_state") - (3 * 4 * params + 2 * params) <= 4 * 64
    assert simulated.peak_device_bytes < on_device.peak_device_bytes - 2 * 2 * params  # moments, most gradients


@pytest.mark.cuda
def test_on_cuda_gradients_stream_on_a_side_stream_and_the_update_equals_fp32_adamw():
    """On the device: bf16 weights, gradients copied on a side stream during backward (on
    autograd's device thread), pinned host buffers; the update equals AdamW run on float32
    copies of the same gradients, rounded to bf16, and the device holds no optimizer state."""
    ours, _ = _pair("tiny-llama")
    model = ours.to("cuda", torch.bfloat16)
    lt.apply(model, lt.Strategy(engine="fpdt", engine_options={"chunk": 128, "offload": True}))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = HostAdamW(params, parameter_groups(model, params), lr=1e-3, weight_decay=0.1)
    assert all(m.is_pinned() and g.is_pinned() for m, g in zip(optimizer.masters, optimizer.host_grads))
    reference = [p.detach().float().cpu().clone() for p in params]
    adamw = torch.optim.AdamW(reference, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    for step in range(2):
        batch = {k: v.cuda() for k, v in padded_batch(model.config.vocab_size, lengths=(500, 430), seed=step).items()}
        before = torch.cuda.memory_allocated()
        with streaming(optimizer, last=True):
            lt.step(model, batch, num_label_tokens=900)
        assert all(p.grad is None for p in params)
        assert torch.cuda.memory_allocated() <= before  # no gradient left behind on the device
        for r, g in zip(reference, optimizer.host_grads):
            r.grad = g.float()
        optimizer.clip_grad_norm(1e9)
        optimizer.step()
        adamw.step()
        optimizer.zero_grad()
        for p, r in zip(params, reference):
            assert torch.equal(p.detach().cpu(), r.to(torch.bfloat16))


@pytest.mark.parametrize("strategy", [lt.Strategy(), lt.Strategy(engine="fpdt", engine_options={"chunk": 16})])
def test_no_gradient_is_added_on_the_host_synchronously_for_an_untied_model(strategy, monkeypatch):
    """Each parameter's gradient is copied once, after its last chunk: a second arrival
    would be added on the host, synchronously (on a GPU, a stall of the backward thread).
    FPDT's first layer used to hit it: its chunks' backward runs on through the embeddings."""
    ours, _ = _pair("tiny-llama")
    params = [p for p in ours.parameters() if p.requires_grad]
    optimizer = HostAdamW(params, parameter_groups(ours, params))
    added = []
    flush = HostAdamW._flush

    def counting(self, indices):
        added.extend(i for i in indices if self._filled[i] and self.device_params[i].grad is not None)
        return flush(self, indices)

    monkeypatch.setattr(HostAdamW, "_flush", counting)
    with streaming(optimizer, last=True), backward_on_another_thread():
        lt.step(ours, padded_batch(ours.config.vocab_size, lengths=(61, 45)), strategy)
    optimizer.finish_backward()
    assert added == [] and all(optimizer._filled)
