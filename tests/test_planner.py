"""The planner: its time model against the H100 measurements, FPDT's chunk-periodic
extension against full simulations, the ranking and verdicts, and the command line."""

import pytest
import torch

import longtrain as lt
from longtrain.cli import main
from longtrain.engines.chunked.costs import parked_host_bytes
from longtrain.memory.units import parse_bytes
from longtrain.models.presets import preset_config
from longtrain.plan import planner, steps
from longtrain.plan.longest import overflow
from longtrain.plan.planner import PlanRequest, plan, simulate_step
from longtrain.plan.simulate import simulate
from longtrain.plan.time_model import H100, step_time

K = 1024
GIB = 2**30

# Every longtrain row measured on an H100 on 2026-11-23 (docs/results/gpu_peers.md; Llama-3-8B, bf16;
# `lt:recompute+mst` is checkpoint,mst rerunning attention) and, where nothing newer was
# measured, SeCO's rows measured on an H100 on 2026-11-22: (tokens, techniques, engine,
# measured seconds per step). Memo's rows are left out: its copies did not hide (docs/speed.md).
H100_ROWS = [
    (16 * K, "checkpoint:keep_attention=false,mst", None, 2.69), (32 * K, "checkpoint:keep_attention=false,mst", None, 6.41),
    (64 * K, "checkpoint:keep_attention=false,mst", None, 17.17), (128 * K, "checkpoint:keep_attention=false,mst", None, 54.27),
    (32 * K, "checkpoint,mst", None, 6.02),
    (16 * K, "mst", "fpdt:chunk=4096:offload=true", 3.80), (16 * K, "mst", "fpdt:chunk=4096:offload=true:keep_output=true", 3.64),
    (32 * K, "mst", "fpdt:chunk=8192:offload=true:keep_output=true", 7.35),
    (64 * K, "mst", "fpdt:chunk=16384:offload=true:keep_output=true", 17.87),
    (128 * K, "mst", "fpdt:chunk=16384", 59.45), (128 * K, "mst", "fpdt:chunk=16384:offload=true", 62.00),
    (32 * K, "checkpoint,mst", "seco:chunk=4096", 11.99), (32 * K, "checkpoint,mst", "seco:chunk=4096:offload=true", 12.00),
    (64 * K, "checkpoint,mst", "seco:chunk=8192:offload=true", 34.18),
]


@pytest.mark.parametrize("tokens,techniques,engine,measured", H100_ROWS)
def test_time_model_is_within_10_percent_of_every_h100_row(tokens, techniques, engine, measured):
    config = preset_config("llama3-8b")
    predicted = step_time(config, tokens, lt.Strategy.parse(techniques, engine=engine))
    d, n = config.hidden_size, config.num_hidden_layers
    head_fwd = 2.0 * tokens * d * config.vocab_size
    seconds = predicted.seconds + head_fwd / H100.matmul  # measured while the chunked head formed its logits again in backward
    if engine and engine.startswith("fpdt"):  # measured when its recomputed layers still computed the MLP output
        seconds += (2.0 * tokens * 3 * d * config.intermediate_size * n + head_fwd) / H100.matmul  # and its backward ran the head's forward again
    assert abs(seconds / measured - 1) <= 0.10, (seconds, measured, predicted.parts)


def test_time_model_orders_what_each_strategy_recomputes():
    config, n = preset_config("llama3-8b"), 64 * K
    seconds = {name: step_time(config, n, lt.Strategy.parse(spec, engine=engine)).seconds for name, spec, engine in [
        ("backprop", "none", None), ("checkpoint", "checkpoint", None),
        ("fpdt", "mst", "fpdt:chunk=16384"), ("fpdt kept", "mst", "fpdt:chunk=16384:keep_output=true"),
        ("memo α=1", "memo:alpha=1,mst", None), ("memo α=0", "memo:alpha=0,mst", None)]}
    assert seconds["backprop"] < seconds["checkpoint"]
    assert seconds["fpdt kept"] < seconds["fpdt"]  # attention's forward once
    assert seconds["memo α=1"] < seconds["memo α=0"]


def test_layers_left_whole_are_predicted_faster_down_to_no_recomputation():
    config, n = preset_config("llama3-8b"), 32 * K
    seconds = [step_time(config, n, lt.Strategy(checkpoint={"except_last": k}, mst=True)).seconds for k in (0, 8, 16, 32)]
    assert seconds == sorted(seconds, reverse=True) and len(set(seconds)) == 4
    # Every layer whole: MsT's chunked head without checkpointing or tiled MLPs.
    assert seconds[-1] == pytest.approx(step_time(config, n, lt.Strategy(mst={"mlp": False})).seconds)


def test_memo_recomputing_every_token_is_predicted_as_checkpointing_with_attention_kept():
    config, n = preset_config("llama3-8b"), 64 * K
    memo = step_time(config, n, lt.Strategy(memo={"alpha": 0.0}, mst=True)).seconds
    assert memo == pytest.approx(step_time(config, n, lt.Strategy(checkpoint=True, mst=True)).seconds, rel=0.01)


def test_kept_outputs_take_what_the_host_budget_leaves_beside_parked_inputs():
    """Llama-3-8B at 256K: a layer's input is 2 GiB, its attention output and LSE ~2.06 GiB.
    62 GiB keep 30 outputs, or, with the 32 inputs parked first, none; 94 GiB keep 14 beside
    them (16 of 30 with two layers left whole). Each output not kept is one attention forward more."""
    from longtrain.techniques.checkpoint import kept_output_share

    config, n = preset_config("llama3-8b"), 256 * K

    def share(**options):
        return kept_output_share(config, n, lt.Strategy(checkpoint=options).techniques["checkpoint"])

    assert share() == 1.0 and share(offload=False, host_memory=GIB) == 1.0 and share(keep_attention=False) == 0.0
    assert share(host_memory=62 * GIB) == 30 / 32
    assert share(host_memory=62 * GIB, offload_inputs=True) == 0.0
    assert share(host_memory=94 * GIB, offload_inputs=True) == 14 / 32
    assert share(host_memory=94 * GIB, offload_inputs=True, except_last=2) == 16 / 30  # 30 inputs: 34 GiB left
    seconds = [step_time(config, n, lt.Strategy(checkpoint={"offload_inputs": True, "host_memory": gib * GIB}, mst=True)).seconds
               for gib in (62, 94, 200)]
    assert seconds == sorted(seconds, reverse=True) and len(set(seconds)) == 3
    # Every output kept: attention runs as often as with the default budget (the parked inputs' copies aside).
    attention = step_time(config, n, lt.Strategy(checkpoint=True, mst=True)).parts["attention"]
    assert step_time(config, n, lt.Strategy(checkpoint={"offload_inputs": True, "host_memory": 200 * GIB},
                                            mst=True)).parts["attention"] == pytest.approx(attention)


