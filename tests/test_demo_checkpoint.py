"""The demo's shipped weights: `longtrain train` (the `demo` preset) fine-tunes the small
model scripts/pretrain_demo.py trained, `--from-scratch` starts from random weights,
and a run from trained weights logs the pass-key accuracy it started from."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from longtrain.cli import main
from longtrain.models.presets import packaged_checkpoint
from longtrain.train.config import TrainConfig
from longtrain.train.metrics import read_metrics
from longtrain.train.trainer import build_model


def test_the_demo_preset_starts_from_the_shipped_weights_and_from_scratch_from_random_ones():
    folder = Path(packaged_checkpoint("demo"))
    assert sum(f.stat().st_size for f in folder.iterdir()) < 5_000_000  # "a few MB", shipped in the package
    record = json.loads((folder / "pretraining.json").read_text())
    assert record["command"].startswith("python scripts/pretrain_demo.py") and record["heldout_accuracy"]
    assert "--out" not in record["command"] and "out" not in record["args"]  # no path of the machine that trained it
    shipped = load_file(folder / "model.safetensors")
    model, tokenizer = build_model(TrainConfig(), torch.float32)
    assert tokenizer.vocab_size <= model.config.vocab_size
    state = model.state_dict()
    assert shipped.keys() <= state.keys() and all(torch.equal(state[k], v) for k, v in shipped.items())
    scratch, _ = build_model(TrainConfig(from_scratch=True), torch.float32)
    assert not torch.equal(scratch.state_dict()["model.embed_tokens.weight"], shipped["model.embed_tokens.weight"])
    assert packaged_checkpoint("tiny-llama") is None


def test_a_fine_tune_from_trained_weights_reports_the_accuracy_it_started_from(tmp_path, capsys):
    code = main(["train", "--seq-len", "1024", "--steps", "1", "--eval-samples", "2", "--no-progress", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    before = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("step") == 0 and "eval" in r]
    assert len(before) == 1 and before[0]["eval"]["samples"] == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["task_before"] == before[0]["eval"]
    assert "before training" in out


def test_the_pretraining_script_writes_a_model_directory_the_trainer_loads(tmp_path, capsys):
    """scripts/pretrain_demo.py, a few steps of each phase: the directory it writes (the
    shipped checkpoint's format) trains again with `longtrain train --model`."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "pretrain_demo.py"
    spec = importlib.util.spec_from_file_location("pretrain_demo", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "checkpoint"
    threads = torch.get_num_threads()  # the script sets its own; the suite's other tests keep theirs
    try:
        assert script.main(["--out", str(out), "--induction-steps", "2", "--passkey-steps", "2", "--lengths", "256",
                            "--batch-tokens", "512", "--repeat-batch", "4", "--eval-every", "0", "--eval-samples", "1",
                            "--eval-lengths", "1024", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads((out / "pretraining.json").read_text())
    assert record["steps"] == 4 and set(record["heldout_accuracy"]) == {"256", "1024"}
    assert str(out) not in json.dumps(record) and "out" not in record["args"]  # where it was written is not recorded
    code = main(["train", "--model", str(out), "--seq-len", "1024", "--steps", "1", "--eval-samples", "1", "--no-progress",
                 "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err


def test_from_scratch_with_a_model_directory_is_refused_in_one_line(tmp_path, capsys):
    """A directory's weights are what it holds: --from-scratch would be silently ignored."""
    code = main(["train", "--model", str(packaged_checkpoint("demo")), "--from-scratch", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--from-scratch starts a preset from random weights" in err
    assert not (tmp_path / "run").exists()
