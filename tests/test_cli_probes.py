"""Issue 14's probes: every bad input, in-process, gets exactly one line (exit code 2)
and leaves the run directory as it was; run directories in any state have a way
forward; option parsers and option dataclasses, fuzzed, raise LongtrainError or
nothing else."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import longtrain as lt
from longtrain.cli import main
from longtrain.errors import LongtrainError
from longtrain.train.config import TrainConfig, check_config
from longtrain.train.metrics import read_metrics

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TEXT = "The quick brown fox jumps over the lazy dog; then it naps in the sun. " * 40  # 2,800 bytes: 43 windows of 64


def snapshot(root: Path) -> dict:
    """Every file under ``root`` with its checksum (None for a directory)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(TEXT)
    return path


def tiny(data_file, *extra) -> list:
    return ["train", "--model", "tiny-llama", "--data", data_file, "--seq-len", "64", "--eval-samples", "2", "--no-progress",
            *extra]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_file) -> Path:
    """A finished two-step run with a checkpoint at each step."""
    out = tmp_path_factory.mktemp("runs") / "finished"
    code, _, err = cli(*tiny(data_file, "--steps", "2", "--save-every", "1", "--out", out))
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """A BERT (masked LM) directory, a Llama directory without tokenizer files, a copy of
    it whose model.safetensors was cut short (a copy that stopped half way), and copies
    whose config.json and weights disagree: hidden_size 64 for weights of 32, two layers
    for weights of one, num_hidden_layers -1 or 0, and a norm weight of the wrong shape."""
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("models")
    BertForMaskedLM(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(root / "bert")
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=64)).save_pretrained(root / "llama")
    shutil.copytree(root / "llama", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    dirs = {"bert": root / "bert", "llama": root / "llama", "truncated": root / "truncated"}
    for name, key, value in (("wider", "hidden_size", 64), ("deeper", "num_hidden_layers", 2),
                             ("negative", "num_hidden_layers", -1), ("no_layers", "num_hidden_layers", 0)):
        shutil.copytree(root / "llama", root / name)
        config = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**config, key: value}))
        dirs[name] = root / name
    shutil.copytree(root / "llama", root / "misshapen")
    tensors = load_file(str(root / "llama" / "model.safetensors"))
    save_file({**tensors, "model.norm.weight": torch.ones(16)}, str(root / "misshapen" / "model.safetensors"),
              metadata={"format": "pt"})
    dirs["misshapen"] = root / "misshapen"
    return dirs


# (id, argv after `train --model tiny-llama --data D --seq-len 64 ...`, --out kind, exit code, words of the message)
# --out kinds: "fresh" (must stay absent), "finished" (a copy of a finished run: must stay as it is).
PROBES = [
    ("save-every 0", ["--save-every", "0"], "fresh", 2, "--save-every must be a positive integer"),
    ("save-every -1", ["--save-every", "-1"], "fresh", 2, "--save-every must be a positive integer"),
    ("keep-checkpoints 0", ["--keep-checkpoints", "0"], "fresh", 2, "--keep-checkpoints must be a positive integer"),
    ("lora-dropout 1", ["--lora", "--lora-dropout", "1"], "fresh", 2, "--lora-dropout must be at least 0 and below 1"),
    ("eval-every -1", ["--eval-every", "-1"], "fresh", 2, "--eval-every must be 0 or more"),
    ("warmup-steps -5", ["--warmup-steps", "-5"], "fresh", 2, "--warmup-steps must be 0 or more"),
    ("weight-decay -5", ["--weight-decay", "-5"], "fresh", 2, "--weight-decay must be 0 or more"),
    ("lr nan", ["--lr", "nan"], "fresh", 2, "--lr must be"),
    ("steps not a number", ["--steps", "ten"], "fresh", 2, "invalid int value"),
    ("seq-len 4Q", ["--seq-len", "4Q"], "fresh", 2, "--seq-len"),
    ("device tpu", ["--device", "tpu"], "fresh", 2, "--device 'tpu' is not a device"),
    ("tokenizer nonsense", ["--tokenizer", "sentencepiece-ish"], "fresh", 2, "--tokenizer"),
    ("boolean maybe", ["--engine", "fpdt:chunk=32:offload=maybe"], "fresh", 2, "offload must be true or false"),
    ("boolean on", ["--engine", "fpdt:chunk=32:offload=on"], "fresh", 2, "offload must be true or false"),
    ("engine option not a number", ["--engine", "seco:chunk=big"], "fresh", 2, "seco chunk must be a positive integer"),
    ("technique twice", ["--strategy", "mst,mst:loss_chunks=4"], "fresh", 2, "names 'mst' twice"),
    ("strategy trailing comma", ["--strategy", "checkpoint,"], "fresh", 2, "has an empty item"),
    ("strategy double comma", ["--strategy", "checkpoint,,mst"], "fresh", 2, "has an empty item"),
    ("strategy file engine 5", ["--strategy", "{tmp}/engine5.json"], "fresh", 2, "engine must be a name or a mapping"),
    ("strategy file YAML list", ["--strategy", "{tmp}/list.yaml"], "fresh", 2, "techniques must be a mapping"),
    ("strategy file broken", ["--strategy", "{tmp}/broken.yaml"], "fresh", 2, "is not valid YAML"),
    ("out is a file", ["--out", "{tmp}/a-file"], None, 2, "is a file; pass --out a directory"),
    ("out under a file", ["--out", "{tmp}/a-file/run"], None, 2, "is a file; pass --out a directory"),
    ("BERT model", ["--model", "{bert}"], "fresh", 2, "not a causal (decoder-only) language model"),
    ("model without tokenizer", ["--model", "{llama}"], "fresh", 2, "--tokenizer bytes"),
    ("tensorboard missing", ["--tensorboard"], "fresh", 2, "pip install tensorboard"),
    ("run exists", ["--steps", "2"], "finished", 2, "already holds a run (last checkpoint: step 2); pass --resume"),
    ("resume with fewer steps", ["--steps", "1", "--resume"], "finished", 2, "beyond --steps 1; pass --steps 2 or more"),
    ("resume a finished run", ["--steps", "2", "--resume"], "finished", 0, "already finished step 2 of --steps 2; nothing to train"),
    ("resume, changed identity", ["--steps", "3", "--resume", "--seed", "7"], "finished", 2, "seed=0 but this run has seed=7"),
    ("resume-from nothing", ["--steps", "3", "--resume-from", "{tmp}"], "finished", 2, "neither a checkpoint"),
    ("resume and overwrite", ["--resume", "--overwrite"], "finished", 2, "contradict each other"),
    ("out empty", ["--out", ""], None, 2, "--out is empty (it would mean the current directory)"),
    ("data empty", ["--data", ""], "fresh", 2, "--data is empty (it would mean the current directory)"),
    ("lr negative after a space", ["--lr", "-1e-3"], "fresh", 2, "--lr must be positive"),
    ("truncated weights", ["--model", "{truncated}", "--tokenizer", "bytes"], "fresh", 2,
     "truncated/model.safetensors is truncated: "),
    ("strategy and engine name two engines", ["--strategy", "fpdt:chunk=32:offload,mst", "--engine", "seco:chunk=32"],
     "fresh", 2, "names engine 'fpdt' but the engine given (--engine) is 'seco'; name the engine once"),
    ("plan row with its optimizer note", ["--strategy", "fpdt:chunk=32,mst · optimizer in host memory"], "fresh", 2,
     "pass --strategy fpdt:chunk=32,mst with --optimizer-offload"),
    ("plan row for several GPUs", ["--strategy", "fpdt:chunk=32:offload,mst+sp2"], "fresh", 2, "pass --sp 2"),
    # --overwrite clears --out only once every check has passed, the --resume-from checkpoint's included.
    ("overwrite, resume-from a missing checkpoint in --out",
     ["--steps", "3", "--overwrite", "--resume-from", "{tmp}/run/checkpoints/step-00000008"], "finished", 2,
     "lies inside --out {tmp}/run, which --overwrite clears before training; drop --overwrite"),
    ("overwrite, resume-from a checkpoint in --out",
     ["--steps", "3", "--overwrite", "--resume-from", "{tmp}/run/checkpoints/step-00000001"], "finished", 2,
     "which --overwrite clears before training"),
    ("overwrite, resume-from nothing", ["--steps", "3", "--overwrite", "--resume-from", "{tmp}/nothing"], "finished", 2,
     "neither a checkpoint"),
    ("overwrite, resume-from another run's checkpoint, changed identity",
     ["--steps", "3", "--overwrite", "--resume-from", "{finished}", "--seed", "7"], "finished", 2,
     "seed=0 but this run has seed=7"),
    # A run whose checkpoints/latest is gone: its newest valid checkpoint is named, never started over.
    ("resume without latest", ["--steps", "3", "--resume"], "unpointed", 2,
     "the newest valid one is {tmp}/run/checkpoints/step-00000002 (step 2): pass --resume-from "
     "{tmp}/run/checkpoints/step-00000002 instead of --resume"),
    ("start without latest", ["--steps", "3"], "unpointed", 2,
     "the newest valid one is {tmp}/run/checkpoints/step-00000002 (step 2): pass --resume-from"),
    # config.json and the weights disagree: one line naming the tensors, before anything loads.
    ("config wider than the weights", ["--model", "{wider}", "--tokenizer", "bytes"], "fresh", 2,
     "model.embed_tokens.weight is 300×32 in model.safetensors but 300×64 by config.json"),
    ("config deeper than the weights", ["--model", "{deeper}", "--tokenizer", "bytes"], "fresh", 2,
     "hold 1 layer but its config.json describes 2"),
    ("weights of the wrong shape", ["--model", "{misshapen}", "--tokenizer", "bytes"], "fresh", 2,
     "model.norm.weight is 16 in model.safetensors but 32 by config.json"),
    ("num_hidden_layers -1", ["--model", "{negative}", "--tokenizer", "bytes"], "fresh", 2,
     "gives num_hidden_layers as -1, but a size must be positive"),
    ("num_hidden_layers 0", ["--model", "{no_layers}", "--tokenizer", "bytes"], "fresh", 2,
     "gives num_hidden_layers as 0, but a size must be positive"),
    # Options that would be ignored.
    ("lora-rank without lora", ["--lora-rank", "16"], "fresh", 2, "--lora-rank has no effect without --lora; add --lora"),
    ("lora-rank at its default without lora", ["--lora-rank", "8"], "fresh", 2, "--lora-rank has no effect without --lora"),
    ("lora-dropout without lora", ["--lora-dropout", "0.05"], "fresh", 2, "--lora-dropout has no effect without --lora"),
    ("4bit without lora", ["--4bit"], "fresh", 2, "--4bit loads the base in 4 bits, which trains LoRA adapters only"),
    ("4bit on the CPU", ["--4bit", "--lora", "--device", "cpu"], "fresh", 2,
     "--4bit trains on a GPU: bitsandbytes' CPU backend repacks"),
    ("warmup beyond steps", ["--steps", "2", "--warmup-steps", "100"], "fresh", 2,
     "--warmup-steps 100 is not below --steps 2: the learning rate would only rise from 1.0% to 2.0% of --lr"),
    ("warmup as long as the run", ["--steps", "4", "--warmup-steps", "4"], "fresh", 2, "pass --warmup-steps below 4"),
    ("loss on the assistant of text", ["--loss-on", "assistant"], "fresh", 2,
     "--loss-on assistant puts the loss on chat records' assistant messages"),
    ("task-loss with data", ["--task-loss", "task"], "fresh", 2, "--task-loss chooses the loss of the built-in pass-key"),
    # Names refused before torch loads (test_name_mistakes_are_refused_before_torch_loads).
    ("engine unknown", ["--engine", "warp:chunk=64"], "fresh", 2, "unknown engine 'warp'"),
    ("technique unknown", ["--strategy", "checkpoint,warp"], "fresh", 2, "unknown technique 'warp'"),
    ("strategy file missing", ["--strategy", "{tmp}/none.yaml"], "fresh", 2, "no such file"),
    ("dtype unknown", ["--dtype", "fp8"], "fresh", 2, "--dtype 'fp8' is not a dtype"),
    ("model directory missing", ["--model", "{tmp}/no-model"], "fresh", 2, "no-model does not exist"),
]


