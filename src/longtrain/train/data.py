"""Training data from local files, packed into windows of ``seq_len`` tokens.

``--data`` names text files, record files (``.jsonl``, ``.json``, ``.parquet``,
``.arrow``, ``.csv``), directories of them or a ``save_to_disk`` folder (records.py);
each record becomes a token document with the tokens that carry the loss
(documents.py); here documents are packed into windows:

- ``concat``: documents joined with EOS and cut into windows, attending across documents
  (text only: the boundaries of chat and prompt/completion records must hold);
- ``documents``: documents joined as they come and cut into windows, as ``concat``; position
  ids restart at each document's start and at each window's, so attention stays inside a
  document and rotary positions count from its start, and that first token gets no label;
- ``best-fit``: best-fit decreasing packing; position ids restart at each document, and its
  first token gets no label. A document longer than a window is split into windows; every
  other one lies whole in one window. The rest of a window is padding (no labels).

``auto`` is ``best-fit`` for data with chat or prompt/completion records, else ``concat``.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import torch

from ..errors import LongtrainError
from .documents import ASSISTANT, Document, tokenize_record
from .records import data_sources, read_records

__all__ = ["TokenWindows", "best_fit", "collate"]

PACKINGS = ("auto", "concat", "documents", "best-fit")


def read_documents(path: Path, tokenizer, loss_on: str = ASSISTANT) -> list[Document]:
    """Every document under ``path``, in the sources' order and each source's record order."""
    return [tokenize_record(record, tokenizer, loss_on) for source in data_sources(path) for record in read_records(source)]


def _check_not_unknown(documents: list[Document], tokenizer, path) -> None:
    """Refuse data the tokenizer cannot read: mostly its unknown token means the wrong
    tokenizer (or a model without one), and training on it would learn nothing."""
    unk = getattr(tokenizer, "unk_token_id", None)
    total = sum(len(d.ids) for d in documents)
    if unk is None or not total:
        return
    share = sum(d.ids.count(unk) for d in documents) / total
    if share > 0.5:
        raise LongtrainError(f"the tokenizer turns {share:.0%} of the data in {path} into its unknown token; "
                             "use the model's own tokenizer (or --tokenizer bytes) for this text")


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, by best-fit decreasing: the longest item first, each into the
    fullest bin with room for it (a new bin when none has). Every length is at most
    ``capacity``; ties go in index order, so the result is a function of ``lengths``."""
    bins: list[list[int]] = []
    rooms: list[int] = []  # the distinct free rooms of open bins, sorted
    by_room: dict[int, list[int]] = {}  # free room -> the bins with it
    for item in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(rooms, lengths[item])
        if at == len(rooms):
            b, room = len(bins), capacity
            bins.append([])
        else:
            room = rooms[at]
            b = by_room[room].pop(0)
            if not by_room[room]:
                del by_room[room], rooms[at]
        bins[b].append(item)
        room -= lengths[item]
        if room > 0:
            if room not in by_room:
                bisect.insort(rooms, room)
                by_room[room] = []
            by_room[room].append(b)
    return bins


def _pieces(documents: list[Document], seq_len: int) -> list[tuple[int, int, int]]:
    """(document, start, end) pieces of at most ``seq_len`` tokens: a document that fits
    is one piece; a longer one is cut into full windows and its remainder."""
    return [(d, start, min(start + seq_len, len(doc.ids)))
            for d, doc in enumerate(documents) for start in range(0, len(doc.ids), seq_len)]


