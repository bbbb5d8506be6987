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
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import longtrain as lt
from longtrain.cli import main
from conftest import cli
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
    """A BERT (masked LM) directory, a Llama directory without tokenizer files, and a
    copy of it whose model.safetensors was cut short (a copy that stopped half way)."""
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("models")
    BertForMaskedLM(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(root / "bert")
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=64)).save_pretrained(root / "llama")
    shutil.copytree(root / "llama", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return {"bert": root / "bert", "llama": root / "llama", "truncated": root / "truncated"}


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
    ("strategy file engine 5", ["--strategy", "{tmp}/engine5.json"], "fresh", 2, "engine must be a name or a mapping"),
    ("strategy file YAML list", ["--strategy", "{tmp}/list.yaml"], "fresh", 2, "techniques must be a mapping"),
    ("strategy file broken", ["--strategy", "{tmp}/broken.yaml"], "fresh", 2, "is not valid YAML"),
    ("out is a file", ["--out", "{tmp}/a-file"], None, 2, "is a file; pass --out a directory"),
    ("out under a file", ["--out", "{tmp}/a-file/run"], None, 2, "is a file; pass --out a directory"),
    ("BERT model", ["--model", "{bert}"], "fresh", 2, "not a causal (decoder-only) language model"),
    ("model without tokenizer", ["--model", "{llama}"], "fresh", 2, "--tokenizer bytes"),
    ("tensorboard missing", ["--tensorboard"], "fresh", 2, "pip install 'longtrain[tensorboard]'"),
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
    if out_kind == "finished":
        shutil.copytree(finished, out)
    fill = {"tmp": tmp_path, **model_dirs}
    args = [a.format(**fill) if isinstance(a, str) else a for a in argv]
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
    # The rule: lr(step) = --lr × WarmupCosine(--warmup-steps, --steps)(step), here still warming up.
    from longtrain.train.trainer import WarmupCosine

    assert steps[2]["lr"] == pytest.approx(1e-3 * WarmupCosine(20, 3)(2))
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
    from longtrain.train import checkpoint as ckpt

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


def test_a_diverging_run_stops_at_its_first_non_finite_step_and_keeps_its_last_good_checkpoint(tmp_path, data_file):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    code, _, err = cli(*tiny(data_file, "--steps", "8", "--save-every", "1", "--lr", "1e6", "--out", out))
    assert code == 2 and err.count("\n") == 1, err
    assert "training diverged at step" in err and "is nan" in err and "lower --lr (now 1e+06)" in err and "--resume" in err
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    weights = load_file(str(latest / "weights.safetensors"))
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    stopped = int(err.split("diverged at step ")[1].split(":")[0])
    assert json.loads((latest / "manifest.json").read_text())["step"] == stopped - 1 < 8
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    records = _strict(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, stopped))


def test_float16_that_overflows_writes_no_checkpoint(tmp_path, data_file):
    out = tmp_path / "run"
    code, _, err = cli(*tiny(data_file, "--steps", "3", "--save-every", "1", "--dtype", "float16", "--out", out))
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
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        "    codes = [main(a) for a in (['train', '--steps', '0'], ['train', '--out', ''], ['train', '--data', ''],\n"
        "                               ['train', '--seq-len', '64K', '--lr', '-1e-3'],\n"
        "                               ['simulate', '--model', 'tiny-llama', '--seq-len', '1'])]\n"
        "print(codes, err.getvalue().count('\\n'))")
    assert printed == "[2, 2, 2, 2, 2] 5 []"


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
def test_a_length_beyond_any_configuration_is_refused_at_once(command, capsys):
    """A trillion tokens: the token ids and what the strategies park are counted from the
    config (no chunk list, no small simulation): one line, exit code 2, naming the longest
    length that could fit."""
    main(command)  # once for the imports (torch, transformers, the model's modules), outside the timed call
    capsys.readouterr()
    started = time.perf_counter()
    code = main(command)
    seconds = time.perf_counter() - started
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert seconds < 5, seconds
    assert "tokens" in err and "could fit" in err and "not simulated" in err
    longest = int(err.split("fit is " if "fit is " in err else "at most ")[1].split(" tokens")[0].replace(",", ""))
    assert 0 < longest < 2**40
