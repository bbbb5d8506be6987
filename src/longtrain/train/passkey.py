"""The built-in long-range task: find a pass key hidden thousands of tokens back.

Each sample is filler text — Python standard-library sources, which every machine
with Python has offline — with a "needle" sentence stating a random pass key, placed
``copies`` times at random points at least ``min_distance`` tokens before the end, and
a question at the end whose answer is the key. A model can only predict the answer by
attending back to a needle. Samples are a pure function of (seed, index).

Why several copies: at 8K tokens a freshly initialized attention head spreads its
weight over thousands of positions, so one needle gets ~1/8000 of the gradient signal
and a tiny model learns nothing in the demo's few hundred steps. Eight copies make the
signal eight times stronger while every copy still lies at least ``min_distance`` tokens
back.

With ``depth`` set, a sample is a needle in a haystack instead: one needle at that
relative depth of the filler (0: the first token, 1: just before the question), the
key and filler of sample ``index`` the same at every depth, so depths differ in where
the needle is and nothing else (``longtrain eval``, train/evaluate.py).
"""

from __future__ import annotations

import random
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch

from ..engines.batch import IGNORE_INDEX
from ..errors import LongtrainError

__all__ = ["NEEDLE", "PasskeyTask", "QUESTION", "TooShortForTask", "filler_text"]

KEY_DIGITS = 5
# The key sits between section signs. The filler is reduced to ASCII, so "§" occurs only
# around keys: an unambiguous anchor for the attention head that has to find them.
NEEDLE = "\n# The pass key is §{key}§. Remember it.\n"
QUESTION = "\n# What is the pass key? The pass key is §"


