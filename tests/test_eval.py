"""`longtrain eval` and its Python function: cells over lengths × depths, eval.json and the
eval.png heat map, where the needle lands, determinism, the shipped demo model finding
keys, and one-line refusals (exit code 2) before torch loads."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch
from conftest import cli

from longtrain.models.presets import packaged_checkpoint
from longtrain.train.config import TrainConfig
from longtrain.train.eval_config import EvalConfig, check_eval_config, default_out
from longtrain.train.evaluate import evaluate_long_context, flat_metrics, format_table
from longtrain.train.passkey import NEEDLE, QUESTION, PasskeyTask
from longtrain.train.tokenizer import ByteTokenizer, HFTokenizer
from longtrain.train.trainer import build_model

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def demo():
    """The demo preset: the small pretrained model longtrain ships, and its byte tokenizer."""
    model, tokenizer = build_model(TrainConfig(model="demo", seq_len=1024), torch.float32)
    return model.eval(), tokenizer


def test_eval_writes_every_cell_a_heat_map_and_a_table(tmp_path):
    out = tmp_path / "eval"
    code, stdout, err = cli("eval", "--model", "tiny-llama", "--lengths", "256,512", "--depths", "0,0.5,1",
                            "--samples", "2", "--out", out)
    assert code == 0, err
    document = json.loads((out / "eval.json").read_text())
    cells = document["cells"]
    assert sorted((c["length"], c["depth"]) for c in cells if c["task"] == "needle") == \
        [(n, d) for n in (256, 512) for d in (0.0, 0.5, 1.0)]
    assert sorted(c["length"] for c in cells if c["task"] == "passkey") == [256, 512]
    for c in cells:
        assert set(c) == {"task", "length", "depth", "needles", "accuracy", "digit_accuracy", "samples"}
        assert c["samples"] == 2 and 0 <= c["accuracy"] <= c["digit_accuracy"] <= 1
    assert document["lengths"] == [256, 512] and document["depths"] == [0.0, 0.5, 1.0] and document["seed"] == 0
    assert (out / "eval.png").read_bytes()[:8] == PNG
    assert err.count("\n") == len(cells)  # a line per cell
    assert stdout.splitlines()[0].split() == ["depth", "256", "512"] and "needle 0.50" in stdout and "pass key" in stdout
    assert f"eval.json, eval.png in {out}" in stdout


def test_eval_is_deterministic_given_the_seed_and_the_python_function_gives_the_commands_cells(tmp_path, demo):
    model, tokenizer = demo
    settings = dict(lengths=[256], depths=[0.0, 1.0], samples=3, seed=5)
    first = evaluate_long_context(model, tokenizer, **settings)
    assert first == evaluate_long_context(model, tokenizer, **settings)
    code, stdout, err = cli("eval", "--model", "demo", "--lengths", "256", "--depths", "1,0", "--samples", "3",
                            "--seed", "5", "--out", tmp_path / "e", "--json", "--no-progress")
    assert code == 0 and not err, err
    assert json.loads(stdout)["cells"] == first
    keys = [PasskeyTask(tokenizer, 256, seed=seed, depth=0.5).sample(0, "eval")["input_ids"] for seed in (5, 5, 6)]
    assert torch.equal(keys[0], keys[1]) and not torch.equal(keys[0], keys[2])
    assert flat_metrics(first) == {"eval_passkey_256": first[0]["accuracy"], "eval_needle_256_d0.00": first[1]["accuracy"],
                                   "eval_needle_256_d1.00": first[2]["accuracy"]}


def _needle_start(ids: list[int], tokenizer) -> int:
    """Where the needle's text begins in ``ids`` (found by its tokens, not by the layout)."""
    head = tokenizer.encode(NEEDLE.split("{key}")[0])
    starts = [i for i in range(len(ids) - len(head) + 1) if ids[i : i + len(head)] == head]
    assert len(starts) == 1, starts
    return starts[0]


