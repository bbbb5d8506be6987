"""Parse and print sizes: bytes ("80GiB") and token counts ("64K"); the machine's memory."""

from __future__ import annotations

import os
import re

from ..errors import LongtrainError

__all__ = ["format_bytes", "gib", "parse_bytes", "parse_tokens", "physical_memory", "pinned_host_budget"]

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# Token counts use binary multiples, as the field does ("64K" context = 65,536 tokens).
_TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _split(text: str) -> tuple[float, str] | None:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    return (float(match.group(1)), match.group(2).lower()) if match else None


def parse_bytes(text: str | int) -> int:
    """``"80GiB"`` -> 85899345920; plain integers are bytes."""
    if isinstance(text, int):
        return text
    parts = _split(text)
    if parts is None or parts[1] not in _BYTE_UNITS:
        raise LongtrainError(f"cannot read size {text!r}; write it like 80GiB, 512MiB or 96GB")
    return int(parts[0] * _BYTE_UNITS[parts[1]])


def parse_tokens(text: str | int) -> int:
    """``"64K"`` -> 65536, ``"1M"`` -> 1048576, ``"8192"`` -> 8192 (``G`` and ``T``: 2**30, 2**40)."""
    if isinstance(text, int):
        return text
    parts = _split(text)
    if parts is None or parts[1] not in _TOKEN_UNITS or not float(parts[0] * _TOKEN_UNITS[parts[1]]).is_integer():
        raise LongtrainError(f"cannot read token count {text!r}; write it like 8192, 64K or 1M")
    return int(parts[0] * _TOKEN_UNITS[parts[1]])


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def gib(n: float) -> float:
    return n / 2**30


def physical_memory() -> int:
    """Bytes of physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pinned_host_budget() -> int:
    """The default budget for activations kept in pinned host memory: half the physical
    memory, shared by the processes ``torchrun`` starts on this machine (its
    ``LOCAL_WORLD_SIZE``). Pinned pages cannot be swapped out, and the processes (their
    pools' other buffers, the data loaders) and the OS need the rest: a larger share ends
    in the kernel's out-of-memory killer (docs/memo.md, docs/speed.md)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return physical_memory() // 2 // (int(local) if local.isdigit() and int(local) > 0 else 1)
