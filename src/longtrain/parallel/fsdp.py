"""Parameters, gradients and optimizer state sharded over all ranks with FSDP2.

longtrain's engines call a model's pieces one by one (embeddings, each layer, the final
norm, the loss head) rather than its forward, so each piece is its own FSDP2 unit:
gathered around each call, its gradients reduce-scattered after each backward through
it (several per step under the chunked engines, which accumulate). Tied weights share a
unit. FSDP2 picks its root on the first forward it sees and wants every unit under it,
so the units sit under one container whose (empty) forward runs once when the model is
sharded; after that the units run standalone. Gradients are summed, not averaged:
longtrain normalizes the loss by the label count of the whole step over every rank, so
the sum is the gradient of the mean.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from ..errors import LongtrainError

__all__ = ["check_all_sharded", "forget_meshes", "gathered", "padded_to_longest", "settle_root", "shard_parameters",
           "sum_gradients_of", "unit_holding", "world_mesh"]


@functools.lru_cache(maxsize=None)
def _world_mesh(device_type: str, world_size: int, group_id: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size,))


def forget_meshes() -> None:
    """Drop the cached meshes (their process group is going away)."""
    _world_mesh.cache_clear()


def world_mesh(device_type: str):
    """The 1-D mesh of every rank (created once; outside fake tensor mode, so the
    simulator calls it before it builds a model)."""
    return _world_mesh(device_type, dist.get_world_size(), id(dist.group.WORLD))


class _Root(nn.Module):
    """The container FSDP2's root is made of: every unit lies under it."""

    def __init__(self, *modules: nn.Module):
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self) -> None:
        return None


def shard_parameters(units: list, parts: list[nn.Module], device_type: str,
                     compute_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` each unit (a module, or a list of modules that share one, e.g. tied
    embeddings and head) over every rank, under a root over ``parts`` (modules that hold
    every unit); mixed precision computes in ``compute_dtype`` with parameters kept in
    their own dtype and gradients reduced in float32. Returns the root, to keep."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    mesh = world_mesh(device_type)
    for unit in units:
        sharded = fully_shard(unit, mesh=mesh, mp_policy=mp)
        sum_gradients_of(sharded[0] if isinstance(sharded, list) else sharded)
    root = _Root(*parts)
    # A module may sit in two places (the head: in the model and in the loss head's unit);
    # what a unit already holds is not the root's.
    held = {p for p in root.parameters() if isinstance(p, DTensor)}
    sum_gradients_of(fully_shard(root, mesh=mesh, mp_policy=mp, ignored_params=held))
    with torch.no_grad():
        root()  # FSDP2 settles its root and the units under it on this first forward
    return root


def sum_gradients_of(module) -> None:
    """Reduce ``module``'s (an FSDP2 unit's) gradients by summing (no division by the world
    size), with a plain SUM where the backend has no pre-multiplied sum (gloo)."""
    module.set_gradient_divide_factor(1.0)
    force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
    if force_sum is not None:
        force_sum(True)


def check_all_sharded(model: nn.Module) -> None:
    """Every parameter must belong to a unit (a missed one would be replicated, unsummed)."""
    from torch.distributed.tensor import DTensor

    loose = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if loose:
        raise LongtrainError(f"sequence parallelism could not shard parameter {loose[0]} (of {len(loose)}); "
                             "this model's adapter does not name the module that holds it")


@contextlib.contextmanager
def gathered(module: nn.Module):
    """``module``'s parameters whole for calls that bypass its forward (no gradients:
    the chunked engines' K/V recomputation runs part of a layer)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def settle_root(model: nn.Module) -> None:
    """Make ``model`` — sharded by someone else (Accelerate's FSDP2 plugin: each layer, the
    embeddings and the head its own unit, the model the root) — the root of its units, as its
    first forward would; longtrain's engines then call the units one by one and never the
    model's forward."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()  # no-op after the first call


def unit_holding(model: nn.Module, module: nn.Module):
    """The FSDP2 unit under ``model`` (not ``model`` itself) that holds ``module``'s
    parameters, or None."""
    from torch.distributed.fsdp import FSDPModule

    wanted = {id(p) for p in module.parameters()}
    for unit in model.modules():
        if unit is not model and isinstance(unit, FSDPModule):
            groups = unit._get_fsdp_state()._fsdp_param_groups
            if wanted & {id(param.sharded_param) for group in groups for param in group.fsdp_params}:
                return unit
    return None


def padded_to_longest(batch: dict) -> dict:
    """``batch`` (Hugging Face's keys) padded at its end to the longest micro-batch of any
    process, with tokens that carry no loss (labels -100, attention mask 0, positions going
    on): under FSDP2 every unit gathers and reduces per call, and the chunked engines call
    each unit once per chunk, so every process must have as many chunks. No real token sees
    a later position, so the padding changes no loss and no gradient."""
    ids = batch["input_ids"]
    longest = torch.tensor([ids.shape[1]], dtype=torch.int64, device=ids.device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    pad = int(longest) - ids.shape[1]
    if pad == 0:
        return batch
    fill = {"input_ids": 0, "labels": -100, "attention_mask": 0}
    padded = {key: torch.nn.functional.pad(value, (0, pad), value=fill[key]) for key, value in batch.items()
              if key in fill}
    if "position_ids" in batch:
        positions = batch["position_ids"]
        padded["position_ids"] = torch.cat(
            [positions, positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)], dim=1)
    return padded