def _write_inputs(tmp: Path) -> None:
    (tmp / "a-file").write_text("not a directory")
    (tmp / "engine5.json").write_text('{"engine": 5}')
    (tmp / "list.yaml").write_text("techniques: [checkpoint, mst]\n")
    (tmp / "broken.yaml").write_text("techniques: {mst: [\n")


@pytest.mark.parametrize("name,argv,out_kind,code,message", PROBES, ids=[p[0] for p in PROBES])
def test_probe(name, argv, out_kind, code, message, tmp_path, data_file, finished, model_dirs):
    if name == "tensorboard missing" and importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    _write_inputs(tmp_path)
    out = tmp_path / "run"
    if out_kind in ("finished", "unpointed"):
        shutil.copytree(finished, out)
    if out_kind == "unpointed":  # checkpoints/latest removed, the checkpoints kept
        (out / "checkpoints" / "latest").unlink()
    fill = {"tmp": tmp_path, "finished": finished, **model_dirs}
    args = [a.format(**fill) if isinstance(a, str) else a for a in argv]
    message = message.format(**fill)
    before = snapshot(out), snapshot(tmp_path)
    full = tiny(data_file, *args) if "--out" in args else tiny(data_file, *args, "--out", out)
    got, stdout, stderr = cli(*full)
    said = (stderr if code else stdout).strip()
    assert got == code, stdout + stderr
    assert said.count("\n") == 0 and message in said, said
    assert "Traceback" not in stderr and "delete" not in said.lower()
    assert (snapshot(out), snapshot(tmp_path)) == before  # nothing written, nothing removed


def test_a_full_disk_leaves_no_half_written_checkpoint_and_the_run_carries_on(tmp_path, data_file, monkeypatch):
    import longtrain.train.resume as trainer

    real = trainer.save_file

    def full_disk(tensors, path):
        Path(path).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    out = tmp_path / "run"
    monkeypatch.setattr(trainer, "save_file", full_disk)
    code, _, err = cli(*tiny(data_file, "--steps", "2", "--save-every", "1", "--out", out))
    assert code == 2 and err.count("\n") == 1
    assert "cannot write checkpoint step-00000001" in err and "the disk is full" in err and "--resume" in err
    assert not list((out / "checkpoints").glob(".tmp-*"))
    monkeypatch.setattr(trainer, "save_file", real)
    # The run never checkpointed: --resume starts it again (and so would the plain command).
    code, out_text, err = cli(*tiny(data_file, "--steps", "2", "--save-every", "1", "--out", out, "--resume"))
    assert code == 0, err
    assert "holds no checkpoint yet; starting from step 0" in out_text
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2]


