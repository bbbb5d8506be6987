"""Typed checks for option dataclasses: one clear line naming the option and what it takes.

Options arrive from Python, YAML files and command-line items (``seco:chunk=4096``).
Text is parsed by the type the option declares (:func:`coerce`), so ``offload=no`` is
false and ``offload=maybe`` an error rather than a truthy string; a mistyped Python
value is refused here rather than be taken as truthy or fail deep inside a step.
"""

from __future__ import annotations

import math
import types
import typing

from .errors import LongtrainError

__all__ = ["byte_size", "coerce", "finite_number", "flag", "positive_int"]

# The spellings a boolean option accepts, in any case; nothing else is read as one.
_TRUE = ("true", "yes", "1")
_FALSE = ("false", "no", "0")
_NONE = ("none", "null")


def flag(owner: str, name: str, value) -> None:
    """``value`` must be a bool (text is turned into one by :func:`coerce` first)."""
    if not isinstance(value, bool):
        raise LongtrainError(f"{owner} option {name} must be true or false, got {value!r}")


def positive_int(owner: str, name: str, value, *, allow_none: bool = False, minimum: int = 1,
                 maximum: int | None = None) -> None:
    """``value`` must be an integer ≥ ``minimum`` (and ≤ ``maximum``; or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        what += f" and at most {maximum}" if maximum is not None else ""
        raise LongtrainError(f"{owner} {name} must be {what}, got {value!r}")


def finite_number(owner: str, name: str, value, *, minimum: float | None = None) -> None:
    """``value`` must be a finite int or float (no NaN, no infinity), ≥ ``minimum`` where given."""
    ok = not isinstance(value, bool) and (isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)))
    if not ok or (minimum is not None and value < minimum):
        bound = f" of at least {minimum:g}" if minimum is not None else ""
        raise LongtrainError(f"{owner} {name} must be a number{bound}, got {value!r}")


def byte_size(owner: str, name: str, value) -> int:
    """``value`` (``"120GiB"`` or a byte count) as a positive number of bytes."""
    from .memory.units import parse_bytes

    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise LongtrainError(f"{owner} {name} must be a size such as 120GiB or a byte count, got {value!r}")
    try:
        size = parse_bytes(value)
    except LongtrainError as error:
        raise LongtrainError(f"{owner} {name}: {error}") from None
    if size <= 0:
        raise LongtrainError(f"{owner} {name} must be a positive size such as 120GiB, got {value!r}")
    return size


def to_flag(owner: str, name: str, value) -> bool:
    """A bool from ``value``: a bool, 0/1, or true/false/yes/no/1/0 in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise LongtrainError(f"{owner} option {name} must be true or false (yes/no, 1/0), got {value!r}")


def _kinds(hint) -> tuple:
    """The plain types a (possibly optional or union) annotation allows."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _from_text(owner: str, name: str, text: str, kinds: tuple):
    """``text`` read as the first of ``kinds`` that takes it (None, bool, int, float);
    text no kind takes stays text, for the options' own check to refuse by name."""
    word = text.strip()
    if type(None) in kinds and word.lower() in _NONE:
        return None
    if bool in kinds:
        if not set(kinds) - {bool, type(None)}:
            return to_flag(owner, name, word)
        # An option that takes a count or a word too (fpdt keep_output): true/false/yes/no are
        # the flag, digits the count, anything else the word.
        if word.lower() in _TRUE + _FALSE and not (int in kinds and word.isdigit()):
            return word.lower() in _TRUE
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(word)
            except ValueError:
                pass
    return text


def coerce(owner: str, options_cls: type, values: dict) -> dict:
    """``values`` (from a command-line item or a YAML/JSON file) with each text value
    read by the type its field in ``options_cls`` declares, and 0/1 given to a boolean
    field read as false/true. Values of other types pass through for the options'
    own checks; unknown names are the caller's to refuse."""
    hints = typing.get_type_hints(options_cls)
    out = {}
    for key, value in values.items():
        hint = hints.get(key)
        if hint is None:
            out[key] = value
            continue
        kinds = _kinds(hint)
        if isinstance(value, str):
            out[key] = _from_text(owner, key, value, kinds)
        elif bool in kinds and not isinstance(value, bool) and value is not None and not (int in kinds and isinstance(value, int)):
            out[key] = to_flag(owner, key, value)
        else:
            out[key] = value
    return out