def test_the_plan_parks_checkpointed_inputs_where_the_device_cannot_hold_them():
    """Three layers of tiny-llama at 8K tokens: parking the inputs moves two hidden states
    from the device to the host; where plain checkpointing no longer fits, the plan takes
    it, not a chunked engine."""
    config = preset_config("tiny-llama")
    config.num_hidden_layers = 3
    tokens = 8 * K
    hidden = tokens * config.hidden_size * 2
    whole = simulate_step(config, tokens, lt.Strategy(checkpoint={"host_memory": GIB}, mst=True), "bfloat16")
    parked = simulate_step(config, tokens, lt.Strategy(checkpoint={"host_memory": GIB, "offload_inputs": True}, mst=True),
                           "bfloat16")
    assert parked[0] <= whole[0] - hidden and parked[1] >= whole[1] + 2 * hidden  # (a fetched input is back at the peak)
    device = planner.reserved_bytes(lt.Strategy(checkpoint=True, mst=True), planner.budgets_for(
        config, device_memory=GIB, host_memory=GIB, optimizer="none", dtype=torch.bfloat16)[1][0], whole[0]) - hidden
    tight = plan(PlanRequest(config, tokens, device_memory=device, host_memory=GIB, optimizer="none",
                             optimizer_offload=False))
    assert tight.best.name == "checkpoint:offload_inputs,mst", tight.table()
    # Inputs past the host budget stay on the device: the bound before simulating counts them there.
    strategy = lt.Strategy(checkpoint={"offload_inputs": True, "host_memory": hidden}, mst=True)
    assert planner.parked_split(config, tokens, strategy, 2) == (2 * hidden, hidden)


