"""``--data``: the formats ``datasets`` reads locally, chat and prompt/completion records
with the loss on the assistant's or completion's tokens, best-fit packing of whole
documents, the ``documents`` layout (joined and cut, positions restarting), and one-line
refusals of bad records. Tokenizers are built here (a tiny
byte-level BPE with chat templates); nothing is downloaded."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longtrain.cli import main
from longtrain.errors import LongtrainError
from longtrain.train.data import TokenWindows, best_fit
from longtrain.train.documents import (
    ChatTemplate,
    assistant_tokens_by_spans,
    assistant_tokens_by_template,
    tokenize_record,
)
from longtrain.train.records import Record
from longtrain.train.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

datasets = pytest.importorskip("datasets")

SPECIAL = ["<pad>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# The assistant's turn is its content and end-of-turn mark, inside {% generation %} where the template marks it.
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PLAIN_TEMPLATE = GENERATION_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
WORDS = "hello there how are you the quick brown fox jumps over lazy dog what is two and three five it naps in sun".split()


def words(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + 3 * k) % len(WORDS)] for k in range(n))


def chat(i: int) -> list[dict]:
    """A conversation of one to three exchanges, some with a system message."""
    messages = [{"role": "system", "content": words(i, 3)}] if i % 3 == 0 else []
    for turn in range(1 + i % 3):
        messages += [{"role": "user", "content": words(i + turn, 2 + i % 4)},
                     {"role": "assistant", "content": words(i + 2 * turn + 1, 1 + (i + turn) % 5)}]
    return messages


CHATS = [{"messages": chat(i)} for i in range(24)]
SEQ_LEN = 128  # every chat fits whole


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer directories of one byte-level BPE: with the {% generation %} template,
    with the same template without those marks, and with no template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {}
    for name, template in (("generation", GENERATION_TEMPLATE), ("plain", PLAIN_TEMPLATE), ("none", None)):
        hf = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>")
        if template is not None:
            hf.chat_template = template
        hf.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def hf_tokenizer(path: Path) -> HFTokenizer:
    return load_tokenizer(None, str(path))


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def train(data, tokenizer, out, *extra) -> tuple[int, str, str]:
    return cli("train", "--model", "tiny-llama", "--tokenizer", tokenizer, "--data", data, "--seq-len", str(SEQ_LEN),
               "--steps", "2", "--eval-samples", "2", "--no-progress", "--out", out, *extra)


def segments(windows: TokenWindows, pad_id: int) -> list[tuple[list[int], list[bool]]]:
    """Each packed document (or piece of one) of every window: its ids and which carry a
    label; the padding at a window's end left out."""
    found = []
    for row in range(len(windows.windows)):
        ids, positions, labelled = windows.windows[row], windows.positions[row], windows.labelled[row]
        end = len(ids)
        while ids[end - 1] == pad_id:
            end -= 1
        assert not labelled[end:].any()
        starts = (positions[:end] == 0).nonzero().flatten().tolist() + [end]
        for a, b in zip(starts, starts[1:]):
            found.append((ids[a:b].tolist(), labelled[a:b].tolist()))
    return found


