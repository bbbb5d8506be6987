"""Adjoint sharding over ranks: each rank owns a contiguous group of SSM layers
(SSM-ResNet, Mamba, or any model whose adapter sees its layers as recurrences).

Paper: the adjoint sharding paper, §4.4, Alg. 1 and 4, Tables 2–6. Rank r
holds the parameters, gradients, optimizer state and the forward records (y, A, c, h)
of its layers only; rank 0 also holds the embedding, the last rank the final norm and
the LM head. Where the model ties the head to the embedding (every published Mamba), rank 0
and the last rank each hold a copy of that matrix: after each step they swap their halves
of its gradient and both add them in the order one process accumulates them (the head's
first), so the copies stay equal and the gradient is the one-process one bit for bit; the
last rank's copy is marked a mirror, which gradient norms count once. One step:

- forward (Alg. 1): rank 0 embeds the tokens and runs its layers, then each rank
  receives the residual stream from the rank below, runs its layers and passes it up;
  the last rank computes the loss and ∂L/∂z_K.
- gradient (Alg. 4): the last rank runs the adjoint engine over its layers and passes
  ∂L/∂z at its group's input down; each rank does the same for its group.

Alg. 4 as printed lets every rank start at once because it feeds ∂L/∂y_K (the top of
the stack) to every layer. The exact gradient of layer k needs ∂L/∂z_k, which depends
on the layers above, so the gradient phase goes down the ranks in turn: the ranks
share the memory (1/R of the records, parameters and optimizer state each), not the
time of one micro-batch. Messages are (batch, T, hidden) tensors, two per rank
boundary per step.

Launch with ``torchrun --nproc-per-node R``; gloo on CPU, NCCL on CUDA
(``init_process_group`` picks by device). Results equal the single-process engine
bit for bit: every rank runs the same operations on the same values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import LongtrainError
from ..models.adapters import adapter_class, adapter_for, describe_model
from ..models.layers import unwrap

__all__ = ["LayerGroup", "layer_ranges", "mirrored", "owned_parameters", "shard_model"]

_MIRROR = "_longtrain_mirror"  # set on the last rank's copy of a tied embedding

def layer_ranges(n_layers: int, world_size: int) -> list[range]:
    """Contiguous, balanced layer groups, one per rank (earlier ranks take the remainder)."""
    if world_size > n_layers:
        raise LongtrainError(
            f"cannot split {n_layers} SSM layers over {world_size} ranks (each rank needs a layer); "
            f"launch at most {n_layers} processes"
        )
    size, extra = divmod(n_layers, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + size + (rank < extra)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def busiest_group(config, world_size: int):
    """The config of the model the busiest of ``world_size`` ranks runs, for simulating it
    as one process: the largest group's layers (:func:`layer_ranges`), with the embedding
    and the head. An end rank holds one of the two (with tied embeddings, a copy each) and
    the stream or its gradient from its neighbour instead of the other, so this bounds it
    within one vocabulary matrix's parameters, gradient and optimizer state."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LongtrainError(f"layer groups must be a positive count of processes, got {world_size!r}")
    adapter = adapter_class(config.model_type)
    layers = max(len(group) for group in layer_ranges(describe_model(config).layers, world_size))
    return adapter.with_layers(config, layers)


class LayerGroup:
    """This rank's share of the model: its layer indices and whether it holds the
    embedding (first rank) or the head (last rank)."""

    def __init__(self, n_layers: int, rank: int, world_size: int, process_group=None, tied: bool = False):
        self.rank, self.world_size, self.process_group = rank, world_size, process_group
        self.layers = layer_ranges(n_layers, world_size)[rank]
        self.first = rank == 0
        self.last = rank == world_size - 1
        self.tied = tied and world_size > 1 and (self.first or self.last)  # this rank holds a tied embedding's copy

    def send(self, tensor: torch.Tensor, up: bool) -> None:
        dist.send(tensor.contiguous(), self.rank + (1 if up else -1), group=self.process_group)

    def recv(self, like: torch.Tensor, up: bool) -> torch.Tensor:
        """Receive from the rank above (``up``) or below a tensor shaped like ``like``."""
        buffer = torch.empty_like(like)
        dist.recv(buffer, self.rank + (1 if up else -1), group=self.process_group)
        return buffer

    def sum_tied(self, weight: nn.Parameter, previous: torch.Tensor | None) -> None:
        """Swap this step's gradient of a tied embedding's copy (rank 0: the embedding's
        part, last rank: the head's) with the other copy's rank and set both to
        ``previous`` (the micro-batches before) + head part + embedding part."""
        if not self.tied or not weight.requires_grad:  # (both copies frozen alike: LoRA)
            return
        mine = weight.grad.contiguous() if weight.grad is not None else torch.zeros_like(weight)
        theirs = torch.empty_like(mine)
        peer = self.world_size - 1 if self.first else 0
        # One batch, so NCCL pairs the send and the receive (separately, each would wait for the other).
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, self.process_group),
                                               dist.P2POp(dist.irecv, theirs, peer, self.process_group)]):
            request.wait()
        head, embedding = (theirs, mine) if self.first else (mine, theirs)
        weight.grad = (head if previous is None else previous + head) + embedding


def shard_model(context, rank: int, world_size: int, process_group=None) -> LayerGroup:
    """Keep only this rank's layers (and the embedding or head) of the applied model in
    memory; the group is recorded as the context's ``parallel`` placement.

    The other modules move to the meta device: no storage, no gradient, so an optimizer
    built over ``model.parameters()`` keeps state for this rank's parameters only.
    ``context`` is the model's :class:`~longtrain.engines.base.EngineContext`
    (``longtrain.strategy.applied_context(model)``).
    """
    base = unwrap(context.model)
    adapter = adapter_for(base)
    if getattr(adapter, "recurrence", None) is None:
        raise LongtrainError(f"layer groups split state-space models (SSM-ResNet, Mamba, Mamba-2) over processes, "
                             f"not {type(base).__name__}")
    tied = adapter.description.tied_embeddings
    group = LayerGroup(len(adapter.layers), rank, world_size, process_group, tied=tied)
    for index, layer in enumerate(adapter.layers):
        if index not in group.layers:
            layer.to("meta")
    if not group.first:
        adapter.embeddings().to("meta")
    if not group.last:
        adapter.norm().to("meta")
        adapter.head().module.to("meta")  # a tied head gets a meta parameter of its own: the embedding keeps its matrix
    if group.tied and group.last:
        setattr(adapter.head().module.weight, _MIRROR, True)
    context.parallel = group
    return group


def mirrored(parameter: nn.Parameter) -> bool:
    """Whether ``parameter`` is the last rank's copy of a tied embedding (rank 0 holds the
    same values and gradient; a norm over the ranks counts it there)."""
    return getattr(parameter, _MIRROR, False)


def owned_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters this rank holds (all of them without sharding)."""
    return {name: p for name, p in model.named_parameters() if not p.is_meta}
