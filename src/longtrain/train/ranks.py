"""What the trainer needs to run as one of several ``torchrun`` processes.

Under ``torchrun --nproc-per-node R longtrain train --engine adjoint ...`` every rank
builds the same model and reads the same batches (same seed); the model is then split
into layer groups (:mod:`longtrain.parallel.layer_groups`) so each rank keeps its own
layers' parameters, gradients and optimizer state. Rank 0 prints, logs and writes the
final model; checkpoints hold one weights file and one state file per rank, written by
their ranks and committed by rank 0 (see :func:`longtrain.train.checkpoint.save_checkpoint`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import LongtrainError


class Ranks:
    """This process's place among the training processes (rank 0 of 1 when alone)."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size

    @classmethod
    def from_env(cls, device: torch.device) -> "Ranks":
        from ..parallel.distributed import init_from_env

        return cls(*init_from_env(device))

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
        grads = [p.grad for p in parameters if p.grad is not None]
        local = torch.zeros((), dtype=torch.float64)
        if grads:  # (a rank without gradients still joins the all-reduce)
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64).to(grads[0].device) for g in grads])
            local = norms.square().sum()
        if self.distributed:
            local = local.cpu()
            dist.all_reduce(local)
        total = float(local.sqrt())
        scale = min(1.0, max_norm / (total + 1e-6))
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
        return total

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def check_distributed_engine(ranks: Ranks, engine: str) -> None:
    if ranks.distributed and engine != "adjoint":
        raise LongtrainError(
            f"{ranks.world_size} processes were launched, but only the adjoint engine splits a model over processes "
            f"(layer groups); pass --engine adjoint with an SSM model, or launch one process for --engine {engine}"
        )
