"""Ulysses sequence parallelism for the engines: ``Strategy(sequence_parallel=UlyssesOptions(degree=P))``.

Under ``torchrun``, each group of P consecutive ranks shares one sequence (every rank
of the group reads the same batch; the rest of the world is data parallel). An engine
asks :class:`SequenceParallel` for three things:

- :meth:`SequenceParallel.shard` (through :func:`~longtrain.engines.batch.shard_sequence`):
  its tokens. Labels were shifted on the whole sequence first; position ids stay global;
  the sequence is padded to a multiple of P (or of P chunks) with tokens that carry no
  loss at its end; the chunked engines get global chunks r, r+P, … (FPDT: chunk, then
  all-to-all, and the gathered chunk is contiguous);
- :meth:`SequenceParallel.attention`: the layer's attention call wrapped in the
  all-to-alls (:mod:`longtrain.parallel.ulysses`), so attention — whole-sequence or
  chunked, with the whole sequence's documents and padding — runs over every token for
  this rank's heads;
- :meth:`SequenceParallel.reduce_loss`: the loss. Each rank's loss is its token losses
  divided by the label count of the whole step on every rank (every data-parallel
  group's), so the gradients summed over all ranks are the gradient of the mean, and
  ``lt.step`` returns the same number everywhere.

Parameters, gradients and optimizer state are sharded over all ranks with FSDP2
(:mod:`longtrain.parallel.fsdp`), gradients summed (not averaged) in the reduction.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import validate
from ..errors import LongtrainError
from ..models.adapters import describe_model
from ..models.attention import AttentionCall
from ..parallel.distributed import sequence_groups, sum_over_data_parallel
from ..parallel.ulysses import (
    Collectives,
    HeadLayout,
    ShardLayout,
    SimulatedCollectives,
    heads_to_sequence,
    sequence_to_heads,
)

__all__ = ["SequenceParallel", "UlyssesOptions", "distribute"]

_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass
class UlyssesOptions:
    """Knobs of Ulysses sequence parallelism."""

    degree: int = 2  # ranks sharing one sequence (the world size or a divisor of it; the rest is data parallel)
    compute_dtype: str | None = None  # FSDP2 mixed precision: parameters stay in their dtype, layers compute in this one
    # Processes FSDP2 shards over: the degree times the data-parallel groups (what a simulation
    # stands in for; a run shards over its world and refuses another count). None: the degree.
    processes: int | None = None

    def __post_init__(self):
        validate.positive_int("sequence_parallel", "degree", self.degree)
        if self.processes is not None:
            validate.positive_int("sequence_parallel", "processes", self.processes)
            if self.processes % self.degree:
                raise LongtrainError(f"sequence_parallel processes ({self.processes}) must be a multiple of its degree "
                                     f"({self.degree}): groups of {self.degree} processes, each sharing one sequence")
        if self.compute_dtype is not None and self.compute_dtype not in _DTYPES:
            raise LongtrainError(f"sequence_parallel compute_dtype must be one of {', '.join(_DTYPES)}, got {self.compute_dtype!r}")


class UlyssesAttention(AttentionCall):
    """``inner`` (an attention call over the whole sequence, or a gathered chunk) behind
    the all-to-alls: this rank's tokens and all heads in, the same out."""

    def __init__(self, inner: AttentionCall, sp: "SequenceParallel"):
        self.inner, self.sp, self.mask, self.rows = inner, sp, inner.mask, inner.rows

    def attend(self, module, q, k, v, *, scale, window, softcap, sink=None):
        sp = self.sp
        q = sequence_to_heads(q, sp.heads, sp.comm)
        k = sequence_to_heads(k, sp.heads, sp.comm, kv=True)
        v = sequence_to_heads(v, sp.heads, sp.comm, kv=True)
        if sp.kv_index is not None:  # this rank's query heads do not group evenly over its K/V heads
            k, v = k[:, sp.kv_index], v[:, sp.kv_index]
        if sink is not None:  # this rank's query heads' sinks
            sink = sink[list(sp.heads.q_heads(sp.rank))]
        out = q if q.shape[1] == 0 else self.inner.attend(module, q, k, v, scale=scale, window=window, softcap=softcap,
                                                          sink=sink)
        return heads_to_sequence(out, sp.heads, sp.comm)


