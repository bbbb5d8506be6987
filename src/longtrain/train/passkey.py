"""The built-in long-range task: find a pass key hidden thousands of tokens back.

Each sample is filler text — Python standard-library sources, which every machine
with Python has offline — with one "needle" sentence stating a random pass key placed
at a random point at least ``min_distance`` tokens before the end, and a question at
the end whose answer is the key. A model can only predict the answer by attending
back to the needle. Samples are a pure function of (seed, index).
"""

from __future__ import annotations

import random
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch

from ..engines.batch import IGNORE_INDEX

KEY_DIGITS = 5
NEEDLE = "\n# The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n# What is the pass key? The pass key is "


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
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 100_000:  # a stripped Python without sources: fall back to synthetic prose
        rng = random.Random(0)
        words = "the of and to in is was for on that with as by at from this be are it an or".split()
        text = " ".join(rng.choice(words) for _ in range(400_000)).encode()
    return text


class PasskeyTask:
    """Pass-key retrieval at ``seq_len`` tokens (byte-level: one token per byte).

    ``loss_on="task"`` puts the loss on the needle and the question/answer only, which
    is what the task trains; ``"all"`` adds language modelling of the filler.
    """

    def __init__(self, tokenizer, seq_len: int, seed: int = 0, loss_on: str = "task"):
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.loss_on = loss_on
        self.min_distance = min(2048, seq_len // 4)
        self.filler = filler_text()

    def _layout(self, rng: random.Random):
        key = "".join(rng.choice("0123456789") for _ in range(KEY_DIGITS))
        enc = self.tokenizer.encode
        needle = enc(NEEDLE.format(key=key))
        question, answer = enc(QUESTION), enc(key)
        n_fill = self.seq_len - len(needle) - len(question) - len(answer)
        if n_fill < self.min_distance:
            raise ValueError(f"seq_len {self.seq_len} is too short for the pass-key task")
        start = rng.randrange(0, len(self.filler) - 4 * n_fill)
        fill = enc(self.filler[start : start + 4 * n_fill].decode("utf-8", errors="ignore"))[:n_fill]
        at = rng.randrange(0, n_fill - self.min_distance + 1)
        ids = fill[:at] + needle + fill[at:] + question + answer
        return ids, at, len(needle), len(answer)

    def sample(self, index: int, split: str = "train") -> dict:
        rng = random.Random(f"passkey:{split}:{self.seed}:{index}")
        ids, at, needle_len, answer_len = self._layout(rng)
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = input_ids.clone()
        answer_mask = torch.zeros(len(ids), dtype=torch.bool)
        answer_mask[-answer_len:] = True
        if self.loss_on == "task":
            keep = torch.zeros(len(ids), dtype=torch.bool)
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