def test_an_unwritable_out_is_one_line(tmp_path, data_file, monkeypatch):
    import tempfile

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "TemporaryFile", denied)  # root writes anywhere: the probe is told no
    code, _, err = cli(*tiny(data_file, "--steps", "1", "--out", tmp_path / "run"))
    assert code == 2 and err.count("\n") == 1
    assert "cannot write the run directory" in err and "permission denied" in err


def test_leftovers_of_an_interrupted_save_are_cleared_and_a_run_without_checkpoint_restarts(tmp_path, data_file):
    out = tmp_path / "run"
    (out / "checkpoints" / ".tmp-step-00000001-123").mkdir(parents=True)
    (out / "checkpoints" / ".tmp-step-00000001-123" / "weights.safetensors").write_bytes(b"partial")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')  # killed mid-line, no checkpoint
    code, _, err = cli(*tiny(data_file, "--steps", "1", "--out", out))  # no --resume, no --overwrite needed
    assert code == 0, err
    assert not list((out / "checkpoints").glob(".tmp-*"))
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1] and records[0]["loss"] != 9.0


def test_a_finished_run_resumed_with_more_steps_continues_on_the_stated_schedule(tmp_path, data_file, finished):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    code, text, err = cli(*tiny(data_file, "--steps", "3", "--resume", "--out", out, "--lr", "1e-3"))
    assert code == 0, err
    assert "resuming with --steps 3 (the checkpoint's run had 2), applied from step 2" in text
    assert "resuming with --lr 0.001 (the checkpoint's run had 0.003)" in text
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # The rule: lr(step) = --lr × WarmupCosine(--warmup-steps, --steps)(step); the default warm-up of a run this short
    # is a tenth of --steps (none), not 20 steps.
    from longtrain.train.trainer import WarmupCosine

    assert "--warmup-steps" not in text
    assert steps[2]["lr"] == pytest.approx(1e-3 * WarmupCosine(0, 3)(2))
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    held_out = [r["eval"] for r in read_metrics(out / "metrics.jsonl") if "eval" in r]
    assert held_out and all(e["samples"] == 2 and e["loss"] > 0 for e in held_out)


def test_resume_from_a_run_directory_takes_its_latest_checkpoint(tmp_path, data_file, finished):
    code, text, err = cli(*tiny(data_file, "--steps", "2", "--resume-from", finished, "--out", tmp_path / "copy"))
    assert code == 0, err
    assert f"{finished / 'checkpoints' / 'step-00000002'} already finished step 2" in text


def test_model_without_tokenizer_trains_on_bytes_when_asked(tmp_path, data_file, model_dirs):
    code, _, err = cli(*tiny(data_file, "--model", model_dirs["llama"], "--tokenizer", "bytes", "--steps", "1",
                             "--out", tmp_path / "run"))
    assert code == 0, err


def test_resumed_unchanged_run_matches_bit_for_bit(tmp_path, data_file, finished):
    """Resuming from step 1 with the same settings reproduces step 2 exactly (the
    schedule is rebuilt from the settings, not read back)."""
    out = tmp_path / "run"
    code, _, err = cli(*tiny(data_file, "--steps", "2", "--out", out,
                             "--resume-from", finished / "checkpoints" / "step-00000001"))
    assert code == 0, err

    def step2(path):
        return next(r for r in read_metrics(path / "metrics.jsonl") if r.get("step") == 2 and "loss" in r)

    assert (step2(out)["loss"], step2(out)["lr"]) == (step2(finished)["loss"], step2(finished)["lr"])


# ---- the Python API -------------------------------------------------------------------

def _model():
    from longtrain.models.loading import build_from_config
    from longtrain.models.presets import preset_config

    return build_from_config(preset_config("tiny-llama"))


API_PROBES = [
    ("Strategy.parse of a list", lambda: lt.Strategy.parse(["checkpoint"]), "a strategy is a Strategy"),
    ("engine not a string", lambda: lt.Strategy.parse("none", engine=5), "an engine is a name"),
    ("boolean as text", lambda: lt.FPDTOptions(offload="no"), "offload must be true or false"),
    ("ChunkedAttention", lambda: lt.ChunkedAttention, "now longtrain.FPDTOptions"),
    ("list input_ids", lambda: lt.step(_model(), {"input_ids": [[1, 2, 3]]}), "input_ids must be a (batch, seq_len) tensor"),
    ("float input_ids", lambda: lt.step(_model(), {"input_ids": torch.ones(1, 8)}), "integer token ids"),
    ("ids outside the vocabulary", lambda: lt.step(_model(), {"input_ids": torch.full((1, 8), 999)}),
     "input_ids hold ids outside the model's vocabulary of 320"),
    ("labels outside the vocabulary",
     lambda: lt.step(_model(), {"input_ids": torch.ones(1, 8, dtype=torch.long), "labels": torch.full((1, 8), 320)}),
     "labels hold ids outside"),
    ("fractional label count",
     lambda: lt.step(_model(), {"input_ids": torch.ones(1, 8, dtype=torch.long)}, num_label_tokens=2.5), "num_label_tokens"),
    ("simulate, bad length", lambda: lt.simulate("tiny-llama", "4Q"), "cannot read"),
    ("simulate, length 1", lambda: lt.simulate("tiny-llama", 1), "at least 2"),
    ("TrainConfig of the wrong type", lambda: check_config(TrainConfig(steps="10")), "--steps must be int"),
    ("TrainConfig boolean as text", lambda: check_config(TrainConfig(lora="no")), "--lora must be bool"),
]


@pytest.mark.parametrize("name,call,message", API_PROBES, ids=[p[0] for p in API_PROBES])
def test_api_probe(name, call, message):
    with pytest.raises(LongtrainError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_simulate_reads_a_length_like_the_command_line():
    assert lt.simulate("tiny-llama", "1K", optimizer="none").seq_len == 1024


# ---- fuzzing: parsers and option dataclasses raise LongtrainError or nothing ----------

NAMES = st.sampled_from(["checkpoint", "mst", "memo", "none", "fpdt", "seco", "spaco", "adjoint", "backprop", "warp", ""])
KEYS = st.sampled_from(["chunk", "offload", "prefetch", "host_memory", "loss_chunks", "mlp", "head", "alpha", "keep_last",
                        "budget", "cap", "seed", "truncate", "block", "recompute", "recompute_kv", "keep_output", "x", ""])
WORDS = st.one_of(st.sampled_from(["true", "no", "1", "0", "-3", "8K", "1e400", "nan", "none", "120GiB", "2.5", "auto",
                                   "maybe", "", "="]), st.text(max_size=6))
ITEM = st.builds(lambda n, kv: n + "".join(f":{k}={v}" for k, v in kv), NAMES, st.lists(st.tuples(KEYS, WORDS), max_size=3))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.one_of(KEYS, st.integers()), inner, max_size=3)),
                      max_leaves=8)


def _refuses_cleanly(call) -> None:
    try:
        call()
    except LongtrainError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(st.lists(ITEM, max_size=3), st.one_of(st.none(), ITEM))
def test_fuzz_command_line_strategies(items, engine):
    _refuses_cleanly(lambda: lt.Strategy.parse(",".join(items), engine=engine))


@FUZZ
@given(st.one_of(st.dictionaries(st.sampled_from(["engine", "techniques", "sequence_parallel", "other"]), VALUES, max_size=3),
                 VALUES))
def test_fuzz_strategy_files(data):
    _refuses_cleanly(lambda: lt.Strategy.from_dict(data))