def test_fpdt_with_only_its_inputs_parked_keeps_one_layers_kv_on_the_device_and_copies_less():
    """``fpdt:offload_inputs`` (K/V on the device, inputs and kept outputs in host memory):
    the bound before simulating puts one layer's K/V on the device and the rest on the host;
    the time model charges its exposed copies for the inputs only — at 256K a quarter of
    what parking the K/V too moves — so it predicts it between no offload and full offload,
    and the planner weighs it at every chunk size."""
    config = preset_config("llama3-8b")
    tokens = 256 * K
    kv = 2 * tokens * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2
    inputs = (config.num_hidden_layers - 1) * tokens * config.hidden_size * 2
    split = {name: planner.parked_split(config, tokens, lt.Strategy.parse("mst", engine=engine), 2)
             for name, engine in [("all", "fpdt:chunk=16384:offload=true"), ("inputs", "fpdt:chunk=16384:offload_inputs=true"),
                                  ("none", "fpdt:chunk=16384")]}
    assert split == {"all": (0, kv + inputs), "inputs": (kv, inputs), "none": (kv + inputs, 0)}
    parts = {name: step_time(config, tokens, lt.Strategy.parse("mst", engine=engine)).parts
             for name, engine in [("all", "fpdt:chunk=16384:offload=true"), ("inputs", "fpdt:chunk=16384:offload_inputs=true"),
                                  ("none", "fpdt:chunk=16384")]}
    assert "exposed_copies" not in parts["none"]
    assert 3 * parts["inputs"]["exposed_copies"] < parts["all"]["exposed_copies"]
    assert {k: v for k, v in parts["inputs"].items() if k != "exposed_copies"} == \
        {k: v for k, v in parts["all"].items() if k != "exposed_copies"}
    assert "fpdt:chunk=16384:offload_inputs:keep_output=fit,mst" in planner.candidates(tokens, 64 * GIB)
    # Under sequence parallelism a rank copies what one device would for its N/P tokens.
    from longtrain.engines.fpdt import host_traffic
    strategy = lt.Strategy.parse("mst", engine="fpdt:chunk=16384:offload=true", sequence_parallel=4)
    one_rank = host_traffic(config, 1, tokens // 4, 2, strategy.engine_options.settings(), 0).total
    assert step_time(config, tokens, strategy).parts["exposed_copies"] == pytest.approx(
        H100.offload_exposed * one_rank / H100.host_bandwidth)


def test_the_plan_leaves_as_many_top_layers_whole_as_the_device_holds():
    """Roomy: every layer whole. Tight: some — the count the device holds at
    WHOLE_LAYERS_FILL of its memory — and faster than checkpointing them all. No room:
    plain checkpointing."""
    config = preset_config("tiny-llama", num_hidden_layers=8)
    roomy = plan(PlanRequest(config, 2048, device_memory=GIB, host_memory=GIB, optimizer="none", exhaustive=True))
    assert roomy.best.strategy["techniques"]["checkpoint"]["except_last"] == 8
    checkpointed = next(row for row in roomy.rows if row.name == "checkpoint,mst")
    middle = (checkpointed.reserved_bytes + roomy.best.reserved_bytes) // 2
    tight = plan(PlanRequest(config, 2048, device_memory=int(middle / planner.WHOLE_LAYERS_FILL),
                             host_memory=GIB, optimizer="none", exhaustive=True))
    count = tight.best.strategy["techniques"]["checkpoint"]["except_last"]
    assert 0 < count < 8 and tight.best.reserved_bytes <= middle
    assert tight.best.step_seconds < next(row for row in tight.rows if row.name == "checkpoint,mst").step_seconds
    full = plan(PlanRequest(config, 2048, device_memory=checkpointed.reserved_bytes, host_memory=GIB, optimizer="none"))
    assert full.best.name == "checkpoint,mst"


@pytest.mark.parametrize("free_layers", [0, 10, 20])
def test_the_whole_layer_search_finds_the_largest_count_that_fits(free_layers):
    """The first whole layers can cost nothing (the peak sits in the loss head): the line
    through n/4 and n/2 is then flat or too shallow, and the search must still end at the
    largest count within the fill — here the peak rises 1 GiB a layer after
    ``free_layers``, and one simulation refused (a row without figures) is stepped over."""
    config = preset_config("llama3-8b")
    device_memory = 80 * GIB
    budget = planner.Budget(device_memory, GIB, persistent=0, device_state=0, host_state=0, optimizer="none")
    target = planner.WHOLE_LAYERS_FILL * device_memory

    def simulated(candidate):
        count = candidate.techniques["checkpoint"].except_last
        if count == 31:
            raise lt.LongtrainError("refused")
        return 40 * GIB + max(0, count - free_layers) * GIB, 0, {}

    row = planner.PlanRow(name="checkpoint,mst", strategy={}, device_bytes=40 * GIB, reserved_bytes=44 * GIB, host_bytes=0,
                          fits=True, step_seconds=1.0, tokens_per_s=1.0, mfu=0.5)
    found = planner.most_whole_layers(row, lt.Strategy(checkpoint=True, mst=True), config, 4096, budget, planner.H100,
                                      1, 8 * 10**9, lambda line: None, simulated)
    best = max(k for k in range(33) if k != 31 and planner.reserved_bytes(lt.Strategy(checkpoint=True), budget,
                                                                          40 * GIB + max(0, k - free_layers) * GIB) <= target)
    assert found is not None and found.strategy["techniques"]["checkpoint"]["except_last"] == best


@pytest.mark.parametrize("keep", [False, True])
def test_a_planned_step_is_the_full_simulation_at_its_length(keep):
    """Not a line through short lengths: the peak moves between phases as the length grows
    (the end of backward, holding every gradient, at short lengths; the parked activations
    at long ones), so an extension from two and four chunks fell below the real peak."""
    config = preset_config("llama3-8b", num_hidden_layers=2, hidden_size=256, intermediate_size=704, vocab_size=2048,
                           num_attention_heads=4, num_key_value_heads=2)
    strategy = lt.Strategy(engine="fpdt", engine_options={"chunk": 128, "offload": True, "keep_output": keep}, mst=True)
    # Whole chunks: simulate_step reads the chunk curve (a length with a partial last chunk is
    # simulated directly, the same call as the full simulation's).
    tokens = 1024
    device, host, _ = simulate_step(config, tokens, strategy, "bfloat16")
    full = simulate(config, tokens, strategy=strategy, optimizer="none")
    assert (device, host) == (full.device_peak_bytes, full.peak.peak_host_bytes)


# The planner's kinds of candidate: on 12 layers (two top layers whole, and Memo keeping two on
# the device: three repeats apart at each end, so the small simulations of 6 and 7 layers hold
# more than the model and it is simulated whole; with the check, 6, 7 and 8 are extrapolated),
# FPDT on 7 chunks of 16 tokens with its layer inputs parked (2 layers: chunks alone; both axes
# at once, segments and AdamW in host memory are compared with the whole model in
# tests/test_simulate_fast.py).
PLANNED = {
    "checkpoint, inputs parked": ("checkpoint:offload_inputs,mst", None, 12, 256, "none"),
    "checkpoint, top layers whole": ("checkpoint:except_last=2,mst", None, 12, 256, "none"),
    "memo": ("memo:host_memory=64MiB,mst", None, 12, 256, "none"),
    "fpdt inputs parked": ("mst", "fpdt:chunk=16:offload_inputs=true", 2, 112, "none"),
}


@pytest.mark.parametrize("case", PLANNED)
def test_the_planners_simulations_skip_the_checks_and_give_the_same_figures(case, monkeypatch):
    """The planner extrapolates from the fit simulations alone (no check one repeat beyond
    on each axis), and simulates the whole model where the small simulations along layers
    would hold more layers than it: the same figures to the byte as simulate() with its
    checks, from fewer (and smaller) simulations."""
    from longtrain.plan import simulate as simulation

    spec, engine, layers, tokens, optimizer = PLANNED[case]
    config = preset_config("tiny-llama", num_hidden_layers=layers)
    strategy = lt.Strategy.parse(spec, engine=engine)
    sizes = []
    once = simulation._simulate_once
    monkeypatch.setattr(simulation, "_simulate_once", lambda config, tokens, *a, **k: (
        sizes.append((config.num_hidden_layers, tokens)), once(config, tokens, *a, **k))[1])

    def figures(**options):
        sizes.clear()
        report = simulate(config, tokens, strategy=strategy, optimizer=optimizer, dtype="float32", **options)
        return (report.device_peak_bytes, report.peak.peak_host_bytes, report.peak.host_bytes_at_peak), list(sizes)

    (checked, checked_sizes), (planned, planned_sizes) = figures(), figures(planning=True)
    assert planned == checked  # (the extrapolation against the whole model: tests/test_simulate_fast.py)
    assert sum(n * t for n, t in planned_sizes) < sum(n * t for n, t in checked_sizes)
    if case in ("checkpoint, top layers whole", "memo"):  # three layers apart at the top (memo: keep_last=2)
        assert planned_sizes == [(12, tokens)] and len(checked_sizes) == 3
    else:  # one check simulation fewer per axis
        assert len(planned_sizes) == len(checked_sizes) - 1


def test_plan_ranks_what_fits_fastest_first_and_names_what_binds():
    roomy = plan(PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=GIB, exhaustive=True,
                             optimizer_offload=False))
    assert roomy.best is not None and all(r.fits for r in roomy.rows)
    assert [r.step_seconds for r in roomy.rows] == sorted(r.step_seconds for r in roomy.rows)
    smallest = min(r.reserved_bytes for r in roomy.rows)
    tight = plan(PlanRequest("tiny-llama", 2048, device_memory=smallest - 1, host_memory=GIB, optimizer_offload=False))
    assert tight.best is None and all("device memory: needs" in row.binds for row in tight.rows)
    assert "nothing fits 2,048 tokens" in tight.table()
    assert "fastest that fits" in roomy.table() and "tokens/s" in roomy.table()