class SequenceParallel:
    """This rank's place in its sequence-parallel group (see the module docstring)."""

    def __init__(self, options: UlyssesOptions, config, comm: Collectives):
        self.options = options
        self.degree, self.rank, self.comm = options.degree, comm.rank, comm
        shape = describe_model(config)
        self.heads = HeadLayout(shape.heads, shape.kv_heads, self.degree, self.rank)
        self.kv_index = self.heads.local_kv_index()
        self.simulated = isinstance(comm, SimulatedCollectives)
        self.fsdp_root = None  # the FSDP2 root over the model's units (parallel/fsdp.py)

    @classmethod
    def create(cls, options: UlyssesOptions, config, simulated: bool = False) -> "SequenceParallel":
        """Join (or, for the simulator, stand in for) the group of this rank."""
        if simulated:
            return cls(options, config, SimulatedCollectives(options.degree))
        if not dist.is_available() or not dist.is_initialized():
            raise LongtrainError(
                f"sequence parallelism over {options.degree} ranks needs {options.degree} processes: launch with "
                f"torchrun --nproc-per-node {options.degree} (the trainer initializes torch.distributed)"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if options.processes is not None and options.processes != world:
            raise LongtrainError(f"the strategy's sequence parallelism shards over {options.processes} processes, and "
                                 f"this run has {world}; launch {options.processes} processes, or drop processes")
        if world % options.degree:
            raise LongtrainError(
                f"--sp {options.degree} must divide the number of processes ({world}); the processes beyond one "
                "sequence-parallel group are data parallel"
            )
        mine = sequence_groups(options.degree)[rank // options.degree]
        return cls(options, config, Collectives(mine, options.degree, rank % options.degree))

    def layout(self, length: int, chunk: int | None) -> ShardLayout:
        return ShardLayout(length, self.degree, chunk)

    def attention(self, inner: AttentionCall) -> UlyssesAttention:
        return UlyssesAttention(inner, self)

    def global_label_count(self, count: int, given: bool, device) -> int:
        """The loss normalizer: the caller's count (which must already cover every data-
        parallel group), or this group's count summed over the data-parallel groups."""
        if given or self.simulated:
            return count
        return sum_over_data_parallel(count, self.degree, device)

    def check_same_batch(self, batch) -> None:
        """Every rank of a group must read the same batch; a mismatch (shapes, or the
        tokens' sum) is one clear line on every rank, not a hang inside an all-to-all."""
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
        if self.simulated or not isinstance(ids, torch.Tensor):
            return  # (a malformed batch gets its own error, the same on every rank)
        mine = torch.tensor([*ids.shape, int(ids.sum()) % (2**31)], dtype=torch.int64, device=ids.device)
        every = [torch.empty_like(mine) for _ in range(self.degree)]
        dist.all_gather(every, mine, group=self.comm.group)
        seen = [tuple(t.tolist()) for t in every]
        if len(set(seen)) > 1:
            other = next(r for r, v in enumerate(seen) if v != seen[0])
            raise LongtrainError(
                f"the ranks of a sequence-parallel group read different batches (rank 0: shape {seen[0][:2]}, rank "
                f"{other}: shape {seen[other][:2]}); every rank of a group must step on the same batch"
            )

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over this group's ranks (statistics each rank took of its tokens)."""
        if self.simulated:
            return values
        total = values.detach().clone()
        dist.all_reduce(total, group=self.comm.group)
        return total

    def random_stream(self, device: torch.device):
        """This process's own random numbers for the step (see :func:`rank_random_stream`);
        none taken on the simulator's stand-in."""
        return contextlib.nullcontext() if self.simulated else rank_random_stream(dist.get_rank(), device)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's share summed over all ranks: the loss of the whole step, everywhere."""
        if self.simulated:
            return loss
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total


@contextlib.contextmanager
def rank_random_stream(rank: int, device: torch.device):
    """Run the block on a random stream of this process's own, so that the processes
    sharing a sequence draw dropout masks for their tokens and heads that are independent
    along the sequence, as one process's are (not the masks one process would draw; with
    one stream, every process would draw the same ones). The stream is seeded from the
    shared generators plus the rank; they advance alike on every process and are put back
    after the block, so the processes stay in step; recomputation inside the block replays
    its draws as usual."""
    seed = int(torch.randint(2**62, (1,)))  # the same on every process: their generators are in step
    accelerator = device if device.type != "cpu" else None
    with torch.random.fork_rng(devices=[accelerator] if accelerator else [],
                               device_type=accelerator.type if accelerator else "cuda"):
        torch.default_generator.manual_seed(seed + rank)
        if accelerator is not None:
            module = torch.get_device_module(accelerator.type)
            with module.device(accelerator):
                module.manual_seed(seed + rank)
        yield


def distribute(context) -> None:
    """Join the sequence-parallel group and shard the model's parameters over all ranks
    (FSDP2): called by ``longtrain.apply`` after the techniques are installed. On fake
    tensors (the simulator, which runs a fake process group) one rank's share is built."""
    from torch._subclasses.fake_tensor import is_fake

    from ..models.loading import parse_dtype
    from ..parallel.fsdp import check_all_sharded, shard_parameters

    options: UlyssesOptions = context.strategy.sequence_parallel
    adapter = context.adapter
    first = next(adapter.base.parameters())
    simulated = is_fake(first)
    if simulated and not dist.is_initialized():
        raise LongtrainError("simulate sequence parallelism with longtrain.simulate(..., strategy=...) "
                             "(it stands in for the other ranks)")
    context.sequence_parallel = SequenceParallel.create(options, adapter.config, simulated)
    head = context.lm_head_module
    tied = head.head.weight is adapter.embeddings().weight if hasattr(head.head, "weight") else False
    ends = [[adapter.embeddings(), adapter.norm(), head]] if tied else [adapter.embeddings(), [adapter.norm(), head]]
    compute = parse_dtype(options.compute_dtype) if options.compute_dtype else None
    context.sequence_parallel.fsdp_root = shard_parameters(
        [*ends, *adapter.layers], [adapter.model, head], first.device.type, compute)
    check_all_sharded(adapter.model)
