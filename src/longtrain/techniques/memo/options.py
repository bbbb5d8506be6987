"""``memo``'s options: α, the host budget, where the swapped activations go and how many
top layers keep theirs on the device (validated when built)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import validate
from ...errors import LongtrainError


@dataclass
class MemoOptions:
    """Knobs of Memo's token-wise swapping."""

    alpha: float | str = "auto"  # fraction of tokens of the other saved tensors swapped to host; "auto": Memo's rule
    host_memory: int | str | None = None  # host budget for the swapped activations; default: the run's host memory
    offload: bool = True  # swap to host memory (false: keep on the device, to test the schedule)
    keep_last: int = 2  # the last layers keep what they save on the device

    def __post_init__(self):
        if self.alpha != "auto":
            if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
                raise LongtrainError(f"memo alpha must be a number in [0, 1] or 'auto', got {self.alpha!r}")
            self.alpha = float(self.alpha)
        if self.host_memory is not None:
            self.host_memory = validate.byte_size("memo", "host_memory", self.host_memory)
            if self.host_memory <= 0:
                raise LongtrainError(f"memo host_memory must be positive, got {self.host_memory!r}")
        validate.flag("memo", "offload", self.offload)
        validate.positive_int("memo", "keep_last", self.keep_last, minimum=0)
