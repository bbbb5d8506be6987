"""Full fine-tuning as users run it: AdamW with float32 master weights and moments for
16-bit parameters (`--optimizer adamw`, the default), pure 16-bit AdamW only when asked
(`--optimizer adamw-16bit`); what the simulator and the planner count for each."""

import json

import pytest
import torch

import longtrain.optimizers as optimizers
from longtrain.cli import main
from longtrain.models.presets import preset_config
from longtrain.optimizers import MasterAdamW, make_optimizer
from longtrain.plan.bounds import _state_bytes
from longtrain.plan.simulate import simulate


def test_masters_are_float32_adamw_rounded_into_the_weights(monkeypatch):
    """Bit for bit AdamW on float32 copies fed the same gradients, over several buckets, a
    float32 parameter being its own master and a parameter without a gradient skipped."""
    monkeypatch.setattr(optimizers, "BUCKET_BYTES", 64 * 64 * 4)  # a bucket per parameter
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16)), torch.nn.Parameter(torch.randn(64)),
               torch.nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16))]
    references = [torch.nn.Parameter(w.detach().float().clone()) for w in weights]
    ours = make_optimizer("adamw", weights, lr=1e-3, weight_decay=0.1)
    assert isinstance(ours, MasterAdamW) and ours.masters[1] is weights[1]
    stock = torch.optim.AdamW(references, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    for step in range(4):
        for w, r in zip(weights, references):
            skipped = step == 2 and w is weights[2]
            g = None if skipped else torch.randn(w.shape).to(w.dtype)
            w.grad, r.grad = g, None if g is None else g.float()
        ours.step()
        stock.step()
        ours.zero_grad()
        stock.zero_grad()
        for w, r, m in zip(weights, references, ours.masters):
            assert torch.equal(m, r.detach()) and torch.equal(w.detach(), r.detach().to(w.dtype))
    assert all(w.grad is None for w in weights)


def test_step_hooks_run_once_per_step_whatever_the_buckets(monkeypatch):
    """The buckets' updates run without the hooks torch wraps around AdamW.step once any
    AdamW exists (a memory tracker's step marks among them)."""
    monkeypatch.setattr(optimizers, "BUCKET_BYTES", 16)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])  # torch now wraps AdamW.step
    weights = [torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16)) for _ in range(3)]
    opt = make_optimizer("adamw", weights)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append("pre"))
    opt.register_step_post_hook(lambda *_: seen.append("post"))
    for w in weights:
        w.grad = torch.ones_like(w)
    opt.step()
    assert seen == ["pre", "post"] and all((w.detach() != 0).all() for w in weights)


def test_weights_written_from_outside_become_their_masters_and_groups_are_not_added():
    """A state dict loaded into the model after the optimizer was built is what the next
    step updates (not the masters of the weights before it)."""
    model = torch.nn.Linear(8, 8).bfloat16()
    opt = make_optimizer("adamw", model.parameters(), lr=1e-6)
    loaded = torch.nn.Linear(8, 8).bfloat16().state_dict()
    model.load_state_dict(loaded)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(model.weight.detach(), loaded["weight"]) and torch.equal(opt.masters[0], loaded["weight"].float())
    with pytest.raises(Exception, match="build a new optimizer"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]})


def test_a_state_without_masters_says_so():
    model = torch.nn.Linear(4, 4).bfloat16()
    state = make_optimizer("adamw", model.parameters()).state_dict()
    del state["master_weights"]
    with pytest.warns(UserWarning, match="holds no master weights"):
        make_optimizer("adamw", model.parameters()).load_state_dict(state)


