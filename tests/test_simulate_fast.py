"""The simulator's extrapolation against the full simulation, LoRA in the simulator against
an exact CPU measurement, and `longtrain simulate`'s verdict.

The extrapolated simulation (simulate's default) runs a few layers and, in chunked
engines, a few chunks, and extends every figure along the model's repeating pattern
(plan/simulate.py); ``exact=True`` runs the whole model at the whole length. Here both
run on tiny models just large enough for the extrapolation to be used on each axis: 7
layers and 7 chunks.
"""

import pytest
import torch

import longtrain as lt
from longtrain.cli import main
from longtrain.models.loading import add_lora, build_from_config, default_dtype
from longtrain.models.presets import preset_config
from longtrain.plan.extrapolate import layer_axis, scaled_strategy
from longtrain.plan.simulate import build_fake_model, chunk_curve, run_training_steps, simulate
from longtrain.techniques.memo import memo_alpha

# name -> (layers, tokens, strategy, engine, LoRA rank). Chunked engines: 7 chunks of 16
# tokens (2 layers: the chunk axis alone, except spaco: both axes).
CASES = {
    "backprop": (7, 256, "none", None, None),
    "checkpoint,mst": (7, 256, "checkpoint,mst", None, None),
    "checkpoint, top layer whole": (7, 256, "checkpoint:except_last=1,mst", None, None),
    "memo": (7, 256, "memo:alpha=0.5:keep_last=1:host_memory=64MiB,mst", None, None),
    "fpdt offload": (2, 112, "mst", "fpdt:chunk=16:offload=true", None),
    "seco offload": (2, 112, "checkpoint", "seco:chunk=16:offload=true", None),
    "spaco, layers × chunks": (7, 112, "none", "spaco:chunk=16:budget=2", None),
    "LoRA": (7, 256, "none", None, 4),
}


def _close(a: int, b: int, tolerance: float = 0.01) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


@pytest.mark.parametrize("case", CASES)
def test_extrapolated_simulation_equals_the_full_one(case):
    """Acceptance (issue 14): within 1% of the full simulation, device and host peaks, for
    every engine (in practice equal to the byte)."""
    layers, tokens, spec, engine, lora = CASES[case]
    config = preset_config("tiny-llama", num_hidden_layers=layers)
    strategy = lt.Strategy.parse(spec, engine=engine)
    fast = simulate(config, tokens, strategy=strategy, dtype="float32", lora_rank=lora)
    full = simulate(config, tokens, strategy=strategy, dtype="float32", lora_rank=lora, exact=True)
    assert fast.method.startswith("extrapolated") and full.method.startswith("exact")
    assert _close(fast.device_peak_bytes, full.device_peak_bytes)
    assert _close(fast.peak.peak_host_bytes, full.peak.peak_host_bytes)
    assert _close(fast.peak.host_bytes_at_peak, full.peak.host_bytes_at_peak)
    assert (fast.parameters, fast.trainable_parameters) == (full.parameters, full.trainable_parameters)
    assert sum(fast.peak.device_bytes(c) for c in fast.peak.by_category) == fast.device_peak_bytes


@pytest.mark.parametrize("where", ["host", "device", "fit", "host, chunks alone", "device, chunks alone"])
def test_attention_outputs_kept_by_the_lowest_layers_are_simulated_at_full_scale(where):
    """FPDT keeping the outputs of its lowest 6 of 7 layers (the small simulations, of 4–6
    layers, would keep every one, consistently), against the whole model: in host memory to
    the byte; on the device an upper bound (2.4% over on this tiny model, where the outputs
    are a large share of the step); ``fit`` with a budget for 3 of 7 equal and within it
    (before, every layer was kept and the step refused). "Chunks alone": 1 of 2 layers,
    the small simulations whole-model but few chunks."""
    from longtrain.engines.chunked.costs import parked_host_bytes

    layers, tokens, kept = (2, 112, 1) if "chunks alone" in where else (7, 48, 6)
    config = preset_config("tiny-llama", num_hidden_layers=layers)
    offload = ":offload=true" if where.startswith(("host", "fit")) else ""
    engine = f"fpdt:chunk=16{offload}:keep_output={kept}"
    if where == "fit":
        settings = lt.FPDTOptions(chunk=16, offload=True, keep_output="fit").settings()
        budget = parked_host_bytes(config, 1, tokens, 4, settings, 3) + 100
        engine, kept = f"fpdt:chunk=16:offload=true:keep_output=fit:host_memory={budget}", 3
    strategy = lt.Strategy.parse("none", engine=engine)
    fast = simulate(config, tokens, strategy=strategy, dtype="float32", optimizer="none")
    full = simulate(config, tokens, strategy=strategy, dtype="float32", optimizer="none", exact=True)
    assert fast.method.startswith("extrapolated")
    assert fast.notes["kept_attention_outputs"] == kept
    if where.startswith("device"):
        assert full.device_peak_bytes <= fast.device_peak_bytes <= 1.05 * full.device_peak_bytes
    else:
        assert fast.peak.peak_host_bytes == full.peak.peak_host_bytes
        assert _close(fast.device_peak_bytes, full.device_peak_bytes)
    if where == "fit":
        assert fast.peak.peak_host_bytes <= budget