def _options_classes():
    from longtrain.engines.adjoint import AdjointOptions

    return [lt.FPDTOptions, lt.SeCOOptions, lt.SpaCOOptions, lt.MsTOptions, lt.MemoOptions, lt.UlyssesOptions, AdjointOptions]


@FUZZ
@given(st.data())
def test_fuzz_option_dataclasses(data):
    import dataclasses

    cls = data.draw(st.sampled_from(_options_classes()))
    fields = [f.name for f in dataclasses.fields(cls)]
    kwargs = data.draw(st.dictionaries(st.sampled_from(fields), SCALARS, max_size=3))
    try:
        options = cls(**kwargs)
    except LongtrainError as exc:
        assert "\n" not in str(exc)
        return
    _assert_usable(options)


def _assert_usable(options) -> None:
    """What an options class accepted is of its declared type: no bool for a number, no
    NaN or infinity, no text for a flag, sizes positive."""
    import dataclasses
    import math
    import typing

    from longtrain.memory.units import parse_bytes

    hints = typing.get_type_hints(type(options))
    for field in dataclasses.fields(options):
        value, kinds = getattr(options, field.name), typing.get_args(hints[field.name]) or (hints[field.name],)
        where = f"{type(options).__name__}.{field.name} = {value!r}"
        if value is None:
            assert type(None) in kinds, where
        elif isinstance(value, bool):
            assert bool in kinds, where
        elif isinstance(value, (int, float)):
            assert (int in kinds or float in kinds) and math.isfinite(value) and (float in kinds or isinstance(value, int)), where
        else:
            assert isinstance(value, str) and str in kinds, where
        if "memory" in field.name and value is not None:
            assert parse_bytes(value) > 0, where


@FUZZ
@given(st.data())
def test_fuzz_train_config(data):
    import dataclasses

    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("out", "data", "model", "resume_from")]
    kwargs = data.draw(st.dictionaries(st.sampled_from(fields), SCALARS, max_size=3))
    _refuses_cleanly(lambda: check_config(TrainConfig(**kwargs)))


def test_a_checkpoint_moved_aside_while_its_step_was_resaved_is_put_back(tmp_path):
    from longtrain.train import run_checkpoints as ckpt

    saved = ckpt.save_checkpoint(tmp_path, 1, {"a.txt": lambda p: p.write_text("good")}, {})
    os.rename(saved, tmp_path / ".old-step-00000001-4242")  # killed between the two renames of a re-save
    (tmp_path / ".tmp-step-00000002-4242").mkdir()
    ckpt.remove_leftovers(tmp_path)
    assert ckpt.verify_checkpoint(ckpt.latest_checkpoint(tmp_path)) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


def in_a_fresh_interpreter(code: str) -> str:
    """What ``code`` prints, run by a new Python, followed by the heavy modules it imported."""
    import subprocess
    import sys

    probe = (f"import sys, contextlib, io; from longtrain.cli import main\n{code}\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def test_help_and_presets_start_without_torch():
    """`longtrain --help` and `presets` import neither torch nor transformers (~0.2 s instead of ~5 s)."""
    assert in_a_fresh_interpreter("with contextlib.redirect_stdout(io.StringIO()):\n"
                                  "    main(['presets'])\n"
                                  "    try: main(['train', '--help'])\n"
                                  "    except SystemExit: pass") == "[]"


def test_every_option_has_help_and_shows_its_default():
    from longtrain.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.choices)._name_parser_map  # argparse keeps subcommands here
    for name, sub in commands.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"longtrain {name} {action.option_strings[0]} has no help"
    text = " ".join(commands["train"].format_help().split())  # argparse wraps lines
    assert "(default: 100)" in text and "(default: runs/default)" in text


def test_a_resume_that_fails_before_its_first_step_changes_nothing(tmp_path, data_file, finished, monkeypatch):
    import longtrain.train.trainer as trainer

    def fails(*args, **kwargs):
        raise LongtrainError("the step failed")

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() + '{"step": 7, "loss": 1.0}\n')  # past the checkpoint
    before = snapshot(out)
    monkeypatch.setattr(trainer, "strategy_step", fails)
    code, _, err = cli(*tiny(data_file, "--steps", "4", "--resume", "--out", out))
    assert code == 2 and err.strip() == "longtrain: error: the step failed"
    assert snapshot(out) == before


def test_a_run_stopped_while_writing_its_final_model_gets_it_on_resume(tmp_path, data_file, finished):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    code, text, err = cli(*tiny(data_file, "--steps", "2", "--resume", "--out", out))
    assert code == 0, err
    assert "writing its final model and summary, which are missing" in text
    assert (out / "final" / "config.json").exists() and (out / "summary.json").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "eval" in r] == [2]  # not logged twice


# ---- one run per run directory ---------------------------------------------------------

def _hold_lock(path: Path):
    """Another process holding ``path``'s lock, as a live run does; it holds until killed."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               "f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
                               "print('held', flush=True); time.sleep(600)", str(path)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_directory_another_process_holds_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path, data_file, finished):
    import signal

    from longtrain.train.lock import LOCK_FILE

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    holder = _hold_lock(out / LOCK_FILE)
    try:
        before = snapshot(out)
        for extra in (["--resume"], ["--overwrite"], []):
            code, stdout, err = cli(*tiny(data_file, "--steps", "3", "--out", out, *extra))
            assert code == 2 and err.count("\n") == 1 and not stdout, stdout + err
            assert f"--out {out} is in use by another longtrain run" in err and "--out NEW_DIR" in err, err
            assert snapshot(out) == before  # nothing lost, nothing changed
    finally:
        holder.send_signal(signal.SIGKILL)  # as kill -9: the system lets go of its lock
        holder.wait()
    code, _, err = cli(*tiny(data_file, "--steps", "3", "--out", out, "--resume"))
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3]


def test_a_live_run_holds_its_directory_until_it_ends(tmp_path, data_file):
    from longtrain.cli import build_parser
    from longtrain.train.trainer import Trainer, config_from_dict

    out = tmp_path / "run"
    argv = [str(a) for a in tiny(data_file, "--steps", "1", "--out", out)]
    first = Trainer(config_from_dict(vars(build_parser().parse_args(argv))))  # set up: it holds --out
    before = snapshot(out)
    code, _, err = cli(*tiny(data_file, "--steps", "1", "--out", out, "--overwrite"))
    assert code == 2 and err.count("\n") == 1 and "is in use by another longtrain run" in err, err
    assert snapshot(out) == before
    first.train()  # ends: lets go
    code, text, err = cli(*tiny(data_file, "--steps", "1", "--out", out, "--resume"))
    assert code == 0 and "already finished step 1" in text, err


# ---- divergence ------------------------------------------------------------------------

def _strict(path: Path) -> list[dict]:
    """Every line of a JSON file read as strict JSON (no bare NaN or Infinity)."""
    def refuse(word):
        raise ValueError(f"{word} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_diverging_run_stops_at_its_first_non_finite_step_and_names_no_checkpoint_whose_weights_blew_up(tmp_path, data_file):
    """--lr 1e30: step 1 leaves finite but huge weights (checkpointed), step 2's loss is not
    finite. That checkpoint is no way forward — resumed with a sane --lr it diverges again —
    so the line names none and says to start again."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    code, _, err = cli(*tiny(data_file, "--steps", "8", "--save-every", "1", "--lr", "1e30", "--out", out))
    assert code == 2 and err.count("\n") == 1, err
    assert "training diverged at step 2" in err and "lower --lr (now 1e+30)" in err, err
    assert "no checkpoint kept was saved while the run still trained sanely (the last, step 1, holds the weights that led " \
           "here)" in err and "then start again with --overwrite (or --out NEW_DIR)" in err, err
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    weights = load_file(str(latest / "weights.safetensors"))
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())  # nothing non-finite is ever written
    assert json.loads((latest / "manifest.json").read_text())["step"] == 1
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    assert [r["step"] for r in _strict(out / "metrics.jsonl")] == [1]
    # What the old line advised (continue from "the last good checkpoint" with a lower --lr) diverges again.
    code, _, err = cli(*tiny(data_file, "--steps", "8", "--save-every", "1", "--lr", "1e-3", "--out", out, "--resume"))
    assert code == 2 and "training diverged at step 2" in err, err


