"""Metrics as JSON lines (one object per step or evaluation), optionally TensorBoard."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import LongtrainError, writing
from .run_checkpoints import write_text_atomic

__all__ = ["MetricsLog", "check_tensorboard", "read_metrics", "strict_json"]


def strict_json(obj, **dumps) -> str:
    """``obj`` as strict JSON: a NaN or infinite number (a held-out loss in float16, say)
    is written as null, never as the bare ``NaN``/``Infinity`` other parsers refuse."""
    return json.dumps(_finite(obj), allow_nan=False, **dumps)


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def check_tensorboard() -> None:
    """``--tensorboard`` needs the tensorboard package: say so before the run touches anything."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise LongtrainError("--tensorboard needs the tensorboard package: pip install tensorboard, "
                             "or drop --tensorboard") from None


class MetricsLog:
    """Appends records to ``path`` (and TensorBoard). With ``after_step``, the records
    past that step already in the file (a resumed run redoes those steps) are dropped
    when the first new record arrives — not before, so a run that fails before its first
    step leaves the log as it was."""

    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None, after_step: int | None = None):
        self.path = Path(path)
        self._after_step = after_step
        self._file = None
        self._tb = None
        if tensorboard_dir is not None:
            check_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            with writing("the TensorBoard log", tensorboard_dir):
                self._tb = SummaryWriter(str(tensorboard_dir))

    def _open(self):
        with writing("the metrics log", self.path):
            if self._after_step is not None:
                truncate_after(self.path, self._after_step)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return open(self.path, "a")

    def write(self, record: dict) -> None:
        if self._file is None:
            self._file = self._open()
        with writing("the metrics log", self.path, "continue with --resume"):
            self._file.write(strict_json(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _flatten(record: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def truncate_after(path: str | Path, step: int) -> None:
    """Drop records beyond ``step`` (used when resuming, so the log matches the state).
    A line cut short by a kill mid-write is dropped too; the file is left alone when
    nothing would change."""
    path = Path(path)
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if (at := _step_of(line)) is not None and at <= step]
    if kept != lines:
        with writing("the metrics log", path):
            write_text_atomic(path, "".join(line + "\n" for line in kept))


def _step_of(line: str) -> int | None:
    """The step of one JSON line, or None for a line that is not a complete record."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("step", 0) if isinstance(record, dict) else None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics log (a line cut short by a kill is skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if _step_of(line) is not None]
