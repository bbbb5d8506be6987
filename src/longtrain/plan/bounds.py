"""What a step must hold, counted from the config rather than simulated: the model states
per place of the optimizer's state (:func:`budgets_for`), what a strategy parks
(:func:`parked_split`) and the least a step holds beside the model states
(:func:`least_bytes`), and the allocator's fragmentation margin on a simulated peak
(:func:`reserved_bytes`). The planner and the simulator refuse with these, at once, what no
simulation could make fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from .. import registry
from ..errors import LongtrainError
from ..memory.units import format_bytes
from ..models.loading import build_from_config
from ..strategy import Strategy
from .fake_model import four_bit_weight_bytes

__all__ = [
    "Budget",
    "FRAGMENTATION",
    "budget_under",
    "budgets_for",
    "least_bytes",
    "longest_where",
    "parked_bytes",
    "parked_split",
    "refuse_lengths_that_cannot_fit",
    "reserved_bytes",
]


# The allocator's overhead on what a step allocates and frees (everything but the weights
# and the optimizer state, which are allocated once): (reserved − weights) / (allocated −
# weights) on an H100, the largest seen per kind (docs/planner.md).
FRAGMENTATION = {"offload": 1.8, "chunked": 1.25, "whole": 1.1}


@dataclass
class Budget:
    """What a candidate must fit: the machine, and what stays resident whatever the strategy."""

    device_memory: int
    host_memory: int
    persistent: int  # device bytes allocated once (weights, and optimizer state when on the device)
    device_state: int  # optimizer state on the device (added to simulations without optimizer)
    host_state: int  # optimizer state, masters and gradient buffers in host memory
    optimizer: str  # what the simulation runs: "none" (state added) or "adamw-offload"
    step_extra: int = 0  # device bytes beside ``persistent`` at the optimizer step: gradients, float32 gradients made at once


def budgets_for(config, *, device_memory: int, host_memory: int, optimizer: str, dtype: torch.dtype,
                lora_rank: int | None = None, gpus: int = 1, optimizer_offload: bool | None = None
                ) -> tuple[int, list[Budget]]:
    """(parameter count, the places for the optimizer's state that the machine allows:
    the device, host memory, or both) — or a one-line error when the model states alone
    cannot fit."""
    item = torch.tensor([], dtype=dtype).element_size()
    params, state = _state_bytes(config, optimizer, dtype)
    if lora_rank:  # adapters are a fraction of a percent of the weights: their gradients and state are simulated
        state = 0
    # Under sequence parallelism FSDP2 shards parameters, gradients and optimizer state over the GPUs.
    weights = (four_bit_weight_bytes(config, dtype) or params * item) // gpus
    state //= gpus
    budgets = []
    grads = 0 if lora_rank else weights
    # MasterAdamW makes a bucket of gradients float32 at once: at least the largest parameter's.
    transient = 0 if lora_rank or optimizer != "adamw" or item >= 4 else 4 * _largest_parameter(config, dtype) // gpus
    if weights + grads + state + transient <= device_memory and optimizer_offload is not True:
        # LoRA: the adapters' optimizer state is simulated with them (a fraction of a percent of the weights).
        budgets.append(Budget(device_memory, host_memory, weights + state, state, 0, optimizer if lora_rank else "none",
                              step_extra=grads + transient))
    offloadable = optimizer == "adamw" and not lora_rank and gpus == 1
    if optimizer_offload is not False and offloadable and weights <= device_memory:
        masters = params * 4  # fp32 masters, two fp32 moments, a gradient buffer in the parameters' dtype
        budgets.append(Budget(device_memory, host_memory, weights, 0, 3 * masters + params * item, "adamw-offload"))
    if optimizer_offload and not offloadable:
        raise LongtrainError("--optimizer-offload plans AdamW's state in host memory for full fine-tuning on one GPU; "
                             "it needs --optimizer adamw, no --lora and --gpus 1")
    if not budgets:
        held = weights if optimizer_offload else weights + grads + state
        what = f"the weights alone ({format_bytes(held)})" if optimizer_offload else (
            f"the model states alone (weights, gradients, {optimizer} state: {format_bytes(held)} per GPU)")
        beside = (f" (with AdamW's state in host memory, --optimizer-offload, the weights alone, {format_bytes(weights)}, "
                  f"still exceed it)" if offloadable and optimizer_offload is None else "")
        raise LongtrainError(
            f"{what} exceed the device's {format_bytes(device_memory)} by {format_bytes(held - device_memory)}{beside}; "
            "no activation strategy helps — shard them over more GPUs (--gpus), train LoRA (--lora), or use a smaller optimizer"
        )
    return params, budgets


def _state_bytes(config, optimizer: str, dtype: torch.dtype) -> tuple[int, int]:
    """(parameter count, bytes of the optimizer state on the device) of full fine-tuning:
    AdamW's two moments, with float32 masters and moments for 16-bit weights (``adamw``, as
    :class:`~longtrain.optimizers.MasterAdamW` holds them: 12 bytes per parameter) or in the
    weights' dtype (``adamw-16bit``); SGD's momentum."""
    with torch.device("meta"):
        model = build_from_config(config, dtype)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    item = torch.tensor([], dtype=dtype).element_size()
    if optimizer == "adamw" and item < 4:
        return params, 12 * params
    per = {"adamw": 2, "adamw-16bit": 2, "sgd": 1, "none": 0}[optimizer]
    return params, per * params * item


def _largest_parameter(config, dtype: torch.dtype) -> int:
    """Elements of the model's largest parameter (the embedding, as a rule)."""
    with torch.device("meta"):
        model = build_from_config(config, dtype)
    return max(p.numel() for p in model.parameters())