def test_a_plan_request_refuses_each_wrong_field_in_one_line():
    """What a plan is asked is checked once, when the request is built: each wrong field is
    refused in one line naming it and its `longtrain plan` option. How the plan is computed
    (workers, progress) is apart, plan()'s own."""
    import dataclasses

    for fields, message in [
        ({"model": ""}, "model (--model) must be a preset name"),
        ({"seq_len": 1}, "seq_len (--seq-len) must be a whole number of at least 2 tokens, got 1"),
        ({"device_memory": 0}, "device_memory (--device-memory) must be a positive number of bytes, got 0"),
        ({"host_memory": 1.5}, "host_memory (--host-memory) must be a positive number of bytes"),
        ({"optimizer": "lion"}, "optimizer (--optimizer) must be one of adamw, adamw-16bit, sgd, none, got 'lion'"),
        ({"dtype": "fp7"}, "unknown dtype 'fp7'"),
        ({"rates": "h100"}, "rates (--rates) must be MachineRates"),
        ({"batch": True}, "batch (--batch-size) must be a positive count, got True"),
        ({"gpus": 0}, "gpus (--gpus) must be a positive count, got 0"),
        ({"lora_rank": 0}, "lora_rank (--lora-rank) must be a positive count or None"),
        ({"optimizer_offload": "yes"}, "optimizer_offload (--optimizer-offload) must be True"),
        ({"engine": "nope"}, "unknown engine 'nope'"),
        ({"exhaustive": 1}, "exhaustive (--exhaustive) must be True or False, got 1"),
    ]:
        with pytest.raises(lt.LongtrainError) as refused:
            PlanRequest(**{"model": "tiny-llama", "seq_len": 2048, "device_memory": GIB, "host_memory": GIB, **fields})
        assert message in str(refused.value) and "\n" not in str(refused.value), (fields, str(refused.value))
    request = PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=GIB)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.gpus = 2
    with pytest.raises(lt.LongtrainError, match=r"plan\(\) takes a PlanRequest"):
        plan("tiny-llama")
    with pytest.raises(lt.LongtrainError, match=r"workers \(--jobs\) must be a positive count"):
        plan(request, workers=0)


def test_a_rows_name_is_computed_from_its_strategy():
    """A row is named by its strategy's fields (Strategy.label: the spec with host budgets left
    out, a flag named alone, MsT last, +spN), also the rows the plan derives from a
    candidate — top layers left whole, sequence parallel — never by editing another label."""
    checkpointed = lt.Strategy(checkpoint={"host_memory": GIB, "except_last": 4, "offload_inputs": True}, mst=True)
    assert checkpointed.label == "checkpoint:except_last=4:offload_inputs,mst"
    chunked = lt.Strategy.parse("mst", engine="fpdt:chunk=8192:offload=true:keep_output=3", sequence_parallel=2)
    assert chunked.label == "fpdt:chunk=8192:offload:keep_output=3,mst+sp2"
    assert lt.Strategy(engine="adjoint", engine_options={"recompute": False}).label == \
        "adjoint:recompute=false"
    config = preset_config("tiny-llama", num_hidden_layers=8)
    for request in (PlanRequest(config, 2048, device_memory=GIB, host_memory=GIB, optimizer="none", exhaustive=True),
                    PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=GIB, gpus=2, exhaustive=True)):
        rows = plan(request).rows
        assert rows and all(row.name == lt.Strategy.from_dict(row.strategy).label for row in rows)
        assert any("except_last=" in row.name or "+sp2" in row.name for row in rows)


def test_a_plan_row_is_built_by_keyword_and_prints_the_train_options_that_run_it():
    """A row names its strategy as --strategy reads it; AdamW's place is a field of its own,
    never a note in the name: its flags and the plan's command line paste into train whole."""
    with pytest.raises(TypeError):
        planner.PlanRow("checkpoint,mst", {})  # keyword-built only
    fpdt = lt.Strategy.parse("fpdt:chunk=32768:segment=6,mst")
    offloaded = planner.PlanRow(name="fpdt:chunk=32768:segment=6,mst", strategy=fpdt.to_dict(), fits=True,
                                optimizer_offload=True)
    spread = planner.PlanRow(name="checkpoint,mst+sp2", strategy=lt.Strategy.parse("checkpoint,mst+sp2").to_dict(),
                             fits=True)
    assert offloaded.name == "fpdt:chunk=32768:segment=6,mst"
    assert offloaded.flags() == ["--strategy", "fpdt:chunk=32768:segment=6,mst", "--optimizer-offload"]
    assert spread.flags() == ["--strategy", "checkpoint,mst+sp2", "--sp", "2"]
    one = planner.Plan(model="llama3-8b", seq_len=512 * K, device_memory=80 * GIB, host_memory=128 * GIB,
                       optimizer="adamw", dtype="bfloat16", rows=[offloaded])
    assert one.command() == ("longtrain train --model llama3-8b --seq-len 512K --strategy fpdt:chunk=32768:segment=6,mst "
                             "--optimizer-offload")
    two = planner.Plan(model="llama3-8b", seq_len=300_000, device_memory=80 * GIB, host_memory=128 * GIB,
                       optimizer="sgd", dtype="bfloat16", rows=[spread], gpus=2, lora_rank=16)
    assert two.command() == ("torchrun --nproc-per-node 2 -m longtrain.cli train --model llama3-8b --seq-len 300000 "
                             "--strategy checkpoint,mst+sp2 --sp 2 --lora --lora-rank 16 --optimizer sgd")
    over_4bit = planner.Plan(model="llama3-8b", seq_len=512 * K, device_memory=80 * GIB, host_memory=128 * GIB,
                             optimizer="adamw", dtype="bfloat16", rows=[offloaded], lora_rank=16, four_bit=True)
    assert over_4bit.command().endswith("--lora --lora-rank 16 --4bit")