@pytest.mark.parametrize("engine, optimizer", [("fpdt:chunk=16:offload=true:segment=2", "none"),
                                               ("fpdt:chunk=16", "adamw-offload")])
def test_a_chunk_curve_is_the_simulation_at_every_length(engine, optimizer):
    """The longest-context search evaluates the curve instead of simulating each length: at
    every whole-chunk length it must give simulate()'s figures to the byte (same small
    simulations), and grow convexly (each place's peak is affine in the chunks)."""
    config = preset_config("tiny-llama", num_hidden_layers=2)
    strategy = lt.Strategy.parse("mst", engine=engine)
    curve = chunk_curve(config, strategy, optimizer=optimizer, dtype="float32", iterations=1)
    assert curve is not None and curve.chunk == 16
    chunks = curve.fewest + 5  # (a length the curve extends to, not one of its simulations)
    full = simulate(config, chunks * 16, strategy=strategy, optimizer=optimizer, dtype="float32", iterations=1)
    assert curve.peaks(chunks) == (full.device_peak_bytes, full.peak.peak_host_bytes), chunks
    assert curve.report(chunks).by_category == full.peak.by_category
    device = [curve.peaks(c)[0] for c in range(curve.fewest, curve.fewest + 30)]
    steps = [b - a for a, b in zip(device, device[1:])]
    assert all(y >= x for x, y in zip(steps, steps[1:])) and steps[-1] > 0
    with pytest.raises(ValueError, match="starts at"):
        curve.peaks(curve.fewest - 1)


def test_layer_pattern_and_memo_budget_of_the_small_simulations():
    # Gemma-2 alternates sliding and global attention: layers go in pairs, and the small
    # models keep the pattern.
    gemma = preset_config("gemma2-9b")
    axis = layer_axis(gemma, lt.Strategy())
    assert (axis.unit, axis.offset, axis.target) == (2, 0, 21) and axis.value(axis.first) % 2 == 0
    # FPDT's checkpoint segments repeat every `segment` layers; the partial one on top stays.
    llama = preset_config("llama3-8b")
    axis = layer_axis(llama, lt.Strategy(engine="fpdt", engine_options={"segment": 3}))
    assert (axis.unit, axis.offset) == (3, 32 % 3)
    # Memo's α of the small simulations is the full model's: its host budget is scaled.
    memo = lt.MemoOptions(host_memory="120GiB")
    small = scaled_strategy(lt.Strategy(memo=memo), llama, 6).techniques["memo"]
    sizes = dict(input_bytes=2**29, attention_bytes=2**30, other_bytes=2**33, bandwidth=2.5e10, layer_seconds=2.0)
    full_alpha = memo_alpha(**sizes, layers=32, host_budget=memo.host_memory, keep_last=memo.keep_last)
    small_alpha = memo_alpha(**sizes, layers=6, host_budget=small.host_memory, keep_last=memo.keep_last)
    assert 0 < full_alpha < 1 and small_alpha == pytest.approx(full_alpha, abs=1e-9)


@pytest.mark.parametrize("strategy, dtype", [("none", torch.float32), ("checkpoint", torch.float32),
                                             ("none", torch.bfloat16)])
