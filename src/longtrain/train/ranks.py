"""What the trainer needs to run as one of several ``torchrun`` processes.

Two ways to split a run over R processes:

- ``--engine adjoint`` (SSM-ResNet): every rank builds the same model and reads the same
  batches; the model is split into layer groups (:mod:`longtrain.parallel.layer_groups`)
  so each rank keeps its own layers' parameters, gradients and optimizer state;
- ``--sp P`` (Ulysses sequence parallelism): each group of P ranks shares a sequence,
  the R/P groups are data parallel (each reads its own samples), and parameters,
  gradients and optimizer state are sharded over all R ranks (FSDP2).

Rank 0 prints, logs and writes the final model; checkpoints hold one weights file and
one state file per rank (its layers, or its shards), written by their ranks and
committed by rank 0 (see :func:`longtrain.train.run_checkpoints.save_checkpoint`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import registry
from ..errors import LongtrainError

__all__ = ["Ranks", "check_distributed_engine"]


class Ranks:
    """This process's place among the training processes (rank 0 of 1 when alone);
    ``sequence_parallel`` ranks share each sequence, the rest are data parallel."""

    def __init__(self, rank: int = 0, world_size: int = 1, sequence_parallel: int = 1):
        self.rank, self.world_size, self.sequence_parallel = rank, world_size, sequence_parallel

    @classmethod
    def from_env(cls, device: torch.device, sequence_parallel: int = 1) -> "Ranks":
        from ..parallel.distributed import init_from_env

        return cls(*init_from_env(device), sequence_parallel=sequence_parallel)

    @property
    def data_parallel(self) -> int:
        """Groups that read different samples."""
        return self.world_size // self.sequence_parallel if self.sequence_parallel > 1 else 1

    @property
    def data_rank(self) -> int:
        return self.rank // self.sequence_parallel if self.sequence_parallel > 1 else 0

    def sum_over_data_parallel(self, count: int, device: torch.device) -> int:
        """A count every data-parallel group has its own of, summed over the groups."""
        from ..parallel.distributed import sum_over_data_parallel

        return count if self.data_parallel == 1 else sum_over_data_parallel(count, self.sequence_parallel, device)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def max(self, value: float) -> float:
        if not self.distributed:
            return value
        tensor = torch.tensor(float(value), dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor)

    def gather(self, obj):
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def clip_grad_norm(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clip the gradient norm over the parameters of every rank (as
        ``torch.nn.utils.clip_grad_norm_``). Each tensor's norm is accumulated in float64
        without copying the gradient (``vector_norm`` with a float64 accumulator), and
        the squares are summed in float64, so a run's result does not depend on how its
        layers were split over processes; one value crosses to the host."""
        from ..parallel.layer_groups import mirrored

        grads = [p.grad for p in parameters if p.grad is not None]
        counted = [p.grad for p in parameters if p.grad is not None and not mirrored(p)]  # a tied copy counts once
        local = torch.zeros((), dtype=torch.float64)
        if counted:  # (a rank without gradients still joins the all-reduce)
            # Under FSDP each rank holds disjoint shards: its own squares, summed over ranks.
            shards = [_local(g) for g in counted]
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64).to(shards[0].device) for g in shards])
            local = norms.square().sum()
        if self.distributed:
            local = local.cpu()
            dist.all_reduce(local)
        total = float(local.sqrt())
        scale = min(1.0, max_norm / (total + 1e-6))
        if scale < 1.0:
            for g in grads:
                _local(g).mul_(scale)
        return total

    def full_state(self, model) -> dict[str, torch.Tensor] | None:
        """Every parameter of ``model`` whole, on the CPU of rank 0 (None elsewhere):
        gathered from layer groups, or from FSDP shards."""
        from torch.distributed.tensor import DTensor

        if not self.distributed:
            return {n: p.detach().cpu() for n, p in model.named_parameters()}
        if any(isinstance(p, DTensor) for p in model.parameters()):
            state = {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}  # collective: every rank
            return state if self.main else None
        shards = self.gather({n: p.detach().cpu() for n, p in model.named_parameters() if not p.is_meta})
        return {n: t for shard in shards for n, t in shard.items()} if self.main else None

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.barrier()  # nobody tears down a connection a peer still uses
            dist.destroy_process_group()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def check_distributed_engine(ranks: Ranks, engine: str) -> None:
    """A distributed run splits either the layers (an engine with layer groups) or the
    sequence (``--sp``) over its processes."""
    if not ranks.distributed or registry.engine(engine).layer_groups is not None:
        return
    if ranks.sequence_parallel == 1:
        raise LongtrainError(
            f"{ranks.world_size} processes were launched; split the sequence over them with --sp {ranks.world_size} "
            f"(or a divisor: the rest is data parallel), or use --engine adjoint (layer groups) with an SSM model"
        )
    if ranks.world_size % ranks.sequence_parallel:
        raise LongtrainError(f"--sp {ranks.sequence_parallel} must divide the number of processes ({ranks.world_size})")
