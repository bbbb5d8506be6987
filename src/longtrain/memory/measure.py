"""Measured peak memory of each training step.

On CUDA the caching allocator knows: max allocated and max reserved bytes, reset at
the start of every step. On CPU the :class:`MemoryTracker` counts live tensor storages
exactly, with a breakdown by category.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tracker import MemoryReport, MemoryTracker

__all__ = ["StepMemoryMeter"]


@dataclass
class StepPeak:
    peak_bytes: int  # most bytes held by tensors at once during the step
    reserved_bytes: int | None  # CUDA caching-allocator reservation (None on CPU)
    method: str  # "cuda-allocator" or "tracked-storages"
    report: MemoryReport | None = None  # per-category breakdown (CPU)


class StepMemoryMeter:
    """``with StepMemoryMeter(device, model, optimizer) as meter:`` then, around each
    step, ``meter.start_step()`` ... ``peak = meter.end_step()``."""

    def __init__(self, device: torch.device | str, model=None, optimizer=None):
        self.device = torch.device(device)
        self._tracker = None if self.device.type == "cuda" else MemoryTracker(model, optimizer)

    def __enter__(self):
        if self._tracker is not None:
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc):
        if self._tracker is not None:
            return self._tracker.__exit__(*exc)
        return False

    def start_step(self) -> None:
        if self._tracker is None:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._tracker.reset_peak()

    def end_step(self) -> StepPeak:
        if self._tracker is None:
            return StepPeak(
                torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device), "cuda-allocator"
            )
        report = self._tracker.report()
        return StepPeak(report.peak_device_bytes, None, "tracked-storages", report)