def test_after_a_divergence_the_checkpoint_named_is_the_newest_that_still_trained_sanely(tmp_path):
    """Checkpoints at steps 1-3, the loss of step 3 already blown up (40 × the first), step 4
    not finite: step 3's weights gave the non-finite loss, step 2's the blown-up one, so the
    way forward is step 1 (``--resume-from`` it); with step 3 sane, the latest (``--resume``)."""
    from longtrain.train import run_checkpoints as ckpt
    from longtrain.train.divergence import diverged

    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, {"weights.safetensors": lambda p: p.write_bytes(b"w")}, {}, keep=3)
    config = TrainConfig(lr=0.5)
    records = {1: {"loss": 5.0, "grad_norm": 1.0}, 2: {"loss": 5.5, "grad_norm": 2.0}, 3: {"loss": 200.0, "grad_norm": 9.0}}
    said = str(diverged("the loss is nan", 4, config, tmp_path, torch.float32, records=records))
    assert "the last checkpoint (step 3) holds weights that already trained badly" in said, said
    assert f"the newest good checkpoint is {tmp_path / 'step-00000001'} (step 1)" in said
    assert said.endswith(f"then continue with --resume-from {tmp_path / 'step-00000001'}") and "\n" not in said
    records[3] = {"loss": 5.2, "grad_norm": 1.5}
    records[4] = {"loss": 5.1, "grad_norm": 1.0}  # step 4 trained; its optimizer step left non-finite weights
    said = str(diverged("the optimizer step left non-finite weights", 4, config, tmp_path, torch.float32, records=records))
    assert f"{tmp_path / 'latest'} still names the last good checkpoint (step 3)" in said and "continue with --resume" in said
    records[2] = {"loss": None, "grad_norm": None}  # logged as null: not finite
    del records[4]
    said = str(diverged("the loss is nan", 4, config, tmp_path, torch.float32, records={1: records[1], 2: records[2]}))
    assert "no checkpoint kept was saved while the run still trained sanely" in said


def test_float16_that_overflows_writes_no_checkpoint(tmp_path, data_file):
    """Pure float16 AdamW (its epsilon rounds to zero in float16) diverges at once."""
    out = tmp_path / "run"
    code, _, err = cli(*tiny(data_file, "--steps", "3", "--save-every", "1", "--dtype", "float16", "--optimizer", "adamw-16bit",
                             "--out", out))
    assert code == 2 and err.count("\n") == 1, err
    assert "training diverged at step" in err and "use --dtype bfloat16 or float32" in err
    assert not (out / "checkpoints" / "latest").exists() and not (out / "final").exists()
    _strict(out / "metrics.jsonl")


def test_metrics_and_summaries_are_strict_json(tmp_path):
    from longtrain.train.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "loss": 2.0, "eval": {"loss": float("nan"), "tokens": 3}, "grad_norm": float("inf")})
    log.close()
    assert _strict(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0, "eval": {"loss": None, "tokens": 3},
                                                    "grad_norm": None}]


# ---- the command line itself -----------------------------------------------------------

def test_usage_mistakes_are_one_line():
    for argv, message in [
        (["--model", "x"], "a command is missing before '--model'"),
        ([], "a command is missing"),
        (["simulate", "--model", "tiny-llama", "--seq-len", "64", "--device-memory", "-5GiB"],
         "argument --device-memory: a memory size must be positive, like 80GiB, got '-5GiB'"),
        (["simulate", "--model", "tiny-llama", "--seq-len", "64", "--device-memory=-5GiB"], "a memory size must be positive"),
        (["plan", "--model", "tiny-llama", "--seq-len", "1K", "--device-memory", "8GiB", "--host-memory", "-1GiB"],
         "argument --host-memory: a memory size must be positive"),
    ]:
        code, stdout, err = cli(*argv)
        assert code == 2 and not stdout and err.count("\n") == 1 and message in err, (argv, err)
        if argv[:1] != ["simulate"] and argv[:1] != ["plan"]:
            assert "train, simulate, plan, calibrate, presets" in err


