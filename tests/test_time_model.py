"""The time model against every GPU step stored in docs/results (the built-in H100 and H200
tables within 10%, their measured order kept), its elementwise term, the tables chosen by
card, and what `--strategy auto` ranks with them."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

import longtrain as lt
from longtrain.cli import main
from longtrain.models.adapters import describe_model
from longtrain.models.presets import preset_config
from longtrain.plan.bounds import parked_split
from longtrain.plan.calibrate import load, local_rates
from longtrain.plan.candidates import candidates
from longtrain.plan.time_model import H100, H200, built_in_for, step_time

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import time_model_fit  # noqa: E402

K = 1024
ROWS = [row for row in time_model_fit._stored_rows() if row.left_out is None]
TABLE = {"H100": H100, "H200": H200}


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.card}-{r.tokens // K}K-{r.case}-{r.source}" for r in ROWS])
def test_the_built_in_tables_predict_every_stored_gpu_row_within_10_percent(row):
    assert abs(row.predict(TABLE[row.card]) / row.measured - 1) <= 0.10, (row.case, row.predict(TABLE[row.card]), row.measured)


def test_every_stored_row_is_described_or_says_why_not():
    rows = time_model_fit._stored_rows()
    assert len(rows) >= 45 and {r.card for r in rows} == {"H100", "H200"}
    left_out = {r.case for r in rows if r.left_out}
    # save_on_cpu; Memo's H100 code of its date; planned_step.json's whole step (its optimizer update timed too)
    assert left_out == {"hf+liger+offload", "lt:memo+mst", "fpdt:chunk=32768:keep_output,mst"}
    assert all(r.left_out for r in rows if r.case == "lt:memo+mst" and r.card == "H100")


def test_cases_measured_apart_are_predicted_in_their_measured_order():
    """Within a run and a length, every pair measured more than 3.5% apart (the run-to-run
    spread of one case on the H200) is predicted in that order, but Memo's: the model
    charges its token-wise swap nothing beyond the copies its compute does not hide."""
    for card in ("H100", "H200"):
        wrong = time_model_fit._ranked_wrong([r for r in ROWS if r.card == card], TABLE[card])
        assert all("lt:memo+mst" in pair for pair in wrong), wrong


def test_the_committed_fit_report_matches_the_built_in_tables():
    report = json.loads((ROOT / "docs/results/time_model_fit.json").read_text())
    for card, rates in TABLE.items():
        for name in time_model_fit.FITTED:
            assert getattr(rates, name) == pytest.approx(report["tables"][card][name], rel=0.005), (card, name)
    assert all(entry["auto_predicted_fastest"] for entry in report["auto_h200"])
    assert [entry["tokens"] for entry in report["auto_h200"]] == [32 * K, 64 * K, 128 * K]
    markdown = (ROOT / "docs/results/time_model_fit.md").read_text()
    assert markdown == "\n".join(time_model_fit.markdown(report)) + "\n"  # the table is the JSON's


def test_the_fit_recovers_rates_it_is_given():
    """Rows made by the model at known rates: the fit, from the H100 table as its prior,
    reproduces them and finds the matmul rate (within its pull toward the prior)."""
    known = dataclasses.replace(H100, matmul=7.0e14, elementwise=2.0e12)
    rows = [dataclasses.replace(r, measured=r.predict(known)) for r in ROWS if r.card == "H100"]
    fitted = time_model_fit.fit(rows, H100, iterations=8)
    assert max(abs(r.predict(fitted) / r.measured - 1) for r in rows) < 0.02  # the prior pulls a little
    assert fitted.matmul == pytest.approx(7.0e14, rel=0.03)


def test_liger_is_predicted_faster_by_the_bytes_its_fused_kernels_do_not_move():
    config = preset_config("llama3-8b")
    shape = describe_model(config)
    stock, fused = shape.elementwise_bytes(2), shape.elementwise_bytes(2, frozenset({"norm", "rope", "mlp"}))
    assert fused[0] < stock[0] / 2 and fused[1] < stock[1]
    for spec in ("checkpoint,mst", "checkpoint:keep_attention=false,mst", "mst"):
        plain = step_time(config, 32 * K, lt.Strategy.parse(spec), H200)
        liger = step_time(config, 32 * K, lt.Strategy.parse(spec + ",liger"), H200)
        saved = plain.parts["elementwise"] - liger.parts["elementwise"]
        assert saved > 0 and plain.seconds - liger.seconds == pytest.approx(saved)
        assert {k: v for k, v in plain.parts.items() if k != "elementwise"} == \
               {k: v for k, v in liger.parts.items() if k != "elementwise"}
    # Checkpointing runs every layer's forward once more: a fourth pass over its elementwise work.
    once, again = (step_time(config, 32 * K, lt.Strategy.parse(spec), H200).parts["elementwise"]
                   for spec in ("mst:mlp=false", "checkpoint,mst:mlp=false"))
    assert again == pytest.approx(once * 4 / 3)


def test_head_dims_cudnn_does_not_take_are_predicted_at_flash_attentions_rate():
    """Gemma-2's 256-wide heads run FlashAttention-2, not cuDNN (ops.attention_blocks.cudnn_takes):
    its attention at flash_attention_share of the rate, whole-sequence and in blocks alike."""
    config = preset_config("llama3-8b")
    wide = preset_config("llama3-8b")
    wide.head_dim, wide.num_attention_heads, wide.num_key_value_heads = 256, 16, 4  # the same width
    for spec in ("checkpoint,mst", "fpdt:chunk=8192,mst"):
        strategy = lt.Strategy.parse(spec)
        narrow_part = step_time(config, 32 * K, strategy, H200).parts["attention"]
        assert step_time(wide, 32 * K, strategy, H200).parts["attention"] == pytest.approx(
            narrow_part / H200.flash_attention_share)


def test_each_card_gets_its_own_table():
    assert built_in_for("nvidia-h200") == ("h200", H200) and built_in_for("NVIDIA H200 NVL")[1] is H200
    assert built_in_for("nvidia-h100-80gb-hbm3") == ("h100", H100) and built_in_for("nvidia-a100-sxm4-80gb") == ("h100", H100)
    assert load("h200") is H200 and load("H100") is H100


def test_a_calibration_takes_what_it_did_not_measure_from_its_cards_table(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGTRAIN_CACHE", str(tmp_path))
    (tmp_path / "rates").mkdir()
    (tmp_path / "rates" / "nvidia-h200.json").write_text(json.dumps({"matmul": 7.0e14}))
    rates = load("nvidia-h200")
    assert rates.matmul == 7.0e14 and rates.elementwise == H200.elementwise and rates.per_chunk_layer == H200.per_chunk_layer
    for empty in ("{}", "[]"):  # nothing measured: not the card's table under another name
        (tmp_path / "empty.json").write_text(empty)
        with pytest.raises(lt.LongtrainError, match="is not a calibration written by `longtrain calibrate`"):
            load(str(tmp_path / "empty.json"))


def test_this_machine_gets_its_calibration_else_a_built_in_table(tmp_path, monkeypatch):
    import torch

    from longtrain.plan.calibrate import device_name

    monkeypatch.setenv("LONGTRAIN_CACHE", str(tmp_path))
    (tmp_path / "rates").mkdir()
    name = device_name(torch.device("cpu"))
    (tmp_path / "rates" / f"{name}.json").write_text(json.dumps({"matmul": 1.0e11}))
    assert local_rates(torch.device("cpu"))[0] == name and local_rates(torch.device("cpu"))[1].matmul == 1.0e11
    (tmp_path / "rates" / f"{name}.json").unlink()
    assert local_rates(torch.device("cpu")) == ("h100", H100)


def test_carried_techniques_ride_with_every_candidate_that_combines_with_them():
    from longtrain import registry

    found = candidates(32 * K, 64 * 2**30, 32, carried=("liger",))
    takes = [s for s in found.values() if "liger" in registry.engine(s.engine).accepts]
    assert len(takes) < len(found)  # the adjoint engine takes no liger
    assert all("liger" in s.techniques for s in takes if "memo" not in s.techniques)
    assert all("liger" not in s.techniques for s in found.values() if "memo" in s.techniques)  # memo refuses liger
    assert all("liger" not in s.techniques for s in candidates(32 * K, 64 * 2**30, 32).values())


def test_the_untiled_mlp_is_weighed_on_the_default_engine_for_decoders_only():
    from longtrain.models.adapters import adapter_class

    found = candidates(32 * K, 64 * 2**30, 32, adapter=adapter_class("llama"))
    untiled = [s for s in found.values() if not s.techniques["mst"].mlp]
    assert untiled and all(s.engine == "backprop" for s in untiled)
    assert {label.replace(",mst:mlp=false", ",mst") for label in found if ":mlp=false" in label} <= set(found)
    assert all(s.techniques.get("mst") is None or s.techniques["mst"].mlp
               for s in candidates(32 * K, 64 * 2**30, 32, adapter=adapter_class("mamba")).values())


def test_an_untiled_mlp_holds_its_products_over_the_tokens_a_layer_runs_at_once():
    config = preset_config("llama3-8b")
    width, item = config.intermediate_size, 2
    tiled = parked_split(config, 64 * K, lt.Strategy.parse("checkpoint,mst"), item)[0]
    untiled = parked_split(config, 64 * K, lt.Strategy.parse("checkpoint,mst:mlp=false"), item)[0]
    assert untiled - tiled == 3 * 64 * K * width * item
    chunked = lt.Strategy.parse("fpdt:chunk=8192,mst:mlp=false")
    assert parked_split(config, 64 * K, chunked, item)[0] - parked_split(
        config, 64 * K, lt.Strategy.parse("fpdt:chunk=8192,mst"), item)[0] == 3 * 8192 * width * item


def test_auto_on_the_h200_is_predicted_no_slower_than_any_case_measured_there():
    """The H200 rows' runs at 32K, planned as `--strategy auto` plans them there: the choice
    (top layers whole: found though its candidate's base is predicted slower than the first
    that fits) is predicted no slower than each measured case, the expert's included."""
    (entry,) = time_model_fit.auto_against_the_rows(time_model_fit._stored_rows(), lengths=(32 * K,), workers=1)
    assert entry["auto_predicted_fastest"], entry
    assert "liger" in entry["auto"] and "except_last" in entry["auto"]
    assert {case["case"] for case in entry["cases"]} >= {"hf+liger+sac", "lt:auto", "lt:checkpoint+mst+liger"}