def budget_under(strategy: Strategy, budget: Budget, config, item: int) -> Budget:
    """``budget`` as ``strategy`` sees it: weights its techniques move to host memory
    (:meth:`~longtrain.costs.TechniqueCosts.weights_moved`) leave the device's persistent
    bytes and join the host's."""
    off_device = on_host = 0
    for name, options in strategy.techniques.items():
        less, more = registry.technique(name).costs.weights_moved(config, options, item)
        off_device, on_host = off_device + less, on_host + more
    if not (off_device or on_host):
        return budget
    return dataclasses.replace(budget, persistent=budget.persistent - off_device, host_state=budget.host_state + on_host)


def parked_split(config, seq_len: int, strategy: Strategy, item: int, batch: int = 1) -> tuple[int, int]:
    """:func:`parked_bytes` as (on the device, in host memory), as the engine and each
    technique count what they park (their costs' ``parked``), with the most a technique's
    op holds at once beside it (``held_at_once``)."""
    engine = _engine_costs(strategy)
    device, host = engine.parked(config, seq_len, strategy.engine_options, item, batch)
    offloads = engine.parks_on_host(strategy.engine_options)
    at_once = min(seq_len, engine.chunk(strategy.engine_options) or seq_len)  # tokens a layer runs at a time
    held = 0
    for name, options in strategy.techniques.items():
        costs = registry.technique(name).costs
        more_device, more_host = costs.parked(config, seq_len, options, item, batch, offloads)
        device, host = device + more_device, host + more_host
        held = max(held, costs.held_at_once(config, at_once, options, item, batch))
    return device + held, host


def parked_bytes(config, seq_len: int, strategy: Strategy, item: int, batch: int = 1) -> int:
    """A lower bound of what a step parks at its fullest (layer inputs, K/V, kept attention
    outputs), counted from the config; where it is parked: :func:`parked_split`."""
    return sum(parked_split(config, seq_len, strategy, item, batch))


def _engine_costs(strategy: Strategy):
    return registry.engine(strategy.engine).costs


def _margin(strategy: Strategy) -> float:
    """The fragmentation margin of ``strategy``'s steps: the largest its engine's and its
    techniques' kinds of allocation ask for."""
    kinds = [_engine_costs(strategy).fragmentation(strategy.engine_options)]
    kinds += [registry.technique(name).costs.fragmentation(options) for name, options in strategy.techniques.items()]
    return max(FRAGMENTATION[kind] for kind in kinds if kind is not None)


def least_bytes(config, seq_len: int, strategy: Strategy, item: int, batch: int = 1, gpus: int = 1) -> tuple[int, int]:
    """(device, host) bytes one rank of a step of ``strategy`` holds at its fullest beside the
    model states, whatever the simulation finds: the token ids (int64, on the device) and what
    it parks (:func:`parked_split`), a share of ``gpus`` under sequence parallelism. Counted
    from the config, so any length is answered at once."""
    on_device, on_host = parked_split(config, seq_len, strategy, item, batch)
    return (8 * batch * seq_len + on_device) // gpus, on_host // gpus


