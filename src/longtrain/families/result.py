"""One family's verdict, and the one-line forms its cells take."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import LongtrainError
from .cases import FD_TOLERANCE

__all__ = ["FamilyResult"]

@dataclass
class FamilyResult:
    """One family's verdict: ``status`` is ``exact``, ``refused``, ``inexact`` or ``not built``;
    ``cells`` maps ``strategy`` to its worst relative error over the batches, or to the
    line it was refused with."""

    family: str
    status: str
    adapter: str | None = None  # the adapter that ran it (None: none registered, tried with the Llama layout)
    reason: str | None = None
    cells: dict = field(default_factory=dict)
    seconds: float = 0.0
    # strategy -> relative error of the gradient against a central difference of the reported
    # loss with every dropout on (or the line the pass failed with)
    dropout: dict = field(default_factory=dict)
    # what a dropout cell may be: FD_TOLERANCE, or ten times backprop's own (which recomputes
    # nothing) where the model's gradient is not quite its loss's derivative (BitNet's
    # quantized weights train through a straight-through estimator)
    dropout_tolerance: float = FD_TOLERANCE

def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:300] if not isinstance(error, LongtrainError) else text[:300]

def _is_refusal(cell: str) -> bool:
    return ":" not in cell.split(" ", 1)[0]  # a LongtrainError's line, not "batch: Exception: ..."

def _finish(result: FamilyResult, status: str, reason: str | None, started: float) -> FamilyResult:
    result.status, result.reason, result.seconds = status, reason, round(time.perf_counter() - started, 2)
    return result