def test_value_mistakes_are_refused_before_torch_loads():
    """`train`'s checks of its values come before torch and transformers load (a refusal
    in well under a second instead of 5-8 s)."""
    printed = in_a_fresh_interpreter(
        "plan = ['plan', '--model', 'tiny-llama', '--seq-len', '2K', '--device-memory', '1GiB', '--host-memory', '1GiB']\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        "    codes = [main(a) for a in (['train', '--steps', '0'], ['train', '--out', ''], ['train', '--data', ''],\n"
        "                               ['train', '--seq-len', '64K', '--lr', '-1e-3'],\n"
        "                               ['simulate', '--model', 'tiny-llama', '--seq-len', '1'],\n"
        "                               [*plan, '--gpus', '0'], [*plan, '--dtype', 'int8'], [*plan, '--engine', 'warp'])]\n"
        "print(codes, err.getvalue().count('\\n'))")
    assert printed == "[2, 2, 2, 2, 2, 2, 2, 2] 8 []"


# ---- what `longtrain plan` prints pastes into --strategy -------------------------------

def _without_host_budgets(strategy) -> dict:
    """A strategy's settings but its host budgets: a plan's row names the strategy's shape,
    and the budget is the run's (the planner fills in --host-memory; a run defaults to half the host)."""
    data = strategy.to_dict()
    return {part: ({k: {o: v for o, v in opts.items() if o != "host_memory"} for k, opts in data[part].items()}
                   if part == "techniques" else {o: v for o, v in data[part].items() if o != "host_memory"})
            for part in data}


def test_the_planners_labels_parse_to_the_strategies_it_meant(tmp_path, data_file):
    import dataclasses

    from longtrain.plan.planner import candidates

    _write_inputs(tmp_path)
    planned = candidates(262_144, 120 * 2**30, 32)
    assert "fpdt:chunk=8192:offload_inputs:keep_output,mst" in planned
    for label, strategy in planned.items():
        assert _without_host_budgets(lt.Strategy.parse(label)) == _without_host_budgets(strategy), label
        # Through `train`: past parsing, to the first check of --out (a file here).
        code, _, err = cli(*tiny(data_file, "--strategy", label, "--out", tmp_path / "a-file"))
        assert code == 2 and "is a file; pass --out a directory" in err, (label, err)
    # The rows plan() derives: kept outputs counted, sequence parallel over --gpus.
    fpdt = planned["fpdt:chunk=8192:offload:keep_output=fit,mst"]
    counted = lt.Strategy("fpdt", dataclasses.replace(fpdt.engine_options, keep_output=3), **fpdt.techniques)
    assert lt.Strategy.parse("fpdt:chunk=8192:offload:keep_output=3,mst") == counted
    spread = lt.Strategy("fpdt", fpdt.engine_options, sequence_parallel=8, **fpdt.techniques)
    assert lt.Strategy.parse("fpdt:chunk=8192:offload:keep_output=fit,mst+sp8") == spread
    assert lt.Strategy.parse("fpdt:chunk=8192:offload:keep_output=fit,mst+sp8", sequence_parallel=8) == spread


def test_a_planners_label_trains_and_simulates_as_printed(tmp_path, data_file):
    from longtrain.plan.planner import candidates

    label = "fpdt:chunk=32:offload_inputs:keep_output,mst"
    assert label in candidates(64, 2**30, 2, chunks=(32,))  # the planner's own spelling at this length
    code, _, err = cli(*tiny(data_file, "--steps", "1", "--strategy", label, "--out", tmp_path / "run"))
    assert code == 0, err
    ran = json.loads((tmp_path / "run" / "summary.json").read_text())["strategy"]
    assert ran.startswith("fpdt:chunk=32:") and lt.Strategy.parse(ran) == lt.Strategy.parse(label)  # what ran, options and all
    code, _, err = cli("simulate", "--model", "tiny-llama", "--seq-len", "64", "--strategy", label, "--no-progress")
    assert code == 0, err
    code, _, err = cli(*tiny(data_file, "--steps", "1", "--strategy", label, "--engine", "fpdt:chunk=32:offload_inputs=yes",
                             "--out", tmp_path / "again"))
    assert code == 0, err  # the same engine named twice, agreeing


def test_every_plan_row_prints_train_flags_that_paste_whole():
    """Each row of `longtrain plan` prints the options that train it (--strategy, and
    --optimizer-offload where AdamW's state is in host memory), and the plan the whole
    command line of its winner: pasted into `longtrain train`, they parse to the row's
    strategy and optimizer place."""
    import re
    import shlex

    from longtrain.cli import build_parser

    argv = ["plan", "--model", "tiny-llama", "--seq-len", "2K", "--device-memory", "1GiB", "--host-memory", "1GB",
            "--jobs", "1", "--exhaustive"]
    code, table, err = cli(*argv)
    assert code == 0, err
    code, printed, err = cli(*argv, "--json")
    assert code == 0, err
    plan = json.loads(printed)
    labels = [re.split(r"\s{2,}", line)[0] for line in table.splitlines() if line.startswith("--strategy ")]
    assert labels == [shlex.join(row["flags"]) for row in plan["rows"]]
    assert {row["optimizer_offload"] for row in plan["rows"]} == {False, True}
    assert not [label for label in labels if "·" in label or "host memory" in label]
    for row in plan["rows"]:
        words = shlex.split(row["command"])
        assert words[:2] == ["longtrain", "train"] and words[-len(row["flags"]):] == row["flags"]
        args = build_parser().parse_args(words[1:])
        assert (args.model, args.seq_len, args.optimizer_offload) == ("tiny-llama", 2048, row["optimizer_offload"])
        assert _without_host_budgets(lt.Strategy.parse(args.strategy)) == \
            _without_host_budgets(lt.Strategy.from_dict(row["strategy"])), row["command"]
    best = next(row for row in plan["rows"] if row["fits"])
    assert f"train it: {best['command']}" in table.splitlines()


def test_simulate_takes_the_optimizer_offload_flag_train_and_plan_take():
    """One name for AdamW's state in host memory: --optimizer-offload, as train and plan
    spell it. The earlier `--optimizer adamw-offload` is read as it, with a one-line note."""
    base = ["simulate", "--model", "tiny-llama", "--seq-len", "64", "--no-progress", "--json"]
    code, printed, err = cli(*base, "--optimizer-offload")
    assert code == 0 and not err, err
    report = json.loads(printed)
    assert report["optimizer"] == "adamw-offload" and report["peak"]["peak_host_bytes"] > 0
    code, old, err = cli(*base, "--optimizer", "adamw-offload")
    assert code == 0 and json.loads(old)["peak"] == report["peak"]
    assert err.count("\n") == 1 and "--optimizer-offload" in err
    code, table, err = cli(*base[:-1], "--optimizer-offload")
    assert code == 0 and "optimizer adamw in host memory (--optimizer-offload)" in table
    for wrong, message in [(["--optimizer", "sgd", "--optimizer-offload"], "needs --optimizer adamw"),
                           (["--optimizer", "lion"], "invalid choice: 'lion' (choose from 'adamw', 'adamw-16bit', 'sgd', 'none')")]:
        code, _, err = cli(*base, *wrong)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    code, helped, _ = cli("simulate", "--help")
    assert "--optimizer {adamw,adamw-16bit,sgd,none}" in helped and "--optimizer-offload" in helped and "adamw-offload" not in helped


# ---- lengths beyond any configuration ----------------------------------------------------

@pytest.mark.parametrize("command", [
    ["plan", "--model", "llama3-8b", "--seq-len", "1000000000000", "--device-memory", "80GiB", "--host-memory", "120GiB"],
    ["plan", "--model", "llama3-8b", "--seq-len", "1T", "--device-memory", "80GiB", "--host-memory", "120GiB",
     "--gpus", "8"],
    ["simulate", "--model", "llama3-8b", "--seq-len", "1000000000000", "--device-memory", "80GiB"],
    ["simulate", "--model", "llama3-8b", "--seq-len", "1000000000000", "--strategy", "checkpoint:offload_inputs=true,mst",
     "--device-memory", "80GiB", "--host-memory", "120GiB"],
    ["simulate", "--model", "llama3-8b", "--seq-len", "1T", "--strategy", "mst", "--engine", "fpdt:offload=true",
     "--host-memory", "120GiB"],
])
def test_a_length_beyond_any_configuration_is_refused_at_once(command, capsys, monkeypatch):
    """A trillion tokens: the token ids and what the strategies park are counted from the
    config (no chunk list, no small simulation): one line, exit code 2, naming the longest
    length that could fit. "At once" is checked by what runs, not by a clock: no model is
    built on fake tensors (every simulation, a chunk curve's small ones included, enters
    FakeTensorMode), no simulation process starts, and the time model schedules no step
    (its per-chunk schedule alone would take minutes at this length) — each would fail here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longtrain.plan import planner, steps

    entered = []

    def refused(what):
        def called(*args, **kwargs):
            entered.append(what)
            raise AssertionError(f"{what} before the refusal")
        return called

    monkeypatch.setattr(FakeTensorMode, "__enter__", refused("a fake-tensor simulation"))
    monkeypatch.setattr(steps._Simulations, "start", refused("a simulation process"))
    monkeypatch.setattr(planner, "step_time", refused("the time model's step schedule"))
    code = main(command)
    err = capsys.readouterr().err.strip()
    assert entered == []
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "tokens" in err and "could fit" in err and "not simulated" in err
    longest = int(err.split("fit is " if "fit is " in err else "at most ")[1].split(" tokens")[0].replace(",", ""))
    assert 0 < longest < 2**40


# ---- `longtrain families`: each check in a bounded child, the table where asked -------------

def _allocates_past_any_limit(family):
    """A family's check that asks for 64 GiB at once (reserved, never touched: an unbounded
    child would get it without using the memory, and report the family exact)."""
    from longtrain.families import FamilyResult

    torch.empty(64 * 2**30, dtype=torch.uint8)
    return FamilyResult(family, "exact", "DecoderAdapter")


def _records_the_failure(family):
    """As check_family does: an allocation refused inside a strategy's step is that cell's one line."""
    from longtrain.families import FamilyResult

    try:
        torch.empty(64 * 2**30, dtype=torch.uint8)
        cell = 0.0
    except RuntimeError as error:
        cell = "right-padded: RuntimeError: " + " ".join(str(error).split())
    return FamilyResult(family, "inexact", "DecoderAdapter", cells={"backprop": 0.0, "checkpoint": cell})


def _records_the_failure_in_the_dropout_pass(family):
    """As check_family does when the dropout pass's step is refused its allocation."""
    result = _records_the_failure(family)
    result.dropout, result.cells = {"checkpoint": result.cells["checkpoint"].split(": ", 1)[1]}, {"backprop": 0.0}
    return result


def _gib_above_this_process() -> int:
    """A limit in whole GiB at least 1 GiB above this process's address space (which a forked
    child inherits: the limit counts it), so the child has room for its own small work."""
    size = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmSize:"))
    return size // 2**30 + 2


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address space from /proc (Linux)")
@pytest.mark.parametrize("check", [_allocates_past_any_limit, _records_the_failure, _records_the_failure_in_the_dropout_pass])
def test_a_family_past_the_memory_limit_is_reported_as_exceeding_it_in_one_line(check, tmp_path, monkeypatch):
    from longtrain import families

    monkeypatch.setattr(families.child, "check_family", check)  # the forked child runs it
    gib = _gib_above_this_process()
    result = families.check_in_process("llama", memory_limit=gib * 2**30)
    assert (result.status, result.reason) == ("not built", f"exceeded the memory limit of {gib} GiB"), result
    code, out, err = cli("families", "llama", "--memory-limit", f"{gib}GiB", "--out", tmp_path / "f.md")
    assert code == 0, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"[1/1] llama: not built: exceeded the memory limit of {gib} GiB (") and "resident)" in err, err
    saved = json.loads((tmp_path / "f.json").read_text())
    limit = "" if gib == 4 else f" --memory-limit {gib}GiB"  # the default is not repeated
    assert saved["command"] == f"longtrain families llama --out {tmp_path / 'f.md'}{limit}"
    assert [(r["family"], r["status"], r["reason"]) for r in saved["results"]] == \
        [("llama", "not built", f"exceeded the memory limit of {gib} GiB")]
    assert all(not isinstance(v, str) for v in saved["results"][0]["cells"].values())  # the refused allocation's line is gone


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address space from /proc (Linux)")
def test_a_family_check_within_the_limit_reports_its_verdict_and_peak(monkeypatch):
    """The child's verdict comes back as it was given; its peak resident memory (wait4's
    ru_maxrss) counts what it touched."""
    from longtrain import families

    def touches_256_mib(family):
        block = torch.ones(256 * 2**20, dtype=torch.uint8)  # written: resident
        return families.FamilyResult(family, "exact", "DecoderAdapter", cells={"backprop": float(block[0]) - 1})

    monkeypatch.setattr(families.child, "check_family", touches_256_mib)
    limit = _gib_above_this_process() * 2**30
    result, peak = families.child._check_in_child("llama", 120.0, limit)
    assert (result.status, result.cells) == ("exact", {"backprop": 0.0})
    assert 256 * 2**20 < peak < limit