def test_a_4bit_base_is_planned_at_its_4bit_bytes():
    """`plan --lora --4bit`: the weights the plan counts beside every candidate are the 4-bit
    base's (bitsandbytes NF4 on every linear layer but the head: about half a byte a value,
    the embeddings and head in bf16); --4bit without --lora is refused."""
    from longtrain.models.loading import build_from_config
    from longtrain.plan.bounds import budgets_for
    from longtrain.plan.fake_model import four_bit_weight_bytes, with_4bit_base

    config = preset_config("llama3-8b")
    dtype = torch.bfloat16
    weights = four_bit_weight_bytes(with_4bit_base(preset_config("llama3-8b")), dtype)
    with torch.device("meta"):
        model = build_from_config(config, dtype)
    linear = [m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear and m is not model.lm_head]
    other = sum(p.numel() for p in model.parameters()) - sum(linear)
    # packed values, a float32 scale per 64 of them; everything else (embeddings, head, norms) in bf16
    assert weights == 2 * other + sum(-(-n // 2) + 4 * -(-n // 64) for n in linear)
    assert four_bit_weight_bytes(config, dtype) is None
    _, (bf16,) = budgets_for(config, device_memory=80 * GIB, host_memory=128 * GIB, optimizer="adamw", dtype=dtype,
                             lora_rank=16)
    _, (nf4,) = budgets_for(with_4bit_base(preset_config("llama3-8b")), device_memory=80 * GIB, host_memory=128 * GIB,
                            optimizer="adamw", dtype=dtype, lora_rank=16)
    assert nf4.persistent == weights and bf16.persistent > 2.5 * nf4.persistent
    with pytest.raises(lt.LongtrainError, match=r"four_bit \(--4bit\) holds the base in 4 bits.*add --lora"):
        PlanRequest("llama3-8b", 4096, device_memory=80 * GIB, host_memory=128 * GIB, four_bit=True)


def test_a_refusal_quotes_the_whole_models_layers_and_host_budget():
    """Memo refuses a step whose inputs and attention outputs exceed its host budget. The
    simulation runs a few of the model's layers with a share of that budget: the refusal
    a plan row (or simulate) quotes is the whole model's — its swapped layers and the
    budget given — not the small simulation's; the row's verdict is that line."""
    from longtrain.memory.units import format_bytes

    config = preset_config("tiny-llama", num_hidden_layers=12)
    tokens = K
    hidden = tokens * config.hidden_size * 2
    host = 15 * hidden  # holds the 12 inputs (the bound), not 10 inputs and attention outputs
    strategy = lt.Strategy(memo={"host_memory": host}, mst=True)
    with pytest.raises(lt.LongtrainError) as refused:
        simulate_step(config, tokens, strategy, "bfloat16")
    assert "10 layers × " in str(refused.value) and f"over the host budget of {format_bytes(host)}" in str(refused.value)

    def refused_again():
        raise refused.value

    budget = planner.Budget(GIB, host, 0, 0, 0, "none")
    memo = planner._evaluate(strategy, config, tokens, budget, planner.H100, 1, 0, refused_again)
    assert memo.binds.startswith("memo keeps every layer's input and attention output in host memory: 10 layers × ")
    assert f"over the host budget of {format_bytes(host)}" in memo.binds


def test_plan_refuses_at_once_when_the_model_states_alone_do_not_fit():
    with pytest.raises(lt.LongtrainError, match="model states alone.*exceed the device's 20.00 GiB"):
        plan(PlanRequest("llama3-8b", 4096, device_memory=20 * GIB, host_memory=GIB, optimizer_offload=False))
    with pytest.raises(lt.LongtrainError, match="model states alone.*the weights alone, 14.96 GiB, still exceed it"):
        plan(PlanRequest("llama3-8b", 4096, device_memory=10 * GIB, host_memory=GIB))
    with pytest.raises(lt.LongtrainError, match=r"the weights alone \(14.96 GiB\) exceed the device's 10.00 GiB"):
        plan(PlanRequest("llama3-8b", 4096, device_memory=10 * GIB, host_memory=GIB, optimizer_offload=True))


def test_optimizer_in_host_memory_frees_the_device_and_fills_the_host():
    on_device = plan(PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=GIB,
                                 optimizer_offload=False, exhaustive=True))
    on_host = plan(PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=GIB, optimizer_offload=True,
                               exhaustive=True))
    params = 320 * 64 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 176)  # roughly: what must move is several bytes per parameter
    for a, b in zip(sorted(on_device.rows, key=lambda r: r.name), sorted(on_host.rows, key=lambda r: r.name)):
        if a.device_bytes is None or b.device_bytes is None:
            continue
        assert b.optimizer_offload and not a.optimizer_offload
        assert b.device_bytes < a.device_bytes and b.host_bytes >= a.host_bytes + 12 * params * 0.5
        assert b.step_seconds > a.step_seconds  # the CPU's AdamW step
    with pytest.raises(lt.LongtrainError, match="--optimizer-offload plans"):
        plan(PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=GIB, optimizer_offload=True, optimizer="sgd"))


def test_candidates_whose_parked_bytes_cannot_fit_are_not_simulated_nor_the_slower_ones():
    result = plan(PlanRequest("tiny-llama", 8192, device_memory=3 * 2**19, host_memory=3 * 2**20,
                              optimizer="adamw-16bit", optimizer_offload=False))
    bounded = [r for r in result.rows if r.binds and "not simulated" in r.binds]
    assert bounded and all(r.device_bytes is None for r in bounded) and len(bounded) < len(result.rows)
    # Where no candidate can fit by what it parks, the plan is refused at once.
    with pytest.raises(lt.LongtrainError, match="no strategy weighed fits 32,768 tokens.*the longest any could fit is"):
        plan(PlanRequest("tiny-llama", 32768, device_memory=3 * 2**20, host_memory=3 * 2**20, optimizer="adamw-16bit",
                         optimizer_offload=False))
    if result.best is not None:
        slower = [r for r in result.rows if "skipped" in r.notes]
        assert all(r.step_seconds is None for r in slower)


def test_segments_cost_one_more_forward_of_the_inner_layers():
    config = preset_config("llama3-8b")
    base = step_time(config, 256 * K, lt.Strategy.parse("mst", engine="fpdt:chunk=16384"))
    segmented = step_time(config, 256 * K, lt.Strategy.parse("mst", engine="fpdt:chunk=16384:segment=4"))
    assert 1.1 < segmented.seconds / base.seconds < 1.3