def pack_documents(documents: list[Document], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-fit windows of whole documents: token ids, labelled (bool: the token carries the
    loss) and position ids, each (windows, seq_len). Positions restart at each piece and
    continue through the padding at the end; a piece's first token and padding carry no
    loss; windows with no token to learn are left out."""
    pieces = _pieces(documents, seq_len)
    bins = best_fit([end - start for _, start, end in pieces], seq_len)
    ids = torch.full((len(bins), seq_len), pad_id, dtype=torch.long)
    labelled = torch.zeros((len(bins), seq_len), dtype=torch.bool)
    positions = torch.zeros((len(bins), seq_len), dtype=torch.int32)
    for row, members in enumerate(bins):
        at = 0
        for d, start, end in (pieces[i] for i in sorted(members)):  # documents in data order within a window
            doc, n = documents[d], end - start
            ids[row, at:at + n] = torch.tensor(doc.ids[start:end])
            labelled[row, at:at + n] = True if doc.labelled is None else torch.tensor(doc.labelled[start:end])
            labelled[row, at] = False  # nothing before it in its window's document predicts it
            positions[row, at:at + n] = torch.arange(n, dtype=torch.int32)
            at += n
        after = int(positions[row, at - 1]) + 1
        positions[row, at:] = torch.arange(after, after + seq_len - at, dtype=torch.int32)
    keep = labelled.any(dim=1)
    return ids[keep], labelled[keep], positions[keep]


def concat_documents(documents: list[Document], seq_len: int, path) -> torch.Tensor:
    """Documents joined and cut into (windows, seq_len) token ids; the tail shorter than a
    window is dropped."""
    ids = [token for doc in documents for token in doc.ids]
    if len(ids) < seq_len:
        raise LongtrainError(f"the data in {path} holds {len(ids):,} tokens, fewer than --seq-len {seq_len:,}; "
                             "add data or lower --seq-len")
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def cut_documents(documents: list[Document], seq_len: int, path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Documents joined as they come and cut into windows, as :func:`concat_documents`:
    token ids, labelled (bool) and position ids, each (windows, seq_len). Positions restart
    at each document's start and at each window's, and that first token carries no loss
    (nothing before it in its window's document predicts it), nor does one its record keeps
    out of the loss. Where records set the loss per token, windows with no token to learn
    are left out; text keeps every window."""
    ids = concat_documents(documents, seq_len, path)
    n = len(ids)
    lengths = torch.tensor([len(doc.ids) for doc in documents], dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths
    first = torch.zeros(n * seq_len, dtype=torch.bool)
    first[starts[starts < n * seq_len]] = True
    first = first.view(n, seq_len)
    first[:, 0] = True
    index = torch.arange(seq_len).expand(n, -1)
    # position = distance to the latest document (or window) start at or before each token
    positions = (index - torch.cummax(torch.where(first, index, 0), dim=1).values).to(torch.int32)
    labelled = ~first
    if all(doc.labelled is None for doc in documents):
        return ids, labelled, positions
    per_token = [flag for doc in documents for flag in (doc.labelled if doc.labelled is not None else [True] * len(doc.ids))]
    labelled &= torch.tensor(per_token[: n * seq_len], dtype=torch.bool).view(n, seq_len)
    keep = labelled.any(dim=1)
    return ids[keep], labelled[keep], positions[keep]


def _packing(packing: str, documents: list[Document], path) -> str:
    """``packing`` settled for these documents: ``auto`` chosen by the records, and
    ``concat`` refused where records' boundaries must hold."""
    structured = any(d.structured for d in documents)
    if packing == "auto":
        return "best-fit" if structured else "concat"
    if packing == "concat" and structured:
        raise LongtrainError(f"--packing concat attends across documents, but {path} holds chat or prompt/completion "
                             "records, each of which must stay a sequence of its own; pass --packing best-fit "
                             "(or drop --packing)")
    return packing


class TokenWindows:
    """``--data`` as windows of ``seq_len`` tokens (see the module docstring for packing).

    Window order is a seeded permutation per epoch, so a sample is a pure function of
    (seed, index): the data position in a checkpoint is just the number of samples seen.

    ``held_out`` windows (at most a tenth of them, none when there are fewer than ten)
    are set aside, chosen by the seed, for :meth:`held_out_sample`: training never sees them.
    ``loss_on``: ``assistant`` (chat and prompt/completion records: the loss on the
    assistant's or completion's tokens) or ``all`` (every token); text has it on all.
    """

    def __init__(self, path: str | Path, tokenizer, seq_len: int, seed: int = 0, packing: str = "auto", held_out: int = 0,
                 loss_on: str = ASSISTANT):
        if packing not in PACKINGS:
            raise LongtrainError(f"--packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        documents = read_documents(Path(path), tokenizer, loss_on)
        _check_not_unknown(documents, tokenizer, path)
        self.documents = len(documents)
        self.structured = sum(d.structured for d in documents)  # chat and prompt/completion records among them
        # Records longer than a window: split, positions restarting, a later piece without its record's start.
        self.records_split = sum(d.structured and len(d.ids) > seq_len for d in documents)
        self.packing = _packing(packing, documents, path)
        self.labelled = self.positions = None
        if self.packing == "concat":
            self.windows = concat_documents(documents, seq_len, path)
        else:
            if self.packing == "documents":
                self.windows, self.labelled, self.positions = cut_documents(documents, seq_len, path)
            else:
                self.windows, self.labelled, self.positions = pack_documents(documents, seq_len, tokenizer.pad_token_id)
            if len(self.windows) == 0:
                raise LongtrainError(f"no record in {path} has a token to put the loss on (after its first); "
                                     "give the chats assistant content, or pass --loss-on all")
        self.seq_len = seq_len
        self.seed = seed
        self.held_rows, self.train_rows = self._split(len(self.windows), min(held_out, len(self.windows) // 10), seed)

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
        return self.window(int(self.train_rows[order[offset]]))

    def held_out_sample(self, index: int) -> dict:
        """The ``index``-th held-out window (``index < len(self.held_rows)``)."""
        return self.window(int(self.held_rows[index]))

    def window(self, row: int) -> dict:
        """The window in row ``row`` of :attr:`windows` (storage order, not the epoch's)."""
        input_ids = self.windows[row]
        if self.positions is None:
            return {"input_ids": input_ids, "labels": input_ids}
        labels = input_ids.masked_fill(~self.labelled[row], -100)
        return {"input_ids": input_ids, "labels": labels, "position_ids": self.positions[row].long()}


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