def test_plan_with_refuses_a_technique_weighed_as_candidates_of_its_own():
    from longtrain.plan.planner import PlanRequest

    with pytest.raises(lt.LongtrainError, match="--with checkpoint: checkpoint is weighed as candidates of its own"):
        PlanRequest("tiny-llama", 2048, device_memory=2**30, host_memory=2**30, carried=("checkpoint",))


def test_plan_with_refuses_a_technique_no_candidate_takes(capsys):
    assert main(["plan", "--model", "tiny-mamba", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "1GiB",
                 "--with", "liger", "--jobs", "1"]) == 2
    assert "--with liger: no candidate weighed for mamba models takes it" in capsys.readouterr().err


def test_plan_with_refuses_streaming_weights_that_all_train(capsys):
    """stream serves frozen layers (LoRA's base): carried into a full fine-tuning plan, every
    candidate would be refused one by one and the verdict would read "nothing fits"."""
    argv = ["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "1GiB",
            "--with", "liger,stream", "--jobs", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--with stream: stream serves layers whose weights do not train" in err and err.count("\n") == 1
    from longtrain.plan.planner import PlanRequest

    assert PlanRequest("tiny-llama", 2048, device_memory=2**30, host_memory=2**30, lora_rank=16, carried=("stream",))


def test_a_plan_of_pure_16bit_adamw_pastes_a_command_that_trains_it():
    from longtrain.plan.planner import PlanRequest, plan

    result = plan(PlanRequest("tiny-llama", 2048, device_memory=2**30, host_memory=2**30, optimizer="adamw-16bit"))
    assert "--optimizer adamw-16bit" in result.command()
    assert "--optimizer" not in plan(PlanRequest("tiny-llama", 2048, device_memory=2**30, host_memory=2**30)).command()


def test_the_optimizer_step_binds_where_its_float32_gradients_do_not_fit():
    """At the step, activations freed, the device holds weights, gradients, AdamW's masters and
    moments and the largest parameter's float32 gradient: a row whose activations fit can
    still not fit there."""
    import torch

    from longtrain.plan.bounds import _largest_parameter, budgets_for
    from longtrain.plan.planner import _evaluate

    config = preset_config("tiny-llama")
    params, [budget] = budgets_for(config, device_memory=2**30, host_memory=2**30, optimizer="adamw",
                                   dtype=torch.bfloat16, optimizer_offload=False)
    assert budget.step_extra == 2 * params + 4 * _largest_parameter(config, torch.bfloat16)
    tight = dataclasses.replace(budget, device_memory=budget.persistent + budget.step_extra - 1)
    row = _evaluate(lt.Strategy.parse("checkpoint,mst"), config, 256, tight, H100, 1, params, lambda: (budget.persistent - budget.device_state, 0, {}))
    assert not row.fits and row.binds.startswith("device memory at the optimizer step: needs")


def test_a_plan_without_optimizer_state_says_what_train_adds(capsys):
    assert main(["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "1GiB",
                 "--optimizer", "none", "--jobs", "1"]) == 0
    assert "planned without optimizer state" in capsys.readouterr().out


def test_a_plan_request_names_the_table_it_is_given_and_wants_a_tuple():
    from longtrain.plan.planner import PlanRequest

    request = PlanRequest("tiny-llama", 2048, device_memory=2**30, host_memory=2**30, carried=("liger",), rates=H200)
    assert request.rates_label == "h200" and hash(request)
    for wrong in (["liger"], "liger"):
        with pytest.raises(lt.LongtrainError, match="must be a tuple of technique names"):
            PlanRequest("tiny-llama", 2048, device_memory=2**30, host_memory=2**30, carried=wrong)


def test_plan_with_carries_a_technique_and_refuses_an_unknown_one(capsys):
    assert main(["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "4GiB", "--host-memory", "4GiB",
                 "--with", "liger", "--json", "--jobs", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all("liger" in row["strategy"]["techniques"] for row in rows if "memo" not in row["strategy"]["techniques"])
    assert main(["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "4GiB", "--host-memory", "4GiB",
                 "--with", "bogus"]) == 2
    assert "unknown technique 'bogus'" in capsys.readouterr().err
