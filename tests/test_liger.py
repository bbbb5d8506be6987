"""The liger technique on a machine without CUDA or Triton: its refusals, and — with a
stand-in for liger-kernel's patcher — what it asks Liger for and that MsT tiles the MLP
Liger patched. The kernels themselves are checked against float64 on CUDA (test_cuda.py)."""

import sys
import types

import pytest
from conftest import check_step, padded_batch, stock_and_ours

import longtrain as lt
import longtrain.techniques.liger as liger


def test_a_model_on_the_cpu_is_refused_with_the_fix():
    _, ours = stock_and_ours("tiny-llama")
    with pytest.raises(lt.LongtrainError, match="CUDA GPU.*move the model to the GPU first.*leave 'liger' out"):
        lt.apply(ours, lt.Strategy(liger=True))


def test_without_liger_kernel_the_install_command_is_named(monkeypatch):
    monkeypatch.setattr(liger.install, "_require_cuda", lambda model: None)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as if not installed
    _, ours = stock_and_ours("tiny-llama")
    with pytest.raises(lt.LongtrainError, match=r"pip install liger-kernel"):
        lt.apply(ours, lt.Strategy(liger=True))


def _fake_liger(monkeypatch, patchers: dict):
    package = types.ModuleType("liger_kernel")
    transformers = types.ModuleType("liger_kernel.transformers")
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = patchers
    for name, module in (("liger_kernel", package), ("liger_kernel.transformers", transformers),
                         ("liger_kernel.transformers.monkey_patch", monkey_patch)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(liger.install, "_require_cuda", lambda model: None)


def test_liger_patches_norms_mlps_and_rope_and_mst_tiles_its_mlp(monkeypatch):
    """The stand-in patcher wraps each MLP's forward (computing the same function) and
    records its arguments; MsT, installed after it, must run the wrapped forward."""
    asked, ran = {}, []

    def apply_liger_kernel_to_llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                    swiglu=True, model=None):
        asked.update(rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
                     rms_norm=rms_norm, swiglu=swiglu)
        for layer in model.model.layers:
            original = layer.mlp.forward

            def patched(x, original=original):
                ran.append(x.shape[-2])
                return original(x)

            layer.mlp.forward = patched

    _fake_liger(monkeypatch, {"llama": apply_liger_kernel_to_llama})
    stock, ours = stock_and_ours("tiny-llama")
    strategy = lt.Strategy(liger={"rope": False}, checkpoint=True, mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=37))
    check_step(stock, ours, strategy, padded_batch(320, lengths=(100, 70)), 1e-10)
    assert asked == dict(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True)
    assert ran and max(ran) <= 37  # MsT's mini-sequences ran through Liger's MLP


def test_a_family_liger_does_not_cover_is_refused(monkeypatch):
    _fake_liger(monkeypatch, {})
    _, ours = stock_and_ours("tiny-llama")
    with pytest.raises(lt.LongtrainError, match="no kernels for model type 'llama'"):
        lt.apply(ours, lt.Strategy(liger=True))


def test_gemma_asks_for_geglu(monkeypatch):
    asked = {}

    def apply_liger_kernel_to_gemma2(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                     geglu=True, model=None):
        asked.update(geglu=geglu, rms_norm=rms_norm, rope=rope)

    _fake_liger(monkeypatch, {"gemma2": apply_liger_kernel_to_gemma2})
    _, ours = stock_and_ours("tiny-gemma2")
    lt.apply(ours, lt.Strategy(liger={"mlp": False}))
    assert asked == dict(geglu=False, rms_norm=True, rope=True)


def test_the_simulator_accepts_liger_and_says_what_it_assumed():
    report = lt.simulate("tiny-llama", 256, strategy="checkpoint,mst,liger", optimizer="none")
    plain = lt.simulate("tiny-llama", 256, strategy="checkpoint,mst", optimizer="none")
    assert "stock ops" in report.notes["liger"]
    assert report.device_peak_bytes == plain.device_peak_bytes


def test_the_command_line_refuses_liger_on_a_cpu_in_one_line(tmp_path, capsys):
    from longtrain.cli import main

    code = main(["train", "--model", "tiny-llama", "--seq-len", "64", "--strategy", "checkpoint,mst,liger", "--steps", "1",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith("longtrain: error: the liger technique runs Triton kernels on a CUDA GPU")


def test_strategy_auto_adds_liger_on_a_gpu_where_it_is_installed(monkeypatch):
    """Every candidate of the plan carries liger (same memory, fused kernels, so the ranking
    is of what runs) where the device is CUDA and liger-kernel covers the family; without
    it, none does. The rates are the card's built-in table."""
    from types import SimpleNamespace

    import longtrain.plan.planner as planner
    import longtrain.techniques.liger.costs as liger_costs
    import longtrain.train.setup as trainer
    from longtrain.plan.time_model import H200
    from longtrain.train.config import TrainConfig

    asked = []

    def plan(request):
        asked.append(request)
        winner = lt.Strategy(checkpoint=True, mst=True, **{name: True for name in request.carried}).to_dict()
        return SimpleNamespace(best=SimpleNamespace(strategy=winner), verdict=lambda: "checkpoint,mst")

    monkeypatch.setattr(planner, "plan", plan)
    monkeypatch.setenv("LONGTRAIN_CACHE", "/nonexistent-longtrain-cache")  # no stored calibration
    monkeypatch.setattr(trainer.torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=141 << 30, name="NVIDIA H200"))
    monkeypatch.setattr(trainer.torch.cuda, "current_device", lambda: 0)  # what a bare "cuda" device means
    config = TrainConfig(model="tiny-llama", strategy="auto")
    for installed in (True, False):
        monkeypatch.setattr(liger_costs, "liger_available", lambda model_type: installed and model_type == "llama")
        chosen = trainer.planned_strategy(config, trainer.torch.device("cuda"), trainer.torch.bfloat16)
        assert asked[-1].carried == (("liger",) if installed else ())
        assert asked[-1].rates is H200 and asked[-1].rates_name == "h200"
        assert ("liger" in chosen.techniques) == installed
        assert {"checkpoint", "mst"} <= set(chosen.techniques)