def _subword_tokenizer():
    """A byte-level BPE of 300 tokens trained on the filler text: a subword tokenizer
    whose numbers and words span several bytes, built offline in a tenth of a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from longtrain.train.passkey import filler_text

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = filler_text()[:200_000].decode()
    bpe.train_from_iterator([text[i : i + 1000] for i in range(0, len(text), 1000)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>")


@pytest.mark.parametrize("tokenizer", ["bytes", "subword"])
@pytest.mark.parametrize("length", [300, 1000])
def test_the_needle_lies_at_the_requested_depth(tokenizer, length):
    """Depth d puts the needle's first token at d × (the filler's tokens), within a token:
    0 is the first token, 1 ends the needle where the question begins. Sample i has the
    same key and filler at every depth."""
    tok = ByteTokenizer() if tokenizer == "bytes" else HFTokenizer(_subword_tokenizer())
    question = tok.encode(QUESTION)
    haystacks = set()
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        sample = PasskeyTask(tok, length, seed=3, depth=depth).sample(2, "eval")
        ids = sample["input_ids"].tolist()
        assert len(ids) == length
        answer = int(sample["answer_mask"].sum())
        key = tok.decode(ids[-answer:])
        needle = tok.encode(NEEDLE.format(key=key))
        fill = length - len(needle) - len(question) - answer
        start = _needle_start(ids, tok)
        assert ids[start : start + len(needle)] == needle
        assert abs(start - depth * fill) <= 0.5, (depth, start, fill)
        if depth == 1.0:
            assert ids[start + len(needle) : start + len(needle) + len(question)] == question
        haystacks.add((key, tuple(ids[:start] + ids[start + len(needle) :])))
    assert len(haystacks) == 1  # only the needle moved


def test_a_hugging_face_tokenizer_is_accepted_by_the_python_function():
    model, _ = build_model(TrainConfig(model="tiny-llama", seq_len=512), torch.float32)
    cells = evaluate_long_context(model, _subword_tokenizer(), [400], [0.5], samples=1, task="needle")
    assert [(c["task"], c["length"], c["depth"], c["samples"]) for c in cells] == [("needle", 400, 0.5, 1)]


def test_the_shipped_demo_model_finds_keys_at_every_depth_of_a_short_context(demo):
    """The demo's pretrained checkpoint (trained up to 2,048 tokens) finds single needles
    anywhere in 512 tokens, and its pass-key cell is the trainer's evaluation: with the
    pretraining's seed and samples it reproduces the record shipped beside the weights."""
    model, tokenizer = demo
    cells = evaluate_long_context(model, tokenizer, [512], [0.0, 0.5, 1.0], samples=8, task="needle")
    assert all(c["accuracy"] >= 0.75 for c in cells), cells
    record = json.loads((Path(packaged_checkpoint("demo")) / "pretraining.json").read_text())["heldout_accuracy"]["256"]
    (passkey,) = evaluate_long_context(model, tokenizer, [256], samples=32, task="passkey", seed=1)
    assert (round(passkey["digit_accuracy"], 4), round(passkey["accuracy"], 4)) == (record["digit"], record["key"])
    table = format_table(cells)
    assert table.splitlines()[1].split() == ["needle", "0.00", f"{cells[0]['accuracy']:.0%}"]


def test_a_model_directory_evaluates_with_its_own_tokenizer_into_its_run(tmp_path):
    """A run's final/ (a model directory with its tokenizer; summary.json beside): the
    default output is a new eval-DATE-TIME in the run directory; a second evaluation goes
    to another one, and an --out holding an evaluation is refused."""
    model, _ = build_model(TrainConfig(model="tiny-llama", seq_len=512), torch.float32)
    final = tmp_path / "run" / "final"
    model.save_pretrained(final)
    _subword_tokenizer().save_pretrained(final)
    (tmp_path / "run" / "summary.json").write_text("{}")
    argv = ["eval", "--model", final, "--lengths", "300", "--depths", "0.5", "--samples", "1", "--task", "needle",
            "--no-progress"]
    assert cli(*argv)[0] == 0
    assert cli(*argv)[0] == 0
    outs = sorted(p for p in (tmp_path / "run").iterdir() if p.name.startswith("eval-"))
    assert len(outs) == 2 and all((p / "eval.json").is_file() for p in outs)
    assert json.loads((outs[0] / "eval.json").read_text())["model"] == str(final.resolve())
    code, _, err = cli(*argv, "--out", outs[0])
    assert code == 2 and err.count("\n") == 1 and "holds an earlier evaluation (eval.json, eval.png)" in err