def expected_by_template(tokenizer_dir: Path, records: list[dict]) -> dict[tuple, list[bool]]:
    """Per chat, its ids and the tokenizer's own assistant mask (first token unlabelled, as packed)."""
    hf = hf_tokenizer(tokenizer_dir).hf
    expected = {}
    for r in records:
        out = hf.apply_chat_template(r["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        expected[tuple(out["input_ids"])] = [False] + [bool(m) for m in out["assistant_masks"][1:]]
    return expected


def check_labels_are_assistant_tokens(windows: TokenWindows, expected: dict[tuple, list[bool]]) -> None:
    """Every chat lies whole in one window, labelled exactly on its assistant tokens; the
    rest of a window is padding without labels."""
    docs = segments(windows, pad_id=0)
    assert sorted(tuple(ids) for ids, _ in docs) == sorted(expected)
    for ids, labelled in docs:
        assert labelled == expected[tuple(ids)]
    assert windows.labelled.sum() == sum(sum(m) for m in expected.values())


def test_chat_parquet_trains_with_the_loss_on_exactly_the_assistant_tokens(tmp_path, tokenizers):
    data = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(CHATS).to_parquet(str(data))
    code, out, err = train(data, tokenizers["generation"], tmp_path / "run", "--save-every", "1")
    assert code == 0, err
    assert (tmp_path / "run" / "final").is_dir()
    windows = TokenWindows(data, hf_tokenizer(tokenizers["generation"]), SEQ_LEN)
    assert windows.packing == "best-fit"
    check_labels_are_assistant_tokens(windows, expected_by_template(tokenizers["generation"], CHATS))
    # The loss setting is part of the run: a resume that changes it is refused; one that keeps it continues.
    code, _, err = train(data, tokenizers["generation"], tmp_path / "run", "--steps", "3", "--resume", "--loss-on", "all")
    assert code == 2 and "loss_on='assistant'" in err and err.count("\n") == 1
    code, _, err = train(data, tokenizers["generation"], tmp_path / "run", "--steps", "3", "--resume")
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


def test_a_saved_dataset_trains_and_a_template_without_marks_finds_the_same_tokens(tmp_path, tokenizers):
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(CHATS)}).save_to_disk(str(saved))
    code, _, err = train(saved, tokenizers["plain"], tmp_path / "run")
    assert code == 0, err
    # The spans found on prefixes of each conversation are the tokens the {% generation %} marks give.
    windows = TokenWindows(saved, hf_tokenizer(tokenizers["plain"]), SEQ_LEN)
    check_labels_are_assistant_tokens(windows, expected_by_template(tokenizers["generation"], CHATS))


@pytest.mark.parametrize("messages", [
    chat(0), chat(4), chat(5),
    [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "how are you"},
     {"role": "assistant", "content": "the quick brown fox"}],  # the assistant speaks first
    [{"role": "user", "content": "what is two and three"}, {"role": "assistant", "content": ""}],  # an empty reply
], ids=["system", "one-exchange", "three-exchanges", "assistant-first", "empty-reply"])
def test_assistant_spans_match_the_tokenizers_own_mask(tokenizers, messages):
    template = ChatTemplate(hf_tokenizer(tokenizers["generation"]), Record({}, "a test record"))
    by_template = assistant_tokens_by_template(template, messages)
    assert assistant_tokens_by_spans(template, messages) == by_template
    hf = template.hf
    replies = "".join(m["content"] + "<|end|>" for m in messages if m["role"] == "assistant")
    assert hf.decode([i for i, m in zip(*by_template) if m]) == replies


def test_a_template_that_rewrites_earlier_turns_is_refused_rather_than_guessed(tokenizers):
    tokenizer = hf_tokenizer(tokenizers["plain"])
    tokenizer.hf.chat_template = PLAIN_TEMPLATE + "{% if not add_generation_prompt %}</s>{% endif %}"  # after the last turn only
    record = Record(CHATS[1], "record 7 of chats.parquet")
    with pytest.raises(LongtrainError, match="record 7 of chats.parquet.*--loss-on all"):
        tokenize_record(record, tokenizer)
    assert tokenize_record(record, tokenizer, "all").labelled is None
    assert tokenize_record(Record(CHATS[0], "r"), tokenizer).labelled  # one exchange: its prefix is the whole


def test_prompt_completion_labels_are_exactly_the_completion_tokens(tmp_path, tokenizers):
    tokenizer = hf_tokenizer(tokenizers["generation"])
    hf = tokenizer.hf
    strings = Record({"prompt": "what is two and three", "completion": " five"}, "record 1")
    doc = tokenize_record(strings, tokenizer)
    assert hf.decode([i for i, m in zip(doc.ids, doc.labelled) if m]) == " five</s>"
    assert hf.decode(doc.ids) == "what is two and three five</s>"
    prompt = [{"role": "system", "content": "the fox"}, {"role": "user", "content": "what is two and three"}]
    completion = [{"role": "assistant", "content": "five it is"}]
    doc = tokenize_record(Record({"prompt": prompt, "completion": completion}, "record 2"), tokenizer)
    assert hf.decode([i for i, m in zip(doc.ids, doc.labelled) if m]) == "five it is<|end|>"
    assert doc.ids == hf.apply_chat_template(prompt + completion, tokenize=True, return_dict=False)
    assert tokenize_record(Record({"prompt": prompt, "completion": completion}, "r"), tokenizer, "all").labelled is None
    # The byte tokenizer takes string prompt/completion records (no template needed).
    byte = tokenize_record(strings, ByteTokenizer())
    assert bytes(i for i, m in zip(byte.ids, byte.labelled) if m and i < 256) == b" five" and byte.labelled[-1]


