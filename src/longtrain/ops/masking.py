"""What a query may see, beyond causality: one masking semantics for every attention path.

A batch of B rows of S tokens is described by a :class:`SequenceMask`:

- ``segments`` (B, S): the document of each token (non-decreasing along a row, as
  packed documents are); a query sees only keys of its own document;
- ``key_valid`` (B, S): False for keys no query may see (padding).

Causality and a sliding window come from positions (token indices), so the mask needs
no (S, S) tensor. A query row with no visible key gets output 0 — what PyTorch's SDPA
gives a fully masked row — on every path.

Whole-sequence attention over documents whose visible keys are each one contiguous run
(packed documents, left or right padding) needs no mask at all:
:func:`document_spans` lists them, and each document is one fused causal call (plus
one unmasked call for queries after its last valid key), with nothing to merge.

Chunked attention works block by block ((query chunk, key chunk) pairs). A
:class:`BlockPlanner` decides for each block whether it can be skipped (nothing
visible), run by a kernel's own causal or unmasked mode, or needs an explicit boolean
mask. A block that needs a mask and is longer than :data:`TILE` tokens on a side runs
as tiles of at most :data:`TILE` tokens (:meth:`BlockPlanner.tiles`), each decided the
same way, cut also where documents and padding start: a tile then lies inside one
document and one run of padding or valid keys, and is fused or skipped. Only tiles that
stay mixed (rows of a batch that disagree, a window's edge, many short documents) form
explicit scores, and those hold TILE² scores per head (128 MiB at 32 heads in float32)
where a whole 8K-token block would hold 8 GiB per tensor. The planner reads a small
per-chunk summary of the mask once (one host transfer per step), so blocks inside one
document and free of padding — nearly all of them — take the fast kernels. Under fake tensors (simulation) nothing can be read: every block that
might need a mask gets one, which never underestimates memory.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

__all__ = [
    "BlockPlanner",
    "DocumentSpans",
    "SequenceMask",
    "TILE",
    "TILE_CUTS",
    "document_spans",
    "segments_from_positions",
]


# Tokens per side of the tiles a masked block runs as (bounds its explicit scores).
TILE = 1024
# Document or padding starts inside one chunk up to which its tiles are cut there too
# (more: many short documents, whose tile pairs would cost more host work than masks).
TILE_CUTS = 8


@dataclass(frozen=True)
class SequenceMask:
    """Document boundaries and padding of a (B, S) batch; both None means plain causal."""

    segments: torch.Tensor | None = None  # (B, S) document ids, non-decreasing along a row
    key_valid: torch.Tensor | None = None  # (B, S) bool, False for keys nobody may see

    @property
    def trivial(self) -> bool:
        return self.segments is None and self.key_valid is None

    def narrow(self, start: int, end: int) -> "SequenceMask":
        """The same description for tokens ``start:end`` (a chunk of the sequence)."""
        return SequenceMask(
            None if self.segments is None else self.segments[:, start:end],
            None if self.key_valid is None else self.key_valid[:, start:end],
        )


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids from position ids: a document starts wherever the position does not
    follow its predecessor by one (Hugging Face's rule for packed sequences)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


# BlockPlanner decisions that need no mask: (skip, causal, mask).
_SKIP, _CAUSAL, _FULL = (True, False, None), (False, True, None), (False, False, None)


class BlockPlanner:
    """Per-block masking decisions for chunks ``bounds`` of a sequence with ``mask``."""

    def __init__(self, mask: SequenceMask | None, bounds: list[tuple[int, int]]):
        self.mask = mask if mask is not None and not mask.trivial else None
        self.bounds = bounds
        self._summary = self._summarize() if self.mask is not None else None
        self._refined: tuple[BlockPlanner, list[int]] | None = None  # TILE-token planner, made when first needed

    def _summarize(self):
        """(first segment, last segment) per row and chunk, and whether each chunk's keys
        are all valid — read in one transfer — or None when the mask cannot be read."""
        mask = self.mask
        reference = mask.segments if mask.segments is not None else mask.key_valid
        if _is_fake(reference):
            return None
        device = reference.device
        starts = torch.tensor([a for a, _ in self.bounds], device=device)
        lasts = torch.tensor([b - 1 for _, b in self.bounds], device=device)
        parts = []
        if mask.segments is not None:
            parts += [mask.segments[:, starts], mask.segments[:, lasts]]
        if mask.key_valid is not None:
            invalid = (~mask.key_valid).long().cumsum(-1)
            before = torch.where(starts > 0, invalid[:, (starts - 1).clamp(min=0)], 0)
            parts.append(((invalid[:, lasts] - before) == 0).all(0, keepdim=True).long().expand(mask.key_valid.shape[0], -1))
        rows = torch.cat(parts, dim=1).tolist()
        k = len(self.bounds)
        summary = {"first": None, "last": None, "valid": None}
        offset = 0
        if mask.segments is not None:
            summary["first"] = [r[0:k] for r in rows]
            summary["last"] = [r[k:2 * k] for r in rows]
            offset = 2 * k
        if mask.key_valid is not None:
            summary["valid"] = [bool(v) for v in rows[0][offset:offset + k]]
        return summary

    def plan(self, qi: int, ki: int, window: int | None, device: torch.device):
        """``(skip, causal, mask)`` for query chunk ``qi`` against key chunk ``ki``.

        ``skip``: no pair is allowed. ``causal``: the diagonal block with nothing else
        masked (the kernel's causal mode). ``mask``: a boolean (Cq, Ck) or (B, Cq, Ck)
        mask on ``device``, True where a query may attend, or None when every pair is
        allowed.
        """
        decision = self._decide(qi, ki, window)
        if decision in (_SKIP, _CAUSAL, _FULL):
            return decision
        (qa, qb), (ka, kb) = self.bounds[qi], self.bounds[ki]
        return False, False, self._dense(qa, qb, ka, kb, window, *decision, device)

    def _decide(self, qi: int, ki: int, window: int | None):
        """:meth:`plan`'s answer without building a mask: ``_SKIP``, ``_CAUSAL``, ``_FULL``,
        or ``(need_segments, need_keys)`` for a block that needs an explicit mask."""
        qa, qb = self.bounds[qi]
        ka, kb = self.bounds[ki]
        if ka > qb - 1 or (window is not None and qa - (kb - 1) >= window):
            return _SKIP  # every key after every query, or out of every query's window
        need_segments = need_keys = self.mask is not None
        summary = self._summary
        if summary is not None:
            if self.mask.segments is not None:
                first, last = summary["first"], summary["last"]
                if all(last[r][ki] < first[r][qi] for r in range(len(first))):
                    return _SKIP  # every key is in an earlier document
                need_segments = any(first[r][ki] != last[r][qi] for r in range(len(first)))
            else:
                need_segments = False
            need_keys = self.mask.key_valid is not None and not summary["valid"][ki]
        diagonal = (qa, qb) == (ka, kb)
        window_cuts = window is not None and (qb - 1) - ka >= window
        if not (need_segments or need_keys or window_cuts):
            if diagonal:
                return _CAUSAL
            if kb <= qa + 1:  # every key precedes every query
                return _FULL
        return need_segments, need_keys

    def kind(self, qi: int, ki: int, window: int | None):
        """What the memory of block ``(qi, ki)`` depends on, without building its mask: None
        when it is skipped; else its sides in tokens and its decision (causal, whole, or which
        mask it needs). Two blocks of one kind allocate and free the same tensors; a masked
        block cut into tiles (over :data:`TILE` tokens) is its own kind."""
        decision = self._decide(qi, ki, window)
        if decision is _SKIP:
            return None
        (qa, qb), (ka, kb) = self.bounds[qi], self.bounds[ki]
        if decision not in (_CAUSAL, _FULL) and max(qb - qa, kb - ka) > TILE:
            return qi, ki
        return qb - qa, kb - ka, decision

    def tiles(self, qi: int, ki: int, window: int | None, device: torch.device):
        """Block ``(qi, ki)`` as the sub-blocks to run, ``[((qa, qb), (ka, kb), causal,
        mask), ...]`` in token positions: nothing when it is skipped, the block itself when
        it needs no mask or is at most :data:`TILE` tokens on a side, else its tiles of
        :data:`TILE` tokens that are not skipped, each with its own decision (the mask
        summary of the tiles is read once per planner, at the first such block; no mask of
        the whole block is ever built)."""
        (qa, qb), (ka, kb) = self.bounds[qi], self.bounds[ki]
        decision = self._decide(qi, ki, window)
        if decision is _SKIP:
            return []
        if decision in (_CAUSAL, _FULL):
            return [((qa, qb), (ka, kb), decision[1], None)]
        if max(qb - qa, kb - ka) <= TILE:
            return [((qa, qb), (ka, kb), False, self._dense(qa, qb, ka, kb, window, *decision, device))]
        fine, first = self._tile_planner()
        tiles = []
        for fq in range(first[qi], first[qi + 1]):
            for fk in range(first[ki], first[ki + 1]):
                skip, causal, mask = fine.plan(fq, fk, window, device)
                if not skip:
                    tiles.append((fine.bounds[fq], fine.bounds[fk], causal, mask))
        return tiles

    def _tile_planner(self) -> tuple["BlockPlanner", list[int]]:
        """A planner over every chunk cut into tiles of at most TILE tokens — cut also where
        a document or a run of padding starts, when a chunk holds at most
        :data:`TILE_CUTS` of them, so that its tiles need no mask (one document, all
        valid or all padding: fused, or skipped) — and each chunk's first tile."""
        if self._refined is None:
            cuts = self._cut_points()
            bounds, first = [], [0]
            for a, b in self.bounds:
                inside = cuts[bisect.bisect_right(cuts, a):bisect.bisect_left(cuts, b)]
                points = {*range(a, b, TILE), b, *(inside if len(inside) <= TILE_CUTS else ())}
                points = sorted(points)
                bounds += list(zip(points, points[1:]))
                first.append(len(bounds))
            self._refined = (BlockPlanner(self.mask, bounds), first)
        return self._refined

    def _cut_points(self) -> list[int]:
        """Sorted positions where, in some row, a document or a run of (in)valid keys
        starts; none when the mask cannot be read. One host read."""
        mask = self.mask
        if mask is None:  # a window alone: nothing to cut at
            return []
        reference = mask.segments if mask.segments is not None else mask.key_valid
        if _is_fake(reference):
            return []
        change = torch.zeros(reference.shape[1] - 1, dtype=torch.bool, device=reference.device)
        for t in (mask.segments, mask.key_valid):
            if t is not None:
                change |= (t[:, 1:] != t[:, :-1]).any(0)
        return (torch.nonzero(change).flatten() + 1).tolist()

    def _dense(self, qa, qb, ka, kb, window, need_segments, need_keys, device):
        q_pos = torch.arange(qa, qb, device=device)
        k_pos = torch.arange(ka, kb, device=device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        if need_segments:
            seg = self.mask.segments
            allowed = allowed & (seg[:, qa:qb, None] == seg[:, None, ka:kb])
        if need_keys:
            allowed = allowed & self.mask.key_valid[:, None, ka:kb]
        return allowed


@dataclass(frozen=True)
class DocumentSpans:
    """Each row's documents as ``(row, first_key, end_keys, end)``: the queries of one
    document up to ``end`` see its valid keys ``first_key:end_keys`` (one contiguous run)
    causally; queries before ``first_key`` see nothing (output 0), queries from
    ``end_keys`` on see all of them. Documents without a valid key are left out (their
    queries give 0)."""

    spans: tuple[tuple[int, int, int, int], ...]
    reach: int  # the most tokens from a document's first valid key to its last query

    def fits_window(self, window: int | None) -> bool:
        """Whether a sliding window of ``window`` tokens hides nothing inside any span."""
        return window is None or self.reach <= window


def document_spans(mask: SequenceMask, limit: int) -> DocumentSpans | None:
    """The documents of ``mask`` as :class:`DocumentSpans`, read in one host transfer;
    None when a document's valid keys are not one contiguous run or when there are more
    than ``limit`` documents (many short ones are cheaper as masked blocks). A mask that
    cannot be read (fake tensors, in the simulator) gives the layout that holds the most
    memory: one document per row, all of it (a real run's documents are shorter, its
    other plan, masked blocks, holds less)."""
    reference = mask.segments if mask.segments is not None else mask.key_valid
    if reference is None:
        return None
    rows, length = reference.shape
    if _is_fake(reference):
        return DocumentSpans(tuple((row, 0, length, length) for row in range(rows)), length)
    columns = [t.long() for t in (mask.segments, mask.key_valid) if t is not None]
    both = torch.stack(columns).cpu()  # the one host transfer
    segments = both[0] if mask.segments is not None else torch.zeros(rows, length, dtype=torch.long)
    valid = both[-1].bool() if mask.key_valid is not None else torch.ones(rows, length, dtype=torch.bool)
    spans, reach = [], 0
    for row in range(rows):
        seg, ok = segments[row], valid[row]
        # Runs of equal (document, valid): at most invalid, valid, invalid per document.
        change = (seg[1:] != seg[:-1]) | (ok[1:] != ok[:-1])
        edges = [0] + (torch.nonzero(change).flatten() + 1).tolist() + [length]
        if len(edges) - 1 > 3 * limit:
            return None
        runs = [(a, b, int(seg[a]), bool(ok[a])) for a, b in zip(edges, edges[1:])]
        for _, document in itertools.groupby(runs, key=lambda run: run[2]):
            document = list(document)
            kept = [(a, b) for a, b, _, good in document if good]
            if len(kept) > 1:
                return None  # padding inside a document: masked blocks
            if kept:
                (first, end_keys), end = kept[0], document[-1][1]
                spans.append((row, first, end_keys, end))
                reach = max(reach, end - first)
                if len(spans) > limit:
                    return None
    return DocumentSpans(tuple(spans), reach)
