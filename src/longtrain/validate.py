"""Typed checks for option dataclasses: one clear line naming the option and what it takes.

Options arrive from Python, YAML files and command-line items (``seco:chunk=4096``,
values read as YAML scalars), so a mistyped value must be refused here rather than be
taken as truthy (``offload: "no"``) or fail deep inside a step.
"""

from __future__ import annotations

from .errors import LongtrainError


def flag(owner: str, name: str, value) -> None:
    """``value`` must be a bool (YAML reads true/false/yes/no as one)."""
    if not isinstance(value, bool):
        raise LongtrainError(f"{owner} option {name} must be true or false, got {value!r}")


def positive_int(owner: str, name: str, value, *, allow_none: bool = False, minimum: int = 1) -> None:
    """``value`` must be an integer ≥ ``minimum`` (or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise LongtrainError(f"{owner} {name} must be {what}, got {value!r}")