def test_best_fit_keeps_every_document_that_fits_whole_and_restarts_positions(tmp_path):
    lengths = [6, 10, 4, 16, 15, 9, 7, 1, 12]
    bins = best_fit(lengths, 16)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 16 for b in bins)
    assert len(bins) == 5 == sum(lengths) // 16  # as few windows as the tokens need (80 tokens: 5 full windows)
    assert best_fit(lengths, 16) == bins  # a function of the lengths

    sizes = [5, 9, 3, 40, 11, 2, 14, 7]  # bytes; each document is its bytes and EOS
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": chr(97 + k) * n}) + "\n" for k, n in enumerate(sizes)))
    windows = TokenWindows(data, ByteTokenizer(), 16, packing="best-fit", seed=3)
    found = [ids for ids, _ in segments(windows, ByteTokenizer.PAD)]
    whole = [[97 + k] * n + [ByteTokenizer.EOS] for k, n in enumerate(sizes)]
    for k, doc in enumerate(whole):
        if len(doc) <= 16:
            assert found.count(doc) == 1  # whole, in one window
    long = whole[3]
    assert [f for f in found if f[0] == long[0]] == [long[0:16], long[16:32], long[32:]]  # split into windows
    for row in range(len(windows.windows)):
        positions, labelled = windows.positions[row], windows.labelled[row]
        assert positions[0] == 0 and ((positions[1:] == positions[:-1] + 1) | (positions[1:] == 0)).all()
        assert not labelled[positions == 0].any()
        pad = windows.windows[row] == ByteTokenizer.PAD
        assert not labelled[pad].any() and labelled[~pad & (positions != 0)].all()
    # A sample is a function of (seed, index); held-out windows are never trained on.
    again = TokenWindows(data, ByteTokenizer(), 16, packing="best-fit", seed=3)
    assert all(torch.equal(windows.sample(i)["labels"], again.sample(i)["labels"]) for i in range(12))


def reference_documents_layout(texts: list[str], tokenizer, seq_len: int) -> tuple[torch.Tensor, ...]:
    """The ``documents`` layout written out as its own algorithm (the one runs checkpointed with
    it trained on): texts joined (each + EOS) and cut into windows, the tail dropped; positions
    restart at each document's start and each window's, whose token gets label -100."""
    ids, starts = [], []
    for text in texts:
        starts.append(len(ids))
        ids.extend(tokenizer.encode(text) + [tokenizer.eos_token_id])
    n = len(ids) // seq_len
    windows = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    first = torch.zeros(n * seq_len, dtype=torch.bool)
    first[[s for s in starts if s < n * seq_len]] = True
    first = first.view(n, seq_len)
    first[:, 0] = True
    index = torch.arange(seq_len).expand(n, -1)
    positions = index - torch.cummax(torch.where(first, index, 0), dim=1).values
    return windows, windows.masked_fill(first, -100), positions


def test_documents_packing_is_the_joined_and_cut_layout(tmp_path):
    # By hand: "ab", "cde", "f", each + EOS, in windows of 4; the tail (none here) dropped.
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("ab", "cde", "f")))
    windows = TokenWindows(data, ByteTokenizer(), 4, packing="documents")
    a, b, c, d, e, f, eos = *b"abcdef", ByteTokenizer.EOS
    assert windows.windows.tolist() == [[a, b, eos, c], [d, e, eos, f]]
    assert [windows.window(row)["labels"].tolist() for row in range(2)] == [[-100, b, eos, -100], [-100, e, eos, -100]]
    assert windows.positions.tolist() == [[0, 1, 2, 0], [0, 1, 2, 0]]


