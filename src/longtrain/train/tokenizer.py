"""A byte-level tokenizer: ids 0-255 are bytes, then three special tokens.

It needs no files and no downloads, reads any text, and is what presets and the
built-in task train with. Models from a local directory use their own tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import LongtrainError

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class ByteTokenizer:
    PAD, BOS, EOS = 256, 257, 258
    vocab_size = 259
    FILE = "longtrain_tokenizer.json"

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return list(data)

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def pad_token_id(self) -> int:
        return self.PAD

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    def save_pretrained(self, directory: str | Path) -> None:
        Path(directory, self.FILE).write_text(json.dumps({"type": "byte", "vocab_size": self.vocab_size}))

    @classmethod
    def is_saved_in(cls, directory: str | Path) -> bool:
        return Path(directory, cls.FILE).is_file()


class HFTokenizer:
    """Adapter giving a Hugging Face tokenizer the same small interface."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = len(tokenizer)

    @property
    def hf(self):
        """The Hugging Face tokenizer itself: chat templates and character offsets live there."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self._tok.decode(ids)

    @property
    def pad_token_id(self) -> int:
        pad = self._tok.pad_token_id
        return pad if pad is not None else (self._tok.eos_token_id or 0)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def unk_token_id(self) -> int | None:
        return self._tok.unk_token_id

    def save_pretrained(self, directory) -> None:
        self._tok.save_pretrained(directory)


def load_tokenizer(model_dir: str | None, choice: str = "auto"):
    """The tokenizer to train with. ``choice``: ``"bytes"`` (the byte tokenizer), a
    tokenizer directory, or ``"auto"``: a model directory's own tokenizer (the byte
    tokenizer for presets, ``model_dir=None``, and for longtrain's own exports). A model
    directory without a tokenizer is refused rather than silently trained on bytes."""
    if choice == "bytes" or (choice == "auto" and (model_dir is None or ByteTokenizer.is_saved_in(model_dir))):
        return ByteTokenizer()
    source = model_dir if choice == "auto" else choice
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(source, local_files_only=True))
    except (OSError, ValueError, KeyError, TypeError) as exc:  # missing files, or files of an unknown kind
        reason = " ".join(str(exc).split())[:200]
        raise LongtrainError(f"no tokenizer can be loaded from {source} ({reason}); add the model's tokenizer files there, "
                             "pass --tokenizer DIR, or --tokenizer bytes to train on raw bytes") from None