def test_small_updates_accumulate_in_the_masters_where_pure_16bit_rounds_them_away():
    torch.manual_seed(0)
    start = (4 + 0.9 * torch.rand(256, 256)).bfloat16()  # weights in [4, 5): a bfloat16 spacing of 1/32
    moved = {}
    for name in ("adamw", "adamw-16bit"):
        w = torch.nn.Parameter(start.clone())
        opt = make_optimizer(name, [w], lr=1e-3)
        for _ in range(50):  # each update ~1e-3, well under half the spacing
            w.grad = torch.ones_like(w)
            opt.step()
            opt.zero_grad()
        moved[name] = (w.detach() != start).float().mean().item()
    assert moved["adamw-16bit"] == 0.0 and moved["adamw"] == 1.0  # 50 × 1e-3 = 0.05: past the spacing


def test_masters_survive_a_checkpoint():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.bfloat16))
    opt = make_optimizer("adamw", [w], lr=1e-4)
    for _ in range(3):
        w.grad = torch.randn(16, 16, dtype=torch.bfloat16)
        opt.step()
    saved = opt.state_dict()
    assert len(saved["master_weights"]) == 1 and saved["master_weights"][0].dtype == torch.float32
    fresh = torch.nn.Parameter(torch.zeros(16, 16, dtype=torch.bfloat16))
    again = make_optimizer("adamw", [fresh], lr=1e-4)
    again.load_state_dict(saved)
    assert torch.equal(again.masters[0], opt.masters[0]) and torch.equal(fresh.detach(), w.detach())
    assert not torch.equal(opt.masters[0], w.detach().float())  # the masters hold what bfloat16 cannot


def test_a_bfloat16_run_resumed_from_a_checkpoint_matches_bit_for_bit(tmp_path):
    """The masters are in the checkpoint: step 3 of a run resumed at step 1 is step 3 of the run."""
    text = tmp_path / "train.txt"
    text.write_text("".join(f"line {i} of the text to learn, long enough to fill a few samples.\n" for i in range(200)))
    base = ["train", "--model", "tiny-llama", "--data", str(text), "--seq-len", "64", "--eval-samples", "2", "--no-progress",
            "--dtype", "bfloat16", "--steps", "3", "--lr", "1e-3"]
    assert main([*base, "--save-every", "1", "--keep-checkpoints", "3", "--out", str(tmp_path / "whole")]) == 0
    assert main([*base, "--out", str(tmp_path / "resumed"), "--resume-from",
                 str(tmp_path / "whole" / "checkpoints" / "step-00000001")]) == 0

    def losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r and r.get("step") in (2, 3)]

    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")


def test_plans_and_simulations_count_float32_masters_and_moments():
    config = preset_config("llama3-8b")
    params, state = _state_bytes(config, "adamw", torch.bfloat16)
    assert state == 12 * params and _state_bytes(config, "adamw-16bit", torch.bfloat16)[1] == 4 * params
    assert _state_bytes(config, "adamw", torch.float32)[1] == 8 * params  # float32 weights are their own masters
    mixed, pure = (simulate("tiny-llama", 256, strategy="checkpoint", optimizer=name, dtype="bfloat16")
                   for name in ("adamw", "adamw-16bit"))
    n = mixed.parameters
    assert mixed.peak.by_category["optimizer_state"]["device"] - pure.peak.by_category["optimizer_state"]["device"] == 8 * n
    assert mixed.peak.peak_device_bytes > pure.peak.peak_device_bytes


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_the_command_line_names_pure_16bit_adamw(command, capsys):
    extra = ["--device-memory", "1GiB", "--host-memory", "1GiB", "--jobs", "1"] if command == "plan" else []
    assert main([command, "--model", "tiny-llama", "--seq-len", "256", "--optimizer", "adamw-16bit", *extra]) == 0
    assert "adamw-16bit" in capsys.readouterr().out


def test_pure_16bit_adamw_on_float32_weights_is_refused_before_anything_is_written(tmp_path, capsys):
    """adamw-16bit on float32 weights would be plain AdamW under another name."""
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny-llama", "--seq-len", "256", "--dtype", "float32", "--optimizer", "adamw-16bit",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--optimizer adamw-16bit steps AdamW on 16-bit weights, and these are float32" in err and not out.exists()
