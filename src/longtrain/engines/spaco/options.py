"""The SpaCO engine's options (:class:`SpaCOOptions`): SeCO's, and how many chunks a step
backpropagates."""

from __future__ import annotations

from dataclasses import dataclass

from ... import validate
from ..seco.options import SeCOOptions

__all__ = ["SpaCOOptions"]


@dataclass
class SpaCOOptions(SeCOOptions):
    """Knobs of the sparse engine: ``budget`` chunks backpropagated per step on average."""

    _name = "spaco"
    chunk: int = 128
    budget: int = 8  # t: expected number of chunks backpropagated per step
    cap: float | None = None  # limit on the relay factor k/t (paper: 2); None: unbiased
    seed: int = 0  # chunk selection: seeded per step, so runs repeat

    def __post_init__(self):
        super().__post_init__()
        validate.positive_int("spaco", "budget", self.budget)
        if self.cap is not None:
            validate.finite_number("spaco", "cap", self.cap, minimum=1)
        validate.positive_int("spaco", "seed", self.seed, minimum=0, maximum=2**63 - 1)  # a torch generator's seed