def test_plan_command_line(capsys):
    assert main(["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "1GB",
                 "--jobs", "1"]) == 0
    assert "fastest that fits" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "lots", "--host-memory", "1GB"])
    assert exit_info.value.code == 2
    assert "cannot read size 'lots'" in capsys.readouterr().err
    tight = ["plan", "--model", "llama3-8b", "--seq-len", "1M", "--device-memory", "20GiB", "--host-memory", "1GB"]
    assert main(tight) == 2  # with AdamW in host memory the weights fit; nothing else does (bounds, no simulation)
    err = capsys.readouterr().err
    assert "no strategy weighed fits 1,048,576 tokens" in err and len(err.strip().splitlines()) == 1
    assert main(tight + ["--no-optimizer-offload"]) == 2  # weights, gradients and AdamW alone exceed 20 GiB
    assert main(tight + ["--gpus", "0"]) == 2
    assert main(tight + ["--jobs", "0"]) == 2


def test_a_plan_simulated_in_worker_processes_is_the_plan_simulated_here():
    """`longtrain plan` simulates candidates in a process per core (an 8B candidate takes a
    minute of one); the rows must not depend on where they were simulated, nor on how many
    processes simulate: a candidate a second worker started ahead of the winner is skipped
    as the one-worker plan skips it (the command line takes a worker per core); the rows
    simulated in the workers carry the figures simulated here."""
    def rows(workers):
        steps.clear_caches()
        result = plan(PlanRequest("tiny-llama", 2048, device_memory=2**30, host_memory=2**30), workers=workers)
        return [(r.name, r.device_bytes, r.host_bytes, r.fits, r.step_seconds, r.simulated, r.notes) for r in result.rows]

    alone = rows(1)
    assert 1 <= sum(simulated for *_, simulated, _ in alone) < len(alone) and rows(2) == alone