def test_lora_simulation_matches_exact_cpu_measurement(strategy, dtype):
    """Issue 17: LoRA is simulated (adapters built on the meta device, then faked) and agrees
    with the exact CPU measurement of the same code path within the 2% of
    tests/test_memory.py — here to the byte. Frozen base weights: no gradients or optimizer
    state for them; the adapters in float32 under a bfloat16 model, as peft makes them."""
    config = preset_config("tiny-llama")
    simulated, n_simulated = run_training_steps(lambda: build_fake_model(config, dtype, 8), seq_len=1024,
                                                strategy=strategy, dtype=dtype, fake=True)
    measured, n_measured = run_training_steps(lambda: add_lora(build_from_config(config, dtype), rank=8), seq_len=1024,
                                              strategy=strategy, dtype=dtype, fake=False)
    assert n_simulated == n_measured
    assert abs(simulated.peak_device_bytes - measured.peak_device_bytes) <= 0.02 * measured.peak_device_bytes
    for category, where in measured.by_category.items():
        assert abs(simulated.by_category[category]["device"] - where["device"]) <= 0.02 * measured.peak_device_bytes
    with default_dtype(dtype):
        model = add_lora(build_from_config(config, dtype), rank=8)
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in adapters)
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters)
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    # AdamW: two moments per adapter parameter and a step counter per tensor; nothing for the base.
    assert simulated.device_bytes("optimizer_state") == 2 * adapter_bytes + 4 * len(adapters)
    assert simulated.device_bytes("gradients") <= adapter_bytes


