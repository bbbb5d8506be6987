"""Ulysses sequence parallelism: each of P ranks holds 1/P of the tokens; around attention
an all-to-all swaps sequence shards for head shards, so every rank attends over the whole
sequence for its share of the heads (the FPDT paper §3, DeepSpeed Ulysses).

Without the limits users meet in other tools:

- **any head count** (:class:`HeadLayout`): query heads are split as evenly as P allows
  (heads not divisible by P give some ranks one more); each rank receives the K/V heads
  its query heads read, so with fewer K/V heads than ranks a K/V head goes to several
  ranks (and its gradient comes back summed); where a rank's query heads do not form
  equal groups over its K/V heads, its K/V heads are repeated to one per query head;
- **any length** (:class:`ShardLayout`): the sequence is padded to a multiple of P (or of
  P chunks) with tokens that carry no loss at its end — a dead end nothing attends to;
- **chunks after the all-to-all** (FPDT): for the chunked engines a rank holds global
  chunks r, r+P, r+2P, … of C tokens, so gathering local chunk i from every rank yields
  the contiguous global chunk [iPC, (i+1)PC).

The all-to-alls are autograd functions on ``all_to_all_single`` with split sizes, so they
run on NCCL and on gloo; :class:`SimulatedCollectives` stands in for them when one
rank's share is simulated on fake tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Collectives", "HeadLayout", "ShardLayout", "SimulatedCollectives", "heads_to_sequence", "sequence_to_heads"]


@dataclass(frozen=True)
class HeadLayout:
    """Which query and K/V heads each of ``degree`` ranks attends for (``rank`` is this one)."""

    heads: int
    kv_heads: int
    degree: int
    rank: int

    def q_heads(self, r: int) -> range:
        size, extra = divmod(self.heads, self.degree)
        start = r * size + min(r, extra)
        return range(start, start + size + (r < extra))

    def kv_heads_of(self, r: int) -> range:
        """The K/V heads rank ``r``'s query heads read (empty if it has no query head)."""
        q = self.q_heads(r)
        if not len(q):
            return range(0)
        group = self.heads // self.kv_heads
        return range(q.start // group, (q.stop - 1) // group + 1)

    def local_kv_index(self) -> list[int] | None:
        """For this rank: None when its query heads form equal consecutive groups over its
        K/V heads (grouped attention as it is); else, for each local query head, the
        index of its K/V head among the local ones (K/V heads are then repeated)."""
        q, kv = self.q_heads(self.rank), self.kv_heads_of(self.rank)
        group = self.heads // self.kv_heads
        index = [h // group - kv.start for h in q]
        counts = [index.count(j) for j in range(len(kv))]
        if len(set(counts)) == 1 and counts[0] > 0:
            return None
        return index


@dataclass(frozen=True)
class ShardLayout:
    """Which tokens of a (padded) sequence each rank holds.

    ``chunk`` None: rank r holds the contiguous shard r of ``padded // degree`` tokens.
    ``chunk`` C: the sequence is cut into global chunks of C tokens and rank r holds
    global chunks r, r + P, r + 2P, … (its local chunk i is global chunk iP + r).
    """

    length: int  # tokens of the real sequence
    degree: int
    chunk: int | None = None

    @property
    def padded(self) -> int:
        unit = self.degree * (self.chunk or 1)
        return math.ceil(self.length / unit) * unit

    @property
    def local_length(self) -> int:
        return self.padded // self.degree

    def local_positions(self, rank: int, device=None) -> torch.Tensor:
        """Indices into the padded sequence of rank ``rank``'s tokens, in local order."""
        n = self.local_length
        if self.chunk is None:
            return torch.arange(rank * n, (rank + 1) * n, device=device)
        c = self.chunk
        local = torch.arange(n, device=device)
        return (local // c) * (self.degree * c) + rank * c + local % c

    def gathered_bounds(self) -> list[tuple[int, int]]:
        """The global chunks an all-to-all of local chunk i gathers (the whole padded
        sequence when unchunked)."""
        span = self.degree * (self.chunk or self.local_length)
        return [(a, a + span) for a in range(0, self.padded, span)]


class Collectives:
    """The all-to-all of one sequence-parallel group (real processes)."""

    def __init__(self, group, degree: int, rank: int):
        self.group, self.degree, self.rank = group, degree, rank

    def all_to_all(self, send: list[torch.Tensor], receive_shapes: list[tuple]) -> list[torch.Tensor]:
        """Send ``send[j]`` to rank j; return what each rank i sent here, shaped ``receive_shapes[i]``."""
        flat = torch.cat([t.reshape(-1) for t in send])
        sizes_in = [t.numel() for t in send]
        sizes_out = [math.prod(s) for s in receive_shapes]
        out = flat.new_empty(sum(sizes_out))
        dist.all_to_all_single(out, flat, sizes_out, sizes_in, group=self.group)
        return [piece.view(shape) for piece, shape in zip(out.split(sizes_out), receive_shapes)]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor


class SimulatedCollectives(Collectives):
    """One rank's share of a group, for the simulator: the same shapes, no communication
    (values do not matter on fake tensors)."""

    def __init__(self, degree: int, rank: int = 0):
        super().__init__(None, degree, rank)

    def all_to_all(self, send, receive_shapes):
        return [send[0].new_empty(shape) for shape in receive_shapes]

    def all_reduce(self, tensor):
        return tensor


def _heads_to_sequence(x: torch.Tensor, layout: HeadLayout, kv: bool, comm: Collectives, heads_total: int) -> torch.Tensor:
    """(B, |heads of this rank|, S, D) over the whole sequence -> (B, heads_total, S_local, D)
    for this rank's tokens: the inverse all-to-all. Heads that several ranks held (K/V
    heads replicated to several ranks) are summed — the backward of replication."""
    heads_of = layout.kv_heads_of if kv else layout.q_heads
    b, _, s, d = x.shape
    local = s // comm.degree
    send = [x[:, :, i * local:(i + 1) * local] for i in range(comm.degree)]
    received = comm.all_to_all(send, [(b, len(heads_of(j)), local, d) for j in range(comm.degree)])
    out = x.new_zeros(b, heads_total, local, d)
    for j, piece in enumerate(received):
        heads = heads_of(j)
        if len(heads):
            out[:, heads.start:heads.stop] += piece
    return out


def _sequence_to_heads(x: torch.Tensor, layout: HeadLayout, kv: bool, comm: Collectives) -> torch.Tensor:
    """(B, H_x, S_local, D) for this rank's tokens -> (B, |heads of this rank|, S, D) over the
    whole sequence (local shards concatenated in rank order)."""
    heads_of = layout.kv_heads_of if kv else layout.q_heads
    b, _, local, d = x.shape
    mine = heads_of(comm.rank)
    send = [x[:, heads_of(j).start:heads_of(j).stop] for j in range(comm.degree)]
    received = comm.all_to_all(send, [(b, len(mine), local, d)] * comm.degree)
    return torch.cat(received, dim=2)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout, kv, comm):
        ctx.layout, ctx.kv, ctx.comm, ctx.heads = layout, kv, comm, x.shape[1]
        return _sequence_to_heads(x, layout, kv, comm)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad.contiguous(), ctx.layout, ctx.kv, ctx.comm, ctx.heads), None, None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout, comm, heads):
        ctx.layout, ctx.comm = layout, comm
        return _heads_to_sequence(x, layout, False, comm, heads)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad.contiguous(), ctx.layout, False, ctx.comm), None, None, None


def sequence_to_heads(x: torch.Tensor, layout: HeadLayout, comm: Collectives, kv: bool = False) -> torch.Tensor:
    """All-to-all: this rank's tokens, all heads -> the whole sequence, this rank's heads."""
    return _SequenceToHeads.apply(x, layout, kv, comm)


def heads_to_sequence(x: torch.Tensor, layout: HeadLayout, comm: Collectives) -> torch.Tensor:
    """All-to-all back: the whole sequence, this rank's query heads -> this rank's tokens, all heads."""
    return _HeadsToSequence.apply(x, layout, comm, layout.heads)
