"""Joining the processes of a run (``torchrun``) and failing clearly when one of them fails.

:func:`init_from_env` starts the default process group from torchrun's environment —
NCCL on CUDA, gloo on CPU — with a timeout on every collective, so a rank waiting for a
peer that died or hangs stops within it. :func:`collective_failures` turns such a
failure inside a step into one :class:`~longtrain.errors.LongtrainError` line naming the
rank; other errors keep their traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os

import torch
import torch.distributed as dist

from ..errors import LongtrainError

__all__ = [
    "collective_failures",
    "exit_process",
    "init_from_env",
    "is_peer_failure",
    "joined",
    "rank_device",
    "sequence_groups",
    "simulated_world",
    "sum_gradients",
    "sum_over_data_parallel",
]

DEFAULT_TIMEOUT_S = 600.0
_joined = False  # this process started a process group from torchrun's environment (init_from_env)
# What gloo and NCCL say when a peer died, hung or the network broke.
_PEER_FAILURE = ("Timed out", "timed out", "Connection reset", "Connection closed", "connection closed", "NCCL", "gloo",
                 "Broken pipe", "peer")


def init_from_env(device: torch.device | None = None, timeout_s: float | None = None) -> tuple[int, int]:
    """Initialize the default process group from torchrun's environment and return (rank,
    world size); a plain process is rank 0 of 1. ``timeout_s`` (default:
    ``LONGTRAIN_COLLECTIVE_TIMEOUT`` seconds, else 600) bounds every collective.

    On CUDA the process first makes its own GPU (``device``'s, see :func:`rank_device`)
    the current one — FSDP2, device meshes and NCCL's object collectives place tensors on
    the current device, which is otherwise GPU 0 on every rank — and the group has two
    backends: NCCL for CUDA tensors, gloo for CPU ones (scalars such as a gradient norm,
    pickled objects, barriers), so code that works under gloo on the CPU works here too."""
    global _joined
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    _joined = True
    if not dist.is_initialized():
        backend = "gloo"
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(rank_device(device))
            backend = "cpu:gloo,cuda:nccl"
        timeout = timeout_s if timeout_s is not None else float(os.environ.get("LONGTRAIN_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def sequence_groups(degree: int) -> list:
    """The process groups of ``degree`` consecutive ranks (created once per world: every
    rank creates every group, in the same order; a model applied again in the same run
    reuses them, and a group is never torn down while a model that used it is alive)."""
    return _sequence_groups(degree, dist.get_world_size(), id(dist.group.WORLD))


@functools.lru_cache(maxsize=None)
def _sequence_groups(degree: int, world: int, world_id: int) -> list:
    return [dist.new_group(list(range(first, first + degree))) for first in range(0, world, degree)]


def rank_device(device: torch.device) -> torch.device:
    """This process's CUDA device under torchrun: ``cuda:LOCAL_RANK`` (one GPU per process
    on each node). ``cuda:N`` is refused with several processes: every rank would take GPU N."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and device.index is not None and device.index != local:
        raise LongtrainError(f"--device {device} under torchrun would put every process on GPU {device.index}; "
                             f"use --device cuda (or auto): each process takes the GPU of its local rank")
    return torch.device("cuda", local if device.index is None else device.index)


def sum_over_data_parallel(count: int, degree: int, device) -> int:
    """A count each data-parallel group has its own of (its ``degree`` ranks hold the same
    one), summed over the groups."""
    if not dist.is_initialized() or dist.get_world_size() == degree:
        return count
    total = torch.tensor(float(count), dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return int(round(float(total) / degree))


_BUCKET_BYTES = 64 * 2**20  # gradients summed per collective: few calls, bounded extra memory


def sum_gradients(parameters, scale: float = 1.0) -> None:
    """Data parallelism: each trainable parameter's gradient summed over the processes of the
    default group (what DDP's reduction does, for a step that runs backward past DDP), then
    times ``scale`` — in buckets of at most 64 MiB per dtype (a larger gradient alone, in
    place), one collective each. A parameter without a gradient here takes zeros where
    another process has one; one without a gradient anywhere keeps none (the optimizer skips
    it, as it would in one process)."""
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    device = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    params = [p for p, flag in zip(params, has.tolist()) if flag]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: dict[tuple, list[torch.Tensor]] = {}  # in the same order on every process
    for p in params:
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_kind.values():
        bucket, size = [], 0
        for g in grads:
            if bucket and size + g.numel() * g.element_size() > _BUCKET_BYTES:
                _sum_bucket(bucket, scale)
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket:
            _sum_bucket(bucket, scale)


def _sum_bucket(grads: list[torch.Tensor], scale: float) -> None:
    """One collective for ``grads`` (one dtype and device): a lone gradient in place, several
    through one flat copy."""
    if len(grads) == 1 and grads[0].is_contiguous():
        dist.all_reduce(grads[0])
        if scale != 1.0:
            grads[0].mul_(scale)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def joined() -> bool:
    """Whether this process joined a run's process group (even one torn down since)."""
    return _joined or (dist.is_available() and dist.is_initialized())


def exit_process(code: int) -> None:
    """End this process with ``code``, after a failure or after the run's work (its
    checkpoints, final model and summary) is done. In a process that joined a process
    group the normal interpreter exit can abort inside the communication library's
    teardown ("terminate called without an active exception": after a failure when peers
    are gone, and even after a clean ``destroy_process_group`` when gloo's threads still
    hold a collective's work object, pytorch/pytorch#179291): leave at once, skipping
    interpreter finalization (checkpoints are committed atomically; nothing is lost)."""
    import sys

    if joined():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


# What NCCL says about this process's own misuse (two ranks on one GPU, bad arguments): not a peer's failure.
_OWN_FAULT = ("invalid usage", "ncclInvalidUsage", "ncclInvalidArgument", "Duplicate GPU")


def is_peer_failure(error: BaseException) -> bool:
    if any(s in str(error) for s in _OWN_FAULT):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _PEER_FAILURE)


@contextlib.contextmanager
def collective_failures(what: str):
    """Inside: a collective that fails because another process died, hung past the
    timeout or lost its connection becomes one line naming this rank."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised unless it is a peer failure
        if not is_peer_failure(error) or not dist.is_initialized():
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LongtrainError(
            f"rank {dist.get_rank()} of {dist.get_world_size()}: {what} stopped because another process failed, hung "
            f"or lost its connection ({first[:160]}); see the first error of the run, fix it and resume"
        ) from None


@contextlib.contextmanager
def simulated_world(world_size: int, device_type: str = "cpu"):
    """A stand-in process group of ``world_size`` ranks, this process being rank 0: no
    processes, no communication (PyTorch's fake backend), so one rank's share of a
    sharded model can be simulated on fake tensors. Enter it before any fake tensor mode."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .fsdp import forget_meshes, world_mesh

    if dist.is_initialized():
        raise LongtrainError("cannot simulate sequence parallelism inside a distributed run; simulate from one process")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        world_mesh(device_type)  # the mesh must exist before fake tensors do
        yield
    finally:
        forget_meshes()
        dist.destroy_process_group()