def test_simulate_lora_reports_trainable_parameters(capsys):
    report = lt.simulate("tiny-llama", 512, lora_rank=4, dtype="float32")
    full = lt.simulate("tiny-llama", 512, dtype="float32")
    assert report.lora_rank == 4 and 0 < report.trainable_parameters < report.parameters // 10
    assert report.peak.device_bytes("optimizer_state") < full.peak.device_bytes("optimizer_state") / 10
    assert "LoRA rank 4" in report.table()
    code, out, _ = _cli(capsys, "simulate", "--model", "tiny-llama", "--seq-len", "512", "--lora", "--lora-rank", "4",
                        "--4bit")
    assert code == 0 and "LoRA rank 4 (0.0M trainable) over a 4-bit (NF4) base" in out
    code, _, err = _cli(capsys, "simulate", "--model", "tiny-llama", "--seq-len", "512", "--4bit")
    assert code == 2 and "--4bit holds the base in 4 bits, which trains LoRA adapters only: add --lora" in err


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_verdict_against_device_and_host_memory(capsys):
    tiny = ("simulate", "--model", "tiny-llama", "--seq-len", "256", "--no-progress")
    code, out, _ = _cli(capsys, *tiny, "--device-memory", "80GiB", "--host-memory", "1GB")
    assert code == 0
    assert out.strip().splitlines()[-1].startswith("fits: device ") and "of 80.00 GiB, host 0 B of 953.67 MiB" in out
    code, out, _ = _cli(capsys, *tiny, "--device-memory", "1MiB")
    assert code == 1 and "does not fit: device " in out and "> 1.00 MiB by " in out
    with pytest.raises(SystemExit) as exit_info:
        main([*tiny, "--device-memory", "80 parsecs"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "cannot read size '80 parsecs'" in err and len(err.strip().splitlines()) == 1


def test_simulate_reports_progress_on_stderr(capsys):
    code, _, err = _cli(capsys, "simulate", "--model", "tiny-llama", "--seq-len", "256", "--exact")
    assert code == 0 and "longtrain simulate: simulating all 2 layers at 256 tokens" in err
    assert "step 2 of 2 (measured)" in err


@pytest.mark.parametrize("spec", ["mst:mlp_chunk=16:loss_chunks=40", "checkpoint,mst:mlp_chunk=16:loss_chunks=40"])
def test_fake_tensors_run_three_tiles_and_keep_every_peak(spec, monkeypatch):
    """On fake tensors the tiled MLP and the chunked head run their first two tiles and the
    last (ops/tiles.py): the simulated step's peaks and categories are those of every tile
    to the byte (here 38 MLP tiles and 40 head chunks, the last partial), and agree with the
    exact CPU measurement within tests/test_memory.py's 2%."""
    import longtrain.ops.tiles as tiles

    build = lambda: build_from_config(preset_config("tiny-llama", num_hidden_layers=2))  # noqa: E731
    real_is_fake, cut = tiles.is_fake, []
    monkeypatch.setattr(tiles, "is_fake", lambda tensor: cut.append(real_is_fake(tensor)) or cut[-1])
    skipped, _ = run_training_steps(build, seq_len=600, strategy=spec, fake=True, iterations=1)
    assert any(cut)  # the loops were cut short
    monkeypatch.setattr(tiles, "is_fake", lambda tensor: False)
    every, _ = run_training_steps(build, seq_len=600, strategy=spec, fake=True, iterations=1)
    measured, _ = run_training_steps(build, seq_len=600, strategy=spec, fake=False, iterations=1)
    assert (skipped.peak_device_bytes, skipped.peak_host_bytes) == (every.peak_device_bytes, every.peak_host_bytes)
    assert skipped.by_category == every.by_category
    assert abs(skipped.peak_device_bytes - measured.peak_device_bytes) <= 0.02 * measured.peak_device_bytes


def test_tile_starts_are_every_tile_on_real_tensors_and_three_on_fake_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longtrain.ops.tiles import tile_starts

    assert list(tile_starts(100, 16, torch.empty(1))) == list(range(0, 100, 16))
    with FakeTensorMode():
        fake = torch.empty(1)
    assert tile_starts(100, 16, fake) == [0, 16, 96]
    assert list(tile_starts(48, 16, fake)) == [0, 16, 32]


@pytest.mark.parametrize("strategy", ["checkpoint,mst", "mst"])
def test_blocked_attention_runs_each_kind_of_block_once_on_fake_tensors(strategy, monkeypatch):
    """Soft-capped attention (Gemma-2) runs in blocks of 1,024 tokens, as many as the square
    of the length (ops/causal_attention.py); a simulation of Gemma-2-9B at 36K tokens ran
    hundreds per layer and did not finish in 15 minutes. On fake tensors one block of each
    kind runs: the count does not grow with the length, and the peaks are those of every
    block, to the byte (a length with a partial last block included)."""
    from longtrain.ops import chunked_attention

    config = preset_config("tiny-gemma2", num_hidden_layers=2)
    build = lambda: build_from_config(config)  # noqa: E731
    real_forward, calls = chunked_attention.block_forward, []
    monkeypatch.setattr(chunked_attention, "block_forward", lambda *a, **k: calls.append(1) or real_forward(*a, **k))
    counts = {}
    for tokens in (4096, 16384, 4096 + 300):
        calls.clear()
        report, _ = run_training_steps(build, seq_len=tokens, strategy=strategy, fake=True, iterations=1)
        counts[tokens] = len(calls)
    assert counts[4096] == counts[16384] > 0
    monkeypatch.setattr(chunked_attention, "is_fake", lambda tensor: False)  # every block, as before
    calls.clear()
    every, _ = run_training_steps(build, seq_len=4096 + 300, strategy=strategy, fake=True, iterations=1)
    assert len(calls) > counts[4096 + 300]
    assert (report.peak_device_bytes, report.peak_host_bytes) == (every.peak_device_bytes, every.peak_host_bytes)
    assert report.by_category == every.by_category


def test_a_state_space_models_own_step_extends_along_its_tokens(monkeypatch):
    """Mamba's stock step (a Python step per token) takes memory affine in whole blocks of
    tokens: simulated at a few blocks (here of 8 tokens) it equals the full
    simulation to the byte. Mamba-2's stock chunked scan forms a chunks × chunks matrix, so
    it is simulated whole; the adjoint engine's VJP blocks grow with the length, so it is too."""
    from longtrain.models.adapters.mamba import MambaAdapter
    from longtrain.plan.extrapolate import token_axis

    monkeypatch.setattr(MambaAdapter, "token_block", classmethod(lambda cls, config: 8 if cls.scan_per_token(config) else None))
    config = preset_config("tiny-mamba", num_hidden_layers=2)
    strategy = lt.Strategy.parse("checkpoint,mst")
    fast = simulate(config, 57, strategy=strategy, dtype="float32")
    full = simulate(config, 57, strategy=strategy, dtype="float32", exact=True)
    assert "tokens (checked at" in fast.method and "blocks of 8" in fast.method and full.method.startswith("exact")
    assert (fast.device_peak_bytes, fast.peak.peak_host_bytes) == (full.device_peak_bytes, full.peak.peak_host_bytes)
    assert token_axis(preset_config("tiny-mamba2"), 4096, strategy) is None
    assert token_axis(config, 4096, lt.Strategy(engine="adjoint")) is None
    assert token_axis(preset_config("tiny-llama"), 4096, strategy) is None
