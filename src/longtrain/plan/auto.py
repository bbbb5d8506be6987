"""``--strategy auto``: the planner's fastest fitting strategy for the machine at hand.

The plan is made for this device's memory (the share the allocator's per-process fraction
allows, where one is set), half the host's physical memory (what Memo and kept attention
may pin) and this machine's rates: those ``longtrain calibrate`` stored, else the built-in
table of its card (the H200's on an H200, the H100's otherwise). Techniques that cost no
memory and save time where they run (``added_automatically`` in their costs: Liger's fused
kernels on a GPU whose model family liger-kernel covers) are carried by every candidate,
so the ranking is of what runs.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import registry
from ..errors import LongtrainError
from ..memory.units import pinned_host_budget
from ..models.loading import load_config
from ..strategy import Strategy

__all__ = ["auto_strategy"]


def auto_strategy(model, seq_len: int, device: torch.device, *, dtype: str = "bfloat16", batch: int = 1,
                  optimizer: str = "adamw", optimizer_offload: bool = False,
                  say: Callable[[str], None] = print) -> Strategy:
    """The fastest strategy the planner finds fitting ``device`` for ``model`` at ``seq_len``
    tokens (one process of full fine-tuning); a :class:`LongtrainError` naming what binds
    where none fits."""
    from .calibrate import local_rates
    from .planner import PlanRequest, plan

    host = pinned_host_budget()
    device_memory = _usable_device_memory(device) if device.type == "cuda" else host
    rates_name, rates = local_rates(device)  # this machine's `longtrain calibrate`, else its card's built-in table
    model_type = load_config(model).model_type
    carried = []
    for technique_name, technique in registry.techniques().items():
        # Same memory, less time (e.g. fused elementwise kernels), where the technique runs here.
        reason = technique.costs.added_automatically(device.type, model_type)
        if reason is not None:
            carried.append(technique_name)
            say(f"--strategy auto weighs every candidate with {technique_name} where it combines ({reason})")
    say(f"planning --strategy auto for {seq_len:,} tokens at the {rates_name} rates ...")
    result = plan(PlanRequest(model, seq_len, device_memory=device_memory, host_memory=host, optimizer=optimizer,
                              dtype=dtype, batch=batch, optimizer_offload=optimizer_offload, rates=rates,
                              rates_name=rates_name, carried=tuple(carried)))
    if result.best is None:
        hint = "" if optimizer_offload or optimizer == "none" else "; --optimizer-offload moves AdamW's state to host memory"
        raise LongtrainError(f"--strategy auto: {result.verdict()}{hint}")
    say(f"--strategy auto chose {result.verdict()}")
    return Strategy.from_dict(result.best.strategy)


def _usable_device_memory(device: torch.device) -> int:
    """What this process may allocate on ``device``: its memory, times the allocator's
    per-process fraction where one is set (``torch.cuda.set_per_process_memory_fraction``:
    a smaller card's memory on a larger one)."""
    # torch.cuda's queries take an index; a bare "cuda" means the current device.
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    try:
        fraction = torch.cuda.get_per_process_memory_fraction(index)
    except (AttributeError, AssertionError, RuntimeError):  # an older torch, or no CUDA runtime to ask
        fraction = 1.0
    return int(total * fraction)