def test_the_families_table_is_written_in_the_current_directory_by_default(tmp_path, monkeypatch):
    """Not into a source checkout's docs/results/families.md: ./families.md and ./families.json unless
    --out says otherwise (the project's own table: --out docs/results/families.md); --help says so,
    and that families are checked one at a time under a memory limit."""
    from longtrain import families

    checked = families.FamilyResult("llama", "exact", "DecoderAdapter", cells={s: 0.0 for s in families.STRATEGIES})
    monkeypatch.setattr(families.child, "check_family", lambda family: checked)
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("families", "llama")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["families.json", "families.md"]
    assert "table in families.md" in out
    assert json.loads((tmp_path / "families.json").read_text())["command"] == "longtrain families llama"
    assert "| `llama` | exact |" in (tmp_path / "families.md").read_text()
    code, out, _ = cli("families", "--help")
    text = " ".join(out.split())
    assert code == 0 and "default: families.md in the current directory" in text and "One family at a time" in text
    assert "--memory-limit" in text and "4GiB (default)" in text


# ---- a run directory whose latest pointer is gone ------------------------------------------

def test_a_run_without_its_latest_pointer_continues_from_the_newest_valid_checkpoint_it_names(tmp_path, data_file, finished):
    """checkpoints/latest removed and the newest checkpoint corrupt: --resume names step 1
    (the newest that verifies), never suggests --overwrite, changes nothing; following the
    line continues the run."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "checkpoints" / "latest").unlink()
    weights = out / "checkpoints" / "step-00000002" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    before = snapshot(out)
    code, stdout, err = cli(*tiny(data_file, "--steps", "3", "--resume", "--out", out))
    newest = out / "checkpoints" / "step-00000001"
    assert code == 2 and err.count("\n") == 1 and not stdout, stdout + err
    assert f"the newest valid one is {newest} (step 1): pass --resume-from {newest} instead of --resume" in err, err
    assert "--overwrite" not in err and "no checkpoint to continue from" not in err
    assert snapshot(out) == before
    code, _, err = cli(*tiny(data_file, "--steps", "3", "--resume-from", newest, "--out", out))
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
    assert (out / "checkpoints" / "latest").read_text() == "step-00000003"


# ---- the data a run trained on ------------------------------------------------------------

def test_a_resume_on_other_data_at_the_same_path_is_refused_until_the_data_is_back(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    out = tmp_path / "run"
    code, _, err = cli(*tiny(data, "--steps", "1", "--out", out))
    assert code == 0, err
    assert json.loads((out / "checkpoints" / "step-00000001" / "manifest.json").read_text())["meta"]["data"]["files"] == 1
    data.write_text(TEXT.replace("fox", "cat"))  # same size, other words
    before = snapshot(out)
    code, _, err = cli(*tiny(data, "--steps", "2", "--resume", "--out", out))
    assert code == 2 and err.count("\n") == 1, err
    assert f"--data {data} is not the data checkpoint {out / 'checkpoints' / 'step-00000001'} was trained on (the same " \
           "1 file of 2,800 bytes, but other names or contents); restore the data it trained on" in err, err
    assert snapshot(out) == before
    shutil.copy(tmp_path / "data.txt", tmp_path / "copy.txt")
    data.write_text(TEXT)  # restored (a new modification time: the content is what counts)
    code, _, err = cli(*tiny(data, "--steps", "2", "--resume", "--out", out))
    assert code == 0, err


def test_the_data_fingerprint_reads_the_ends_of_large_files(tmp_path):
    from longtrain.train.records import fingerprint

    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * (3 << 20))
    first = fingerprint(big)
    assert first["bytes"] == 3 << 20 and first == fingerprint(big)
    with open(big, "r+b") as f:
        f.seek((3 << 20) - 10)
        f.write(b"b")  # within the last MiB
    assert fingerprint(big) != first
    (tmp_path / "dir").mkdir()
    shutil.copy(big, tmp_path / "dir" / "a.txt")
    two = fingerprint(tmp_path / "dir")
    (tmp_path / "dir" / "b.txt").write_text("more")
    assert fingerprint(tmp_path / "dir")["files"] == 2 and fingerprint(tmp_path / "dir") != two


# ---- chat records --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """A tiny byte-level BPE with a chat template that names the assistant role only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([TEXT] * 2, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>")
    hf.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}A: {% generation %}{{ m['content'] }}<|end|>"
                        "{% endgeneration %}{% else %}{{ m['role'] }}: {{ m['content'] }}<|end|>{% endif %}{% endfor %}")
    path = tmp_path_factory.mktemp("tokenizer") / "chat"
    hf.save_pretrained(path)
    return path