@lru_cache(maxsize=1)
def filler_text(max_bytes: int = 4_000_000) -> bytes:
    """Python standard-library sources, in a fixed order, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes].decode("ascii", errors="ignore").encode("ascii")  # ASCII only (see NEEDLE)
    if len(text) < 100_000:  # a stripped Python without sources: fall back to synthetic prose
        rng = random.Random(0)
        words = "the of and to in is was for on that with as by at from this be are it an or".split()
        text = " ".join(rng.choice(words) for _ in range(400_000)).encode()
    return text


class TooShortForTask(LongtrainError):
    """A length the pass-key task cannot fill; ``shortest`` is a length it can."""

    def __init__(self, message: str, shortest: int):
        super().__init__(message)
        self.shortest = shortest


class PasskeyTask:
    """Pass-key retrieval at ``seq_len`` tokens (one token per byte with the byte tokenizer;
    a subword tokenizer's tokens otherwise).

    ``loss_on="all"`` trains language modelling of the whole text, answer included;
    ``"task"`` puts the loss on the needles and the question/answer only. ``depth`` (0 to
    1) places one needle at that relative depth of the filler instead of ``copies`` at
    random points.
    """

    def __init__(self, tokenizer, seq_len: int, seed: int = 0, loss_on: str = "all", copies: int | None = None,
                 depth: float | None = None):
        if depth is not None and not 0 <= depth <= 1:
            raise LongtrainError(f"a needle's depth must lie in [0, 1] (0: start of the context, 1: just before the question), got {depth}")
        if depth is not None and copies not in (None, 1):
            raise LongtrainError(f"a needle at a given depth is one needle, got copies={copies}")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.loss_on = loss_on
        self.depth = depth
        self.copies = 1 if depth is not None else copies or max(1, min(8, seq_len // 1024))  # one per 1K tokens, up to 8
        filler_at_least = min(2048, seq_len // 4)  # a quarter of the sample, up to 2,048 tokens, is filler
        self.min_distance = 0 if depth is not None else filler_at_least  # how far back every needle lies
        self.filler = filler_text()
        fixed = self.copies * len(tokenizer.encode(NEEDLE.format(key="0" * KEY_DIGITS))) + len(tokenizer.encode(QUESTION)) + KEY_DIGITS
        if seq_len - fixed < filler_at_least:
            raise TooShortForTask(
                f"--seq-len {seq_len} is too short for the built-in pass-key task (it needs at least {fixed + fixed // 3 + 1} tokens); "
                "use a longer --seq-len or pass --data", shortest=fixed + fixed // 3 + 1,
            )

    def _filler_ids(self, start: int, n: int) -> list[int]:
        """``n`` tokens of filler from byte ``start`` on, wrapping around its end. Four
        bytes per token are read (one token per byte, or a few bytes per token of a
        subword tokenizer), more where that falls short."""
        span = 4 * n
        while span <= 64 * n:
            repeats = (start + span) // len(self.filler) + 1
            ids = self.tokenizer.encode((self.filler * repeats)[start : start + span].decode("ascii"))[:n]
            if len(ids) == n:
                return ids
            span *= 2
        raise LongtrainError(f"the tokenizer makes fewer than {n:,} tokens of {span // 2:,} bytes of filler text; "
                             "use the model's own tokenizer (--tokenizer auto)")

    def _layout(self, rng: random.Random):
        key = "".join(rng.choice("0123456789") for _ in range(KEY_DIGITS))
        enc = self.tokenizer.encode
        needle = enc(NEEDLE.format(key=key))
        question, asked = enc(QUESTION), enc(QUESTION + key)
        # The key's tokens as they follow the question (a subword tokenizer may split a
        # number differently alone), unless the tokenizer merges across the boundary.
        answer = asked[len(question):] if asked[: len(question)] == question else enc(key)
        n_fill = self.seq_len - self.copies * len(needle) - len(question) - len(answer)
        start = rng.randrange(0, max(1, len(self.filler) - 4 * n_fill))
        fill = self._filler_ids(start, n_fill)
        if self.depth is not None:  # no draw: the key and filler are those of this index at every depth
            cuts = [round(self.depth * n_fill)]
        else:
            cuts = sorted(rng.randrange(0, n_fill - self.min_distance + 1) for _ in range(self.copies))
        ids, needle_starts, previous = [], [], 0
        for cut in cuts:
            ids += fill[previous:cut]
            needle_starts.append(len(ids))
            ids += needle
            previous = cut
        ids += fill[previous:] + question + answer
        return ids, needle_starts, len(needle), len(answer)

    def sample(self, index: int, split: str = "train") -> dict:
        rng = random.Random(f"passkey:{split}:{self.seed}:{index}")
        ids, needle_starts, needle_len, answer_len = self._layout(rng)
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = input_ids.clone()
        answer_mask = torch.zeros(len(ids), dtype=torch.bool)
        answer_mask[-answer_len:] = True
        if self.loss_on == "task":
            keep = torch.zeros(len(ids), dtype=torch.bool)
            for at in needle_starts:
                keep[at : at + needle_len] = True
            keep[-(answer_len + len(self.tokenizer.encode(QUESTION))) :] = True
            labels[~keep] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels, "answer_mask": answer_mask}

    @torch.no_grad()
    def evaluate(self, model, n_samples: int = 16, device: str | torch.device = "cpu") -> dict:
        """Teacher-forced accuracy on held-out samples: per answer digit, and whole keys
        (a key is right when greedy decoding would reproduce every digit)."""
        was_training = model.training
        model.eval()
        digits_right = digits = keys_right = 0
        try:
            for index in range(n_samples):
                s = self.sample(index, split="eval")
                ids = s["input_ids"][None].to(device)
                n_answer = int(s["answer_mask"].sum())
                # Only the positions that predict the answer need logits.
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=n_answer + 1).logits[0, :-1]
                right = logits.argmax(-1) == ids[0, -n_answer:]
                digits_right += int(right.sum())
                digits += n_answer
                keys_right += int(right.all())
        finally:
            model.train(was_training)
        return {"digit_accuracy": digits_right / digits, "key_accuracy": keys_right / n_samples, "samples": n_samples}