def test_default_output_directories_are_new(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    now = datetime(2026, 11, 25, 10, 0, 0)
    assert default_out("tiny-llama", now) == str(Path("runs") / "eval-20261125-100000")
    (tmp_path / "runs" / "eval-20261125-100000").mkdir(parents=True)
    assert default_out("tiny-llama", now) == str(Path("runs") / "eval-20261125-100000-2")
    (tmp_path / "models" / "final").mkdir(parents=True)  # a model directory that is no run's: under runs/
    assert default_out("models/final", now) == str(Path("runs") / "eval-20261125-100000-2")


def test_without_matplotlib_the_json_is_written_and_one_line_says_why_no_png(tmp_path, monkeypatch):
    import longtrain.train.plot as plot

    monkeypatch.setattr(plot, "plot_available", lambda: False)
    code, stdout, err = cli("eval", "--model", "tiny-llama", "--lengths", "300", "--depths", "1", "--samples", "1",
                            "--task", "needle", "--out", tmp_path / "e", "--no-progress")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == ["eval.json"]
    assert err == "longtrain eval: no eval.png (matplotlib is not installed: pip install matplotlib)\n"
    assert "eval.json in" in stdout


@pytest.fixture(scope="module")
def not_causal(tmp_path_factory) -> dict[str, Path]:
    """Model directories refused from their files alone: a BERT, a Llama without tokenizer
    files, a directory without config.json."""
    root = tmp_path_factory.mktemp("models")
    for name, config in (("bert", {"architectures": ["BertForMaskedLM"], "model_type": "bert"}),
                         ("t5", {"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True}),
                         ("llama", {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                    "max_position_embeddings": 4096})):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "empty").mkdir()
    (root / "done").mkdir()
    (root / "done" / "eval.json").write_text("{}")
    (root / "a-file").write_text("")
    return {p.name: p for p in root.iterdir()}


# (argv after `eval`, words of the one-line message); refused before torch loads unless marked.
REFUSALS = [
    (["--model", "demo", "--task", "haystack"], "argument --task: invalid choice: 'haystack'"),
    (["--model", "demo", "--depths", "0,1.5"], "--depths takes numbers in [0, 1]"),
    (["--model", "demo", "--depths", "-0.25"], "--depths takes numbers in [0, 1]"),
    (["--model", "demo", "--depths", "nan"], "--depths takes numbers in [0, 1]"),
    (["--model", "demo", "--depths", "0.3", "--task", "passkey"], "--task passkey places its needles at random"),
    (["--model", "demo", "--lengths", "0"], "--lengths takes positive token counts"),
    (["--model", "demo", "--lengths", "2K,-4K"], "--lengths takes positive token counts"),
    (["--model", "demo", "--lengths", "2K,lots"], "--lengths takes positive token counts"),
    (["--model", "demo", "--lengths", "4K,16K"], "--lengths 16K exceeds the model's max_position_embeddings (8,192); pass --extend-context"),
    (["--model", "{llama}", "--tokenizer", "bytes", "--lengths", "8K"], "max_position_embeddings (4,096)"),
    (["--model", "demo", "--samples", "0"], "--samples must be a positive integer"),
    (["--model", "demo", "--seed", "-1"], "--seed must be an integer from 0"),
    (["--model", "not-a-preset"], "unknown model preset 'not-a-preset'"),
    (["--model", "{bert}"], "holds a BertForMaskedLM, not a causal (decoder-only) language model"),
    (["--model", "{t5}"], "not a causal (decoder-only) language model"),
    (["--model", "{empty}"], "is a directory without config.json"),
    (["--model", "{llama}"], "has no tokenizer files; add the model's tokenizer there, pass --tokenizer DIR, or --tokenizer bytes"),
    (["--model", "demo", "--tokenizer", "{empty}/nothing"], "is neither auto, bytes nor a tokenizer directory"),
    (["--model", "demo", "--out", "{done}"], "holds an earlier evaluation (eval.json), which is never replaced"),
    (["--model", "demo", "--out", "{a-file}/eval"], "is a file; pass --out a directory path"),
    (["--model", "demo", "--out", ""], "--out is empty"),
    (["--model", "demo", "--lengths", "100", "--out", "{fresh}"], "--lengths 100 is too short for the pass-key task (it needs at least"),  # after the tokenizer
]


@pytest.mark.parametrize("argv, message", REFUSALS, ids=[" ".join(a[2:]) or a[1] for a, _ in REFUSALS])
def test_bad_input_is_refused_in_one_line(argv, message, not_causal, tmp_path):
    argv = [a.format(fresh=tmp_path / "fresh", **not_causal) for a in argv]
    code, stdout, err = cli("eval", *argv)
    assert code == 2 and not stdout and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "fresh").exists()


def test_check_eval_config_fills_in_lengths_and_takes_consent_to_extend(not_causal):
    config = EvalConfig(model=str(not_causal["llama"]), tokenizer="bytes")
    check_eval_config(config)
    assert config.lengths == (2048, 4096) and config.max_positions == 4096  # the defaults within the model's positions
    config = EvalConfig(model="demo", lengths=(16384,), extend_context=True)
    check_eval_config(config)
    assert config.max_positions == 8192


def test_value_mistakes_are_refused_before_torch_loads(not_causal):
    """The checks of values and model directories read files only: a refusal in well under a
    second, torch and transformers never imported."""
    argvs = [["eval", "--model", "demo", "--depths", "2"], ["eval", "--model", "demo", "--lengths", "64K"],
             ["eval", "--model", str(not_causal["bert"])], ["eval", "--model", str(not_causal["llama"])],
             ["eval", "--model", "demo", "--samples", "0"], ["eval", "--model", "demo", "--out", str(not_causal["done"])]]
    probe = ("import sys, contextlib, io; from longtrain.cli import main\n"
             "err = io.StringIO()\n"
             "with contextlib.redirect_stderr(err):\n"
             f"    codes = [main(a) for a in {argvs!r}]\n"
             "print(codes, err.getvalue().count('\\n'), sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == f"{[2] * len(argvs)} {len(argvs)} []"