@pytest.mark.parametrize("engine", ["fpdt:chunk=128:segment=2", "fpdt:chunk=128:offload=true:keep_output=1"])
def test_a_worker_hands_back_the_chunk_curves_it_made(engine):
    """A worker's FPDT simulation reads a chunk curve; the parent gets it (peaks only,
    pickled as between processes) so `plan --longest` searches it without simulating again.
    Also with some layers' attention outputs kept: its curve carries their correction, which
    was a closure that could not be pickled — `longtrain plan` at 256K with a host budget
    died on it."""
    import json
    import pickle

    config = planner.load_config("tiny-llama")
    strategy = lt.Strategy.parse("mst", engine=engine)
    steps.clear_caches()
    sent = steps.simulate_elsewhere(json.dumps(config.to_dict(), default=str), 2048, strategy.to_json(),
                                    "bfloat16", 1, "none", None)
    result, curves = pickle.loads(pickle.dumps(sent))  # what goes back from a worker process
    (key, light), = curves.items()
    full = steps.cached_curves()[key]
    assert light.fewest == full.fewest and light.notes == full.notes
    assert all(light.peaks(n) == full.peaks(n) for n in range(full.fewest, 64))
    assert result[:2] == full.peaks(2048 // 128)
    with pytest.raises(ValueError, match="peaks only"):
        light.report(full.fewest)


def test_plan_longest_is_the_search_of_each_fitting_row():
    result = plan(PlanRequest("tiny-llama", 1024, device_memory=2**24, host_memory=2**24, longest=True,
                              optimizer_offload=False))
    row = result.best
    assert row.longest >= 1024 and row.longest_binds in ("device memory", "host memory")
    strategy = lt.Strategy.from_dict(row.strategy)
    config = planner.load_config("tiny-llama")
    config.max_position_embeddings = 2 * 1024  # as plan() sets it: the same simulations
    budget = planner.budgets_for(config, device_memory=2**24, host_memory=2**24, optimizer="adamw",
                                 dtype=torch.bfloat16, optimizer_offload=False)[1][0]
    device, host, _ = planner.simulate_step(config, row.longest, strategy, "bfloat16")
    assert overflow(strategy, budget, device, host)[0] <= 0


def test_train_with_strategy_auto_uses_the_plans_winner(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny-llama", "--seq-len", "256", "--steps", "1", "--strategy", "auto",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--strategy auto chose fastest that fits" in printed
    assert main(["train", "--model", "tiny-llama", "--seq-len", "256", "--steps", "1", "--strategy", "auto",
                 "--engine", "fpdt", "--out", str(tmp_path / "other")]) == 2
    assert "--strategy auto picks the engine itself" in capsys.readouterr().err


def test_calibrate_stores_rates_the_planner_reads(capsys):
    assert main(["calibrate", "--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    name = out.rsplit("--rates ", 1)[1].strip()
    from longtrain.plan.calibrate import load

    rates = load(name)
    assert rates.matmul > 0 and rates.cpu_adam > 0 and rates.peak == rates.matmul
    # What it could not measure is not stored: a later version's defaults fill it (rates
    # fitted together, like per_chunk_layer and offload_exposed, are never mixed across versions).
    import json

    from longtrain.plan.calibrate import store_dir
    stored = json.loads((store_dir() / f"{name}.json").read_text())
    assert "matmul" in stored and "per_chunk_layer" not in stored and rates.per_chunk_layer == H100.per_chunk_layer
    assert main(["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "1GB",
                 "--rates", name]) == 0
    assert f"on 1 GPU at the {name} rates" in capsys.readouterr().out
    assert main(["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "1GB",
                 "--rates", "a100"]) == 2
    assert "no calibration 'a100'" in capsys.readouterr().err
    assert main(["calibrate", "--device", "tpu"]) == 2


def test_plan_over_several_gpus_shards_states_and_splits_the_sequence():
    one = plan(PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=GIB, optimizer_offload=False,
                           exhaustive=True))
    two = plan(PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=GIB, gpus=2, exhaustive=True))
    row_one = next(r for r in one.rows if r.name == "checkpoint,mst")
    row_two = next(r for r in two.rows if r.name == "checkpoint,mst+sp2")  # (memo does not run under SP yet)
    assert row_two.strategy["sequence_parallel"]["degree"] == 2
    assert row_two.device_bytes < row_one.device_bytes
    assert "on 2 GPUs at the h100 rates" in two.verdict()


def test_plan_over_data_parallel_groups_shards_over_every_gpu_and_splits_the_sequence_in_its_group():
    """`--gpus 4 --sp 2`: two data-parallel groups of two. A row's sequence is split over its
    group (the activations of `--gpus 2`), its states over all four GPUs (less than `--gpus 2`
    holds); it runs under torchrun with 4 processes and `--sp 2`, and its tokens/s counts both
    groups' batches."""
    request = dict(device_memory=GIB, host_memory=GIB, optimizer_offload=False, exhaustive=True)
    two = plan(PlanRequest("tiny-llama", 2048, gpus=2, **request))
    groups = plan(PlanRequest("tiny-llama", 2048, gpus=4, sp=2, **request))
    row_two = next(r for r in two.rows if r.name == "checkpoint,mst+sp2")
    row = next(r for r in groups.rows if r.name == "checkpoint,mst+sp2")
    assert row.strategy["sequence_parallel"] == {**row_two.strategy["sequence_parallel"], "processes": 4}
    assert row.device_bytes < row_two.device_bytes
    assert row.step_seconds == pytest.approx(row_two.step_seconds) and row.tokens_per_s == pytest.approx(2 * row_two.tokens_per_s)
    command = groups.command(row)
    assert command.startswith("torchrun --nproc-per-node 4 -m longtrain.cli train") and "--sp 2" in command
    assert "4 GPU(s) of 1.00 GiB in groups of 2 sharing each sequence" in groups.table()
    for sp in (1, 3):
        with pytest.raises(lt.LongtrainError, match=r"sp \(--sp\) must divide gpus \(4\)"):
            PlanRequest("tiny-llama", 2048, gpus=4, sp=sp, **request)


def test_fpdt_is_predicted_without_the_mlp_output_only_where_the_adapter_allows():
    """FPDT's recomputed layer skips its MLP output unless a later op saves it (Gemma-2):
    the same shapes predict one MLP forward per layer more as Gemma-2 than as Llama."""
    config = preset_config("tiny-gemma2")
    fpdt = lt.Strategy.parse("mst", engine="fpdt:chunk=256")
    gemma = step_time(config, 4096, fpdt).parts["matmul"]
    config.model_type = "llama"
    llama = step_time(config, 4096, fpdt).parts["matmul"]
    mlp = 2.0 * 4096 * 3 * config.hidden_size * config.intermediate_size * config.num_hidden_layers
    assert gemma - llama == pytest.approx(mlp / H100.matmul)


def test_fpdt_keeps_as_many_attention_outputs_as_the_host_holds():
    """Where every layer's attention output does not fit the host beside the parked inputs,
    the planner weighs FPDT keeping the lowest layers' outputs that do: the candidate
    names its count (so its simulation's chunk curve does not count again per length), the
    simulated step's host peak stays within the budget, and its predicted time lies between
    keeping none and keeping all."""
    config = preset_config("llama3-8b", num_hidden_layers=4, hidden_size=256, intermediate_size=704, vocab_size=2048,
                           num_attention_heads=4, num_key_value_heads=2)
    tokens = 2048
    options = {"chunk": 512, "offload": True}
    every = lt.Strategy(engine="fpdt", engine_options={**options, "keep_output": True}, mst=True)
    none = lt.Strategy(engine="fpdt", engine_options=options, mst=True)
    fit = lt.Strategy(engine="fpdt", engine_options={**options, "keep_output": "fit"}, mst=True)
    settings = none.engine_options.settings()
    parked = [parked_host_bytes(config, 1, tokens, 2, settings, kept) for kept in (0, 1)]
    room = parked[0] + 5 * (parked[1] - parked[0]) // 2  # two and a half layers' outputs
    counted = planner.outputs_kept_within(config, tokens, fit, 2, 1, room)
    assert counted.engine_options.keep_output == 2
    assert counted.label == "fpdt:chunk=512:offload:keep_output=2,mst"  # named by its count
    _, host, _ = simulate_step(config, tokens, counted, "bfloat16")
    assert parked[0] < host <= room
    seconds = [step_time(config, tokens, s).seconds for s in (every, counted, none)]
    assert seconds == sorted(seconds) and seconds[0] < seconds[2]
    assert planner.outputs_kept_within(config, tokens, fit, 2, 1, 2 * room) is None  # every layer's: that candidate
    assert planner.outputs_kept_within(config, tokens, fit, 2, 1, parked[0]) is None  # none: the plain one
    assert planner.outputs_kept_within(config, tokens, none, 2, 1, room) == none


def test_plans_weigh_the_engines_and_techniques_that_serve_the_model():
    """A state-space model is offered the adjoint engine (states recomputed and kept, inputs
    parked) and parked checkpoint inputs, never chunked attention or Memo; a transformer
    never the adjoint engine."""
    from longtrain.models.adapters import adapter_class
    from longtrain.plan.candidates import candidates

    ssm = candidates(256 * K, 64 * GIB, 24, adapter=adapter_class("mamba"))
    assert {"adjoint", "adjoint:offload_inputs", "adjoint:recompute=false", "checkpoint,mst",
            "checkpoint:offload_inputs,mst"} <= ssm.keys()
    assert not [label for label in ssm if label.startswith(("fpdt", "seco", "spaco", "memo"))]
    llama = candidates(256 * K, 64 * GIB, 32, adapter=adapter_class("llama"))
    assert not [label for label in llama if "adjoint" in label]
    assert any(label.startswith("fpdt") for label in llama) and "memo,mst" in llama


def test_a_plan_for_mamba_ranks_the_adjoint_engine(capsys):
    """`longtrain plan` on a Mamba: the adjoint engine weighed beside checkpointing, its states
    kept predicted faster than rebuilt; sequence parallelism (over attention heads) refused."""
    assert main(["plan", "--model", "tiny-mamba", "--seq-len", "2K", "--device-memory", "1GiB",
                 "--host-memory", "4GiB", "--no-optimizer-offload", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "Python step per token and layer" in out and "estimated token_step" in out  # the stock scan
    rows = [line.split()[1] for line in out.splitlines() if line.startswith("--strategy ")]
    assert sorted(rows) == ["adjoint", "adjoint:offload_inputs", "adjoint:recompute=false", "checkpoint,mst",
                            "checkpoint:offload_inputs,mst"]
    # No layer rebuilt; and the stock scan's Python step per token, charged at an estimated rate, last.
    assert rows.index("adjoint:recompute=false") < rows.index("adjoint") < rows.index("checkpoint,mst")
    assert main(["plan", "--model", "tiny-mamba", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "4GiB",
                 "--gpus", "2"]) == 2
    assert "has no attention; plan one GPU" in capsys.readouterr().err


def test_parked_adjoint_inputs_are_planned_with_the_adjoint_engines_margin(capsys):
    """``adjoint:offload_inputs`` fetches its inputs on the compute stream, as checkpointing
    does: the plan reserves no more for it than for the adjoint engine keeping them."""
    assert main(["plan", "--model", "tiny-mamba", "--seq-len", "8K", "--device-memory", "1GiB", "--host-memory", "4GiB",
                 "--no-optimizer-offload", "--jobs", "1", "--engine", "adjoint", "--exhaustive"]) == 0
    rows = {line.split()[1]: line.split()[2:] for line in capsys.readouterr().out.splitlines()
            if line.startswith("--strategy adjoint")}
    plain, parked = (parse_bytes(" ".join(rows[name][:2])) for name in ("adjoint", "adjoint:offload_inputs"))
    assert 0 < parked <= plain and rows["adjoint:offload_inputs"][2:4] != ["0", "B"]


def test_plan_weighs_one_engine_when_asked(capsys):
    assert main(["plan", "--model", "tiny-mamba", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "4GiB",
                 "--no-optimizer-offload", "--jobs", "1", "--engine", "adjoint"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint" not in out and "fastest that fits: --strategy adjoint" in out
    assert main(["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "4GiB",
                 "--engine", "adjoint"]) == 2
    assert "--engine adjoint: a plan weighs no adjoint candidate for llama models; engines it weighs for them: backprop, " \
           "fpdt" in capsys.readouterr().err
    plan = ["plan", "--model", "tiny-llama", "--device-memory", "1GiB", "--host-memory", "4GiB", "--jobs", "1"]
    # FPDT's candidates split a sequence in 8K-token chunks or more: none at 8K.
    assert main([*plan, "--seq-len", "8K", "--engine", "fpdt"]) == 2
    assert "--engine fpdt: none of its candidates runs 8,192 tokens in more than one chunk" in capsys.readouterr().err
    assert main([*plan, "--seq-len", "2K", "--engine", "fpdt:chunk=512"]) == 2
    assert "--engine fpdt:chunk=512: a plan takes an engine's name (e.g. fpdt)" in capsys.readouterr().err
    assert main([*plan, "--seq-len", "2K", "--dtype", "float32", "--optimizer", "adamw-16bit"]) == 2
    assert "--optimizer adamw-16bit steps AdamW on 16-bit weights, and --dtype float32 is not" in capsys.readouterr().err


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


def test_a_plan_does_not_wait_for_the_simulations_it_started_ahead_and_no_longer_needs():
    """Once a plan has its rows, a simulation a worker started ahead (the candidate after the
    winner) is not waited for: the workers are ended on the way out. A plan at 512K waited
    40 s for one."""
    with steps._Simulations(2) as simulations:
        started_ahead = simulations.call(_sleep, 600)
        processes = list(simulations.executor._processes.values())
    from concurrent.futures import CancelledError
    from multiprocessing.connection import wait

    ending = [process.sentinel for process in processes]
    while ending:  # each worker ends (SIGTERM), without finishing the simulation it runs
        ended = wait(ending)
        ending = [sentinel for sentinel in ending if sentinel not in ended]
    assert processes
    try:  # never run (cancelled), or ended with its worker (BrokenProcessPool): not finished
        outcome = started_ahead.exception()
    except CancelledError:
        outcome = "cancelled"
    assert outcome is not None


def test_auto_plans_for_the_memory_the_allocator_allows(monkeypatch):
    """`--strategy auto` on a GPU whose allocator is capped (torch.cuda.set_per_process_memory_fraction,
    e.g. an 80 GB card's share of an H200) plans for the cap, not the whole device."""
    from types import SimpleNamespace

    from torch.cuda._utils import _get_device_index

    from longtrain.plan import auto

    def properties(device):
        _get_device_index(device, optional=True)  # as torch.cuda.get_device_properties reads it
        return SimpleNamespace(total_memory=140 * 2**30)

    def fraction(device):
        _get_device_index(device)  # as torch.cuda's query reads it: no bare "cuda"
        return 80 / 140

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction, raising=False)
    assert auto._usable_device_memory(torch.device("cuda")) == 80 * 2**30
    assert auto._usable_device_memory(torch.device("cuda", 0)) == 80 * 2**30


def test_kept_outputs_on_the_device_cost_no_host_copies_and_count_in_the_bound():
    """``checkpoint:offload=false`` (selective checkpointing's placement) is predicted faster
    than the same outputs through host memory, and its kept outputs are parked on the device
    in the bound, so a length they cannot fit is refused without a simulation."""
    from longtrain.models.shapes import kept_output_bytes
    from longtrain.plan.bounds import parked_split

    config, n = preset_config("llama3-8b"), 128 * K
    on_host, on_device = (step_time(config, n, lt.Strategy.parse(s)) for s in ("checkpoint,mst", "checkpoint:offload=false,mst"))
    assert on_device.seconds < on_host.seconds and "exposed_copies" in on_host.parts and "exposed_copies" not in on_device.parts
    device_kept, _ = parked_split(config, n, lt.Strategy.parse("checkpoint:offload=false,mst"), 2)
    device_plain, _ = parked_split(config, n, lt.Strategy.parse("checkpoint,mst"), 2)
    assert device_kept - device_plain == 32 * kept_output_bytes(config, 1, n, 2)