def longest_where(fits: Callable[[int], bool], below: int) -> int:
    """The longest length under ``below`` where ``fits`` (true up to some length, false
    beyond) holds, by bisection; 0 where it holds at none."""
    if not fits(2):
        return 0
    low, high = 2, below
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _bound(config, seq_len, strategy, budget: Budget, item, batch, gpus) -> str | None:
    """Why ``strategy`` cannot fit whatever the simulation says (the token ids and its parked
    bytes alone, :func:`least_bytes`: what binds, and at least how much), or None."""
    on_device, on_host = least_bytes(config, seq_len, strategy, item, batch, gpus)
    device = budget.persistent + on_device
    host = budget.host_state + on_host
    if device > budget.device_memory:
        return f"device memory: at least {format_bytes(device)}"
    if host > budget.host_memory:
        return f"host memory: at least {format_bytes(host)}"
    return None


def _beyond_reach(config, seq_len, jobs, bounds, item, batch, gpus, device_memory, host_memory) -> str:
    """The one line refusing a length at which no candidate — ``jobs``: (name, strategy,
    budget) — can fit by its bound (``bounds``: :func:`_bound`'s), naming the longest length
    at which one could."""
    reach = [longest_where(lambda tokens: _bound(config, tokens, strategy, budget, item, batch, gpus) is None, seq_len)
             for _, strategy, budget in jobs]
    best = max(range(len(jobs)), key=lambda i: reach[i])
    machine = f"{gpus} × {format_bytes(device_memory)}" if gpus > 1 else format_bytes(device_memory)
    longest = (f"the longest any could fit is {reach[best]:,} tokens ({jobs[best][0]})" if reach[best]
               else "no length fits beside the model states")
    return (f"no strategy weighed fits {seq_len:,} tokens on {machine} of device and {format_bytes(host_memory)} of host "
            f"memory: the token ids and what each candidate parks alone exceed it ({jobs[best][0]}: {bounds[best]}); "
            f"{longest} — counted, not simulated")


def reserved_bytes(strategy: Strategy, budget: Budget, device: int) -> int:
    """What must fit the device: the simulated peak (``device``, without on-device
    optimizer state) with that state, and what a step allocates and frees times the
    allocator's fragmentation margin."""
    return int(budget.persistent + _margin(strategy) * (device + budget.device_state - budget.persistent))


def refuse_lengths_that_cannot_fit(config, seq_len: int, strategy: Strategy, dtype: torch.dtype, batch: int,
                                   device_memory: int | None, host_memory: int | None) -> None:
    """Refuse at once a length whose token ids and parked activations alone — counted from
    the config (:func:`least_bytes`), not simulated — exceed the
    machine named, naming the longest length that could fit beside the weights."""
    item = torch.tensor([], dtype=dtype).element_size()
    sp = strategy.sequence_parallel
    gpus = sp.degree if sp is not None else 1  # the sequence's share
    processes = (sp.processes or sp.degree) if sp is not None else 1  # the weights' share (FSDP2)

    def over(tokens: int, weights: int = 0) -> list[str]:
        device, host = least_bytes(config, tokens, strategy, item, batch, gpus)
        return [f"{need} of {where} memory, {format_bytes(have)} named"
                for where, need, have in (("device", format_bytes(weights + device), device_memory),
                                          ("host", format_bytes(host), host_memory))
                if have is not None and (weights + device if where == "device" else host) > have]

    if not over(seq_len):
        return
    # (frozen under LoRA, there all the same)
    weights = (four_bit_weight_bytes(config, dtype) or _state_bytes(config, "none", dtype)[0] * item) // processes
    longest = longest_where(lambda tokens: not over(tokens, weights), seq_len)
    raise LongtrainError(
        f"{seq_len:,} tokens cannot fit: under strategy {strategy.spec}, the token ids and what the step parks "
        f"alone need at least {'; '.join(over(seq_len))} (counted, not simulated); "
        + (f"at most {longest:,} tokens could fit beside the weights (their gradients and optimizer state "
           f"not counted)" if longest else
           "no length fits beside the weights")
        + (f" ({batch} per batch)" if batch > 1 else ""))