@pytest.mark.parametrize("tokenizer_name", ["bytes", "generation"])
def test_documents_packing_is_bit_identical_to_its_reference(tmp_path, tokenizers, tokenizer_name):
    """Windows, labels and position ids of every sample, held-out ones included, as the
    reference computes them: a run resumed with ``--packing documents`` sees what it saw."""
    tokenizer = ByteTokenizer() if tokenizer_name == "bytes" else hf_tokenizer(tokenizers["generation"])
    book = "\n".join(words(k, 5 + k % 11) for k in range(120)) + "\nthe end é\n"
    records = [words(k, 1 + (3 * k) % 17) for k in range(60)]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text(book, encoding="utf-8")
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    for data, texts in ((folder / "a.txt", [book]), (folder, [book] + records)):
        for seq_len in (16, 37):
            windows = TokenWindows(data, tokenizer, seq_len, seed=5, packing="documents", held_out=4)
            ids, labels, positions = reference_documents_layout(texts, tokenizer, seq_len)
            held = len(windows.held_rows)
            assert held == min(4, len(ids) // 10) > 0 and torch.equal(windows.windows, ids)
            samples = [windows.sample(i) for i in range(2 * len(windows))] + [windows.held_out_sample(i) for i in range(held)]
            rows = [int(windows.train_rows[o]) for epoch in range(2) for o in torch.randperm(
                len(windows), generator=torch.Generator().manual_seed(5 * 1_000_003 + epoch))] + windows.held_rows.tolist()
            for sample, row in zip(samples, rows, strict=True):
                assert sample.keys() == {"input_ids", "labels", "position_ids"}
                for key, expected in (("input_ids", ids[row]), ("labels", labels[row]), ("position_ids", positions[row])):
                    assert sample[key].dtype == expected.dtype and torch.equal(sample[key], expected), (data, seq_len, row, key)


def test_documents_packing_of_records_keeps_their_per_token_labels(tmp_path):
    records = [{"prompt": "q" * (1 + k % 5), "completion": "a" * (1 + k % 3)} for k in range(20)]
    records[7]["prompt"] = "p" * 40  # a prompt across whole windows: those have nothing to learn
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    seq_len = 8
    docs = [tokenize_record(Record(r, "r"), ByteTokenizer()) for r in records]
    ids = [i for doc in docs for i in doc.ids]
    per_token = [flag for doc in docs for flag in doc.labelled]
    starts = {sum(len(doc.ids) for doc in docs[:k]) for k in range(len(docs))}
    expected = []  # (ids, labelled, positions) of each window holding a token to learn
    for w in range(len(ids) // seq_len):
        span = range(w * seq_len, (w + 1) * seq_len)
        restart = [t in starts or t == span[0] for t in span]
        positions, at = [], 0
        for t, r in zip(span, restart):
            at = 0 if r else at + 1
            positions.append(at)
        labelled = [per_token[t] and not r for t, r in zip(span, restart)]
        if any(labelled):
            expected.append(([ids[t] for t in span], labelled, positions))
    assert len(expected) < len(ids) // seq_len
    windows = TokenWindows(data, ByteTokenizer(), seq_len, packing="documents")
    assert windows.packing == "documents"
    assert [(windows.windows[r].tolist(), windows.labelled[r].tolist(), windows.positions[r].tolist())
            for r in range(len(windows.windows))] == expected
    assert TokenWindows(data, ByteTokenizer(), seq_len).packing == "best-fit"
    with pytest.raises(LongtrainError, match="--packing best-fit"):
        TokenWindows(data, ByteTokenizer(), seq_len, packing="concat")


def test_every_format_and_directories_read_the_same_records(tmp_path, tokenizers):
    tokenizer = hf_tokenizer(tokenizers["generation"])
    records = [{"prompt": words(i, 4), "completion": " " + words(i + 1, 2)} for i in range(30)]
    dataset = datasets.Dataset.from_list(records)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "b.json").write_text(json.dumps(records))
    dataset.to_csv(str(tmp_path / "c.csv"), index=False)
    dataset.to_parquet(str(tmp_path / "d.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    reference = TokenWindows(tmp_path / "a.jsonl", tokenizer, 32)
    for name in ("b.json", "c.csv", "d.parquet", arrow, "saved"):
        windows = TokenWindows(tmp_path / name, tokenizer, 32)
        assert torch.equal(windows.windows, reference.windows) and torch.equal(windows.labelled, reference.labelled), name
    # A directory: its files in sorted order, a save_to_disk folder in it read once.
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.jsonl").write_text((tmp_path / "a.jsonl").read_text())
    dataset.save_to_disk(str(folder / "sub" / "saved"))
    (folder / "notes.txt").write_text("the quick brown fox")
    whole = TokenWindows(folder, tokenizer, 32, packing="best-fit")
    assert whole.labelled.sum() == 2 * reference.labelled.sum() + len(tokenizer.encode("the quick brown fox"))


BAD = [  # (file name, content, what the one line says)
    ("missing.jsonl", '{"text": "hello"}\n{"body": "hello"}\n', "line 2 of"),
    ("type.jsonl", '{"text": 5}\n', "line 1 of"),
    ("missing.json", json.dumps([{"text": "hello"}, {"body": "hello"}]), "record 2 of"),
    ("content.jsonl", json.dumps(CHATS[0]) + "\n" + json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n",
     "line 2 of"),
    ("mixed.jsonl", '{"prompt": "hi", "completion": [{"role": "assistant", "content": "yo"}]}\n', "must both be strings"),
    ("half.csv", "prompt,completion\nhello,there\nhow,\n", "record 2 of"),
    ("no-assistant.jsonl", json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n", "--loss-on all"),
    ("empty.parquet", b"", "holds no records"),
    ("empty.jsonl", "\n", "holds no records"),
    ("garbage.parquet", b"PAR1 not really parquet", "cannot read data file"),
]


@pytest.mark.parametrize("name,content,says", BAD, ids=[b[0] for b in BAD])
def test_a_bad_record_is_one_line_naming_it_and_writes_nothing(tmp_path, tokenizers, name, content, says):
    data = tmp_path / name
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    lines: list[logging.LogRecord] = []  # what datasets' readers would log beside our one line
    logged = logging.Handler()
    logged.emit = lines.append
    logging.getLogger("datasets").addHandler(logged)
    try:
        code, _, err = train(data, tokenizers["generation"], tmp_path / "run")
    finally:
        logging.getLogger("datasets").removeHandler(logged)
    assert code == 2 and says in err and str(data) in err and err.count("\n") == 1 and not lines, (err, lines)
    assert not (tmp_path / "run").exists()


def test_chats_need_a_chat_template_and_keep_their_boundaries(tmp_path, tokenizers):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHATS[:3]))
    for tokenizer, says in ((tokenizers["none"], "has no chat template"), ("bytes", "the byte tokenizer has no chat template")):
        code, _, err = train(data, tokenizer, tmp_path / "run")
        assert code == 2 and says in err and f"line 1 of {data}" in err and err.count("\n") == 1, err
    code, _, err = train(data, tokenizers["generation"], tmp_path / "run", "--packing", "concat")
    assert code == 2 and "--packing best-fit" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
    with pytest.raises(LongtrainError, match="message 1 of 'prompt'"):
        tokenize_record(Record({"prompt": [{"role": "user"}], "completion": []}, "r"), hf_tokenizer(tokenizers["generation"]))


def test_text_training_does_not_import_datasets(tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text("the quick brown fox " * 20)
    code = ("import sys; from longtrain.train.data import TokenWindows; from longtrain.train.tokenizer import ByteTokenizer; "
            f"w = TokenWindows({str(data)!r}, ByteTokenizer(), 64); assert w.packing == 'concat' and w.positions is None; "
            "assert 'datasets' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_records_longer_than_a_window_are_said_to_be_split(tmp_path, tokenizers):
    """A chat longer than --seq-len is split into windows (data.md); the run says how many."""
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in CHATS) + "\n")
    code, out, err = train(data, tokenizers["generation"], tmp_path / "run", "--seq-len", "32")
    assert code == 0, err
    assert "chat or prompt/completion records of" in out and "are longer than --seq-len 32: split into windows" in out
    code, out, err = train(data, tokenizers["generation"], tmp_path / "whole")  # SEQ_LEN: every chat fits whole
    assert code == 0 and "longer than --seq-len" not in out, err


def test_a_byte_order_mark_is_not_read_as_text(tmp_path):
    from longtrain.train.records import read_records

    data = tmp_path / "bom.jsonl"
    data.write_bytes("\ufeff".encode() + b'{"text": "hello"}\n{"text": "world"}\n')
    assert [r.value for r in read_records(data)] == [{"text": "hello"}, {"text": "world"}]
