"""Training data from local files: text or JSONL, packed into fixed-length windows."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import LongtrainError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}


def _data_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES | JSONL_SUFFIXES)
        if not files:
            raise LongtrainError(f"data directory {path} holds no .txt, .md or .jsonl files")
        return files
    if not path.exists():
        raise LongtrainError(f"data file {path} does not exist; pass a text file, a .jsonl file or a directory of them")
    return [path]


def _read_documents(path: Path) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise LongtrainError(f"cannot read data file {path}: {reason}") from None
    if path.suffix.lower() not in JSONL_SUFFIXES:
        return [raw]
    documents = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise LongtrainError(f"line {number} of {path} is not valid JSON; each line must be an object with a 'text' field") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise LongtrainError(f"line {number} of {path} has no string 'text' field")
        documents.append(text)
    return documents


def _check_not_unknown(ids: list[int], tokenizer, path) -> None:
    """Refuse data the tokenizer cannot read: mostly its unknown token means the wrong
    tokenizer (or a model without one), and training on it would learn nothing."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not ids:
        return
    share = ids.count(unk) / len(ids)
    if share > 0.5:
        raise LongtrainError(f"the tokenizer turns {share:.0%} of the data in {path} into its unknown token; "
                             "use the model's own tokenizer (or --tokenizer bytes) for this text")


class TokenWindows:
    """Documents tokenized, joined with EOS and cut into windows of ``seq_len`` tokens.

    With ``restart_per_document`` each sample also carries ``position_ids`` that restart
    at 0 where a document starts (and at the window's start), so attention stays inside
    each document and rotary positions count from its start; the first token of a
    document gets no label (nothing before it in its document predicts it).

    Window order is a seeded permutation per epoch, so a sample is a pure function of
    (seed, index): the data position in a checkpoint is just the number of samples seen.

    ``held_out`` windows (at most a tenth of them, none when there are fewer than ten)
    are set aside, chosen by the seed, for :meth:`held_out_sample`: training never sees them.
    """

    def __init__(self, path: str | Path, tokenizer, seq_len: int, seed: int = 0, restart_per_document: bool = False,
                 held_out: int = 0):
        ids: list[int] = []
        starts: list[int] = []
        for file in _data_files(Path(path)):
            for doc in _read_documents(file):
                starts.append(len(ids))
                ids.extend(tokenizer.encode(doc))
                if tokenizer.eos_token_id is not None:
                    ids.append(tokenizer.eos_token_id)
        _check_not_unknown(ids, tokenizer, path)
        if len(ids) < seq_len:
            raise LongtrainError(
                f"the data in {path} holds {len(ids):,} tokens, fewer than --seq-len {seq_len:,}; "
                "add data or lower --seq-len"
            )
        n = len(ids) // seq_len
        self.windows = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
        self.positions = None
        if restart_per_document:
            first = torch.zeros(n * seq_len, dtype=torch.bool)
            first[[s for s in starts if s < n * seq_len]] = True
            first = first.view(n, seq_len)
            first[:, 0] = True  # a window starts a sequence of its own
            index = torch.arange(seq_len).expand(n, -1)
            # position = distance to the latest document start at or before each token
            self.positions = index - torch.cummax(torch.where(first, index, 0), dim=1).values
            self.first_of_document = first
        self.seq_len = seq_len
        self.seed = seed
        self.held_rows, self.train_rows = self._split(n, min(held_out, n // 10), seed)

    @staticmethod
    def _split(n: int, held: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows set aside for evaluation (a seeded choice, independent of the epochs'
        order) and the rest; with none set aside, the rows in order, so runs without a
        held-out set see the windows they always did."""
        if held == 0:
            return torch.zeros(0, dtype=torch.long), torch.arange(n)
        chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 - 1))[:held]
        is_held = torch.zeros(n, dtype=torch.bool)
        is_held[chosen] = True
        return is_held.nonzero().flatten(), (~is_held).nonzero().flatten()

    def __len__(self) -> int:
        return len(self.train_rows)

    def sample(self, index: int) -> dict:
        epoch, offset = divmod(index, len(self.train_rows))
        order = torch.randperm(len(self.train_rows), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        return self._window(int(self.train_rows[order[offset]]))

    def held_out_sample(self, index: int) -> dict:
        """The ``index``-th held-out window (``index < len(self.held_rows)``)."""
        return self._window(int(self.held_rows[index]))

    def _window(self, row: int) -> dict:
        input_ids = self.windows[row]
        if self.positions is None:
            return {"input_ids": input_ids, "labels": input_ids}
        labels = input_ids.masked_fill(self.first_of_document[row], -100)
        return {"input_ids": input_ids, "labels": labels, "position_ids": self.positions[row]}


def collate(samples: list[dict], pad_id: int) -> dict:
    """Stack samples into a batch, right-padding to the longest (padding gets no loss;
    position ids, when samples carry them, continue past the end)."""
    length = max(len(s["input_ids"]) for s in samples)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    positions = [] if all("position_ids" in s for s in samples) else None
    for s in samples:
        pad = length - len(s["input_ids"])
        ids = s["input_ids"]
        batch["input_ids"].append(torch.cat([ids, ids.new_full((pad,), pad_id)]))
        batch["attention_mask"].append(torch.cat([torch.ones_like(ids), ids.new_zeros(pad)]))
        batch["labels"].append(torch.cat([s["labels"], ids.new_full((pad,), -100)]))
        if positions is not None:
            last = s["position_ids"][-1:] if len(ids) else ids.new_zeros(1)
            positions.append(torch.cat([s["position_ids"], last + torch.arange(1, pad + 1)]))
    out = {k: torch.stack(v) for k, v in batch.items()}
    if positions is not None:
        out["position_ids"] = torch.stack(positions)
    if all(len(s["input_ids"]) == length for s in samples):
        out.pop("attention_mask")  # no padding: let attention use its causal fast path
    return out