def _chats(n: int, role: str = "assistant") -> list[str]:
    return [json.dumps({"messages": [{"role": "user", "content": f"the quick brown fox {i}"},
                                     {"role": role, "content": "jumps over the lazy dog " * 3}]}) for i in range(n)]


def test_a_chat_with_an_unknown_role_is_refused_in_one_line(tmp_path, chat_tokenizer):
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(_chats(12) + _chats(1, role="assistent")) + "\n")
    code, _, err = cli(*tiny(data, "--tokenizer", chat_tokenizer, "--steps", "1", "--out", tmp_path / "run"))
    assert code == 2 and err.count("\n") == 1, err
    assert f"line 13 of {data}: message 2 of 'messages' has role 'assistent', which neither the usual roles" in err, err
    assert "fix the role" in err and not (tmp_path / "run").exists()


def test_text_mixed_with_chats_trains_and_says_where_each_has_its_loss(tmp_path, chat_tokenizer):
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(_chats(12) + [json.dumps({"text": TEXT[:300]})] * 3) + "\n")
    code, out, err = cli(*tiny(data, "--tokenizer", chat_tokenizer, "--steps", "1", "--out", tmp_path / "run"))
    assert code == 0, err
    notes = [line for line in out.splitlines() if "mixes" in line]
    assert notes == [f"longtrain train: {data} mixes 3 text documents (the loss on every token) with 12 chat or "
                     "prompt/completion records (the loss on the assistant's or completion's tokens); --loss-on all puts "
                     "it on every token of both"], out


# ---- names and the learning rate -----------------------------------------------------------

def test_name_mistakes_are_refused_before_torch_loads(tmp_path):
    """A bad --engine, --strategy, --dtype, --device or --model is refused from the text
    alone: torch and transformers are never imported (no timing: the modules say it)."""
    printed = in_a_fresh_interpreter(
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        f"    codes = [main(['train', '--out', {str(tmp_path / 'run')!r}] + a) for a in (\n"
        "        ['--engine', 'warp:chunk=8'], ['--strategy', 'checkpoint,warp'], ['--strategy', 'fpdt:chunk=9,warp+sp2'],\n"
        "        ['--strategy', 'none.yaml'], ['--dtype', 'fp8'], ['--device', 'tpu:0'], ['--model', './no/such/dir'],\n"
        "        ['--model', 'llama-9000'], ['--lora-rank', '4'], ['--warmup-steps', '300'])]\n"
        "print(codes, err.getvalue().count('\\n'))")
    assert printed == f"{[2] * 10} 10 []"
    assert not (tmp_path / "run").exists()


def test_the_names_checked_before_torch_loads_are_the_registrys():
    from longtrain import registry
    from longtrain.models.loading import _DTYPES
    from longtrain.strategy import _MOVED
    from longtrain.train import config

    builtin = lambda table: {n for n, e in table.items()  # noqa: E731 - tests may register toy ones
                             if (getattr(e, "step", None) or e.install).__module__.startswith("longtrain.")}
    assert set(config.ENGINES) == builtin(registry.engines())
    assert set(config.TECHNIQUES) == builtin(registry.techniques())
    assert set(config.MOVED_TECHNIQUES) == set(_MOVED)
    assert list(config.DTYPES) == list(_DTYPES)


def test_the_default_warmup_of_a_short_run_is_a_tenth_of_it():
    from longtrain.train.config import warmup_steps

    assert [warmup_steps(TrainConfig(steps=n)) for n in (1, 2, 9, 20, 21, 200)] == [0, 0, 0, 2, 20, 20]
    assert warmup_steps(TrainConfig(steps=3, warmup_steps=2)) == 2
    check_config(TrainConfig(steps=2))  # the default never trips the refusal of a warm-up as long as the run


def test_simulating_a_mixture_of_experts_in_float32_is_refused_in_one_line():
    """The fake mode's grouped-matmul kernel takes bfloat16 only: a float32 simulation of a
    mixture of experts ended in a traceback."""
    code, _, err = cli("simulate", "--model", "tiny-qwen3-moe", "--seq-len", "64", "--dtype", "float32")
    lines = [line for line in err.splitlines() if line.startswith("longtrain: error")]
    assert code == 2 and len(lines) == 1 and "--dtype bfloat16" in lines[0] and "Traceback" not in err


def test_a_family_outside_the_llama_layout_is_refused_not_called_unbuilt():
    """Gemma-3's multimodal wrapper builds, but its layers are not where the Llama-layout
    adapter looks (its dropout pass raised past the check): a refusal that says so, not
    "transformers cannot build it"."""
    from longtrain.families.check import check_family

    result = check_family("gemma3", strategies=("backprop",), batches=("packed",))
    assert result.status == "refused" and "Llama-layout adapter could not run it (Gemma3ForConditionalGeneration)" in result.reason


def test_a_file_given_as_the_model_directory_is_named_a_file(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a directory")
    code, _, err = cli("train", "--model", weights, "--out", tmp_path / "run")
    assert code == 2 and err.count("\n") == 1 and "is a file, not a model directory" in err
    assert not (tmp_path / "run").exists()


def test_a_plan_answers_the_ops_it_has_seen_from_records_not_from_the_fake_tensor_dispatcher(monkeypatch):
    """Plans under half a minute on two cores rest on the simulator's per-op cost: an op
    seen before with the same input metadata is built from its record
    (longtrain.memory.fake_replay), so simulating a candidate again sends almost nothing to
    FakeTensorMode's dispatcher. Counted, not timed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longtrain.memory import fake_replay
    from longtrain.plan.simulate import simulate

    monkeypatch.setattr(fake_replay, "_ENABLED", [True])
    answered = []
    dispatch = FakeTensorMode.dispatch

    def counted(self, func, types, args=(), kwargs=None):
        answered.append(func)
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
    counts = []
    for replay in (False, True, True):
        fake_replay.replaying(replay)
        answered.clear()
        simulate("tiny-llama", 101, strategy="fpdt:chunk=32:offload:keep_output,mst", exact=True, optimizer="none")
        counts.append(len(answered))
    # Building the model (outside the step), factories and out= ops: still dispatched.
    assert 0 < counts[2] < counts[0] / 10


@pytest.mark.parametrize("command", [["simulate", "--seq-len", "256"],
                                     ["plan", "--seq-len", "256", "--device-memory", "1GiB", "--host-memory", "1GiB"]])
def test_simulate_and_plan_refuse_a_lora_rank_without_lora_in_one_line(command):
    """As train does: the rank alone would simulate or plan full fine-tuning without a word."""
    code, out, err = cli(command[0], "--model", "tiny-llama", *command[1:], "--lora-rank", "16")
    assert code == 2 and not out
    assert err.strip().splitlines() == ["longtrain: error: --lora-rank has no effect without --lora; add --lora "
                                         "(or drop --lora-rank)"]


def test_packing_without_data_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--packing", "best-fit", "--out", str(out)]) == 2
    assert "--packing arranges the records of --data" in capsys.readouterr().err and not out.exists()


def test_a_run_resumes_with_its_data_named_by_another_path_to_the_same_file(tmp_path, data_file, monkeypatch):
    """`--data text.txt` from its folder and `--data /abs/text.txt` name one file: the resume
    is the run's, not "another setting"."""
    monkeypatch.chdir(data_file.parent)
    out = tmp_path / "run"
    code, _, err = cli(*tiny(data_file.name, "--steps", "1", "--out", out))
    assert code == 0, err
    code, _, err = cli(*tiny(str(data_file), "--steps", "2", "--resume", "--out", out))
    assert code == 0, err
