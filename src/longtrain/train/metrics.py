"""Metrics as JSON lines (one object per step or evaluation), optionally TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import LongtrainError
from .checkpoint import write_text_atomic


class MetricsLog:
    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise LongtrainError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            self._tb = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
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
    """Drop records beyond ``step`` (used when resuming, so the log matches the state)."""
    path = Path(path)
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
