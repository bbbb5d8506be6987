"""Attention outputs kept for backward: one mechanism for ``checkpoint``, ``memo`` and FPDT's ``keep_output``.

A layer recomputed in backward (checkpointing, Memo's token-wise recomputation, FPDT's
chunks) would run attention's forward again, the one op whose cost grows with the
sequence squared. Kept instead, attention's output and log-sum-exp — one hidden-state-
sized tensor per layer (per chunk) — let the recomputation hand them to attention's
backward (:func:`~longtrain.ops.causal_attention.attention_from_output`) without
attending again. The three strategies decide only *when* to keep (which layers, which
chunks) and call this module for the rest:

- :class:`KeptOutputStore` — the (output, LSE) pairs, by key (a layer, or (layer, chunk)),
  in a store with ``put``/``get``/``pop``/``prefetch`` (a
  :class:`~longtrain.memory.chunk_store.ChunkStore`: on the device or parked in host
  memory; Memo's layer record), fetched for backward and served as an attention node.
- :func:`attend_keeping` / :class:`RecordingAttention` — run an
  :class:`~longtrain.models.attention.AttentionCall` once and record (keep) its output;
  :class:`ReplayingAttention` — replay a kept output in place of attending.
- :func:`kept_layers_that_fit` — the one budget rule: how many layers' outputs fit in
  the host budget beside what is parked first.

Shapes: B batch rows, S tokens of the call (a sequence or a chunk), H query heads, D
head dimension; outputs (B, H, S, D), LSEs (B, H, S).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Hashable

import torch

from ..errors import LongtrainError
from ..ops.causal_attention import attention_from_output
from .attention import AttentionCall

__all__ = ["KeptOutputStore", "attend_keeping", "RecordingAttention", "ReplayingAttention", "kept_layers_that_fit"]


def kept_layers_that_fit(layers: int, budget: float | None, first: float, each: float) -> int:
    """How many of ``layers`` layers keep their attention output in host memory: as many as
    ``budget`` bytes hold at ``each`` bytes per layer beside ``first`` bytes parked first
    (what a recomputation cannot do without: checkpointed or chunk inputs, K/V). Every
    layer where the budget is unbounded (None, infinite); with nothing to keep per layer,
    every layer or none as ``first`` fits. Integer bytes give an exact count (the type of
    ``(budget - first) // each``, as each caller always had it).

    One rule, its sizes given by each caller (where they differ, they stay what each
    strategy has always counted):

    - checkpointing's plan (:func:`~longtrain.techniques.checkpoint.kept_output_share`):
      ``first`` every checkpointed input with ``offload_inputs``, ``each`` a bf16 output
      (heads × head dimension wide, 0 for attention-free models) and a float32 LSE;
    - checkpointing's step (``CheckpointLayers.has_room``, asked per layer with
      ``layers=1``): ``first`` what its store holds plus the inputs the layers above will
      park, ``each`` the layer's q-sized output and a float32 LSE (also in float64 steps);
    - Memo (:func:`~longtrain.techniques.memo.memo_alpha`): ``first`` the swapped layers'
      inputs, ``each`` the measured output and LSE; it refuses a step where not every
      swapped layer fits;
    - FPDT ``keep_output="fit"`` (:func:`~longtrain.engines.chunked.costs.outputs_that_fit`):
      ``first`` what the step parks with no output kept (K/V, inputs, rotary tables),
      ``each`` :func:`~longtrain.models.shapes.kept_output_bytes` at the step's item (bf16
      in the time model), at least 1.
    """
    if budget is None or budget == math.inf:
        return layers
    if each <= 0:
        return layers if first <= budget else 0
    return max(0, min(layers, (budget - first) // each))


class KeptOutputStore:
    """Attention outputs (B, H, S, D) and LSEs (B, H, S) kept by ``key`` in ``store``.

    ``store``: anything with ``put(key, tensor, offload=None)``, ``get``, ``pop`` and
    ``prefetch`` (a ChunkStore), or a function ``device -> store`` called when an output is
    kept (a store made on first use). ``offload``: passed to ``put`` (None: the store's
    default). ``layout="BSHD"`` keeps the output contiguous as (B, S, H, D) — the layout the
    layer's output projection reads next, so that what it saves is a view of the kept
    tensor (Memo) — and serves (B, H, S, D) views of it."""

    def __init__(self, store, *, offload: bool | None = None, layout: str = "BHSD"):
        if layout not in ("BHSD", "BSHD"):
            raise ValueError(f"layout must be 'BHSD' or 'BSHD', got {layout!r}")
        opens = callable(store) and not hasattr(store, "put")
        self._open: Callable[[torch.device], object] | None = store if opens else None
        self.store = None if opens else store
        self.offload, self.layout = offload, layout

    def _put(self, key, tensor):
        if self.offload is None:
            self.store.put(key, tensor)
        else:
            self.store.put(key, tensor, offload=self.offload)

    def keep(self, key: Hashable, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep ``out`` and ``lse`` under ``key``; returns them as kept (a (B, H, S, D) view
        of the kept output with ``layout="BSHD"``)."""
        if self._open is not None:
            self.store = self._open(out.device)
        if self.layout == "BSHD":
            out, lse = out.transpose(1, 2).contiguous(), lse.contiguous()  # (kernels may return a strided LSE)
        self._put(("out", key), out)
        self._put(("lse", key), lse)
        return (out.transpose(1, 2) if self.layout == "BSHD" else out), lse

    def fetch(self, key: Hashable, *, pop: bool = False, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(output (B, H, S, D), LSE (B, H, S)) kept under ``key``, on the device, from token
        ``start`` on; ``pop``: forgotten by the store (else read again by a second backward)."""
        take = self.store.pop if pop else self.store.get
        out, lse = take(("out", key)), take(("lse", key))
        if self.layout == "BSHD":
            out = out[:, start:].transpose(1, 2)
        elif start:
            out = out[:, :, start:]
        return out, (lse[:, :, start:] if start or self.layout == "BSHD" else lse)

    def prefetch(self, key: Hashable) -> None:
        """Start bringing ``key``'s output and LSE back to the device."""
        self.store.prefetch(("out", key))
        self.store.prefetch(("lse", key))

    def backward_of(self, backward: Callable | None) -> Callable | None:
        """``backward`` as a served output's node calls it (contiguous outputs for ``"BSHD"``)."""
        if backward is None or self.layout == "BHSD":
            return backward
        return functools.partial(_contiguous_backward, backward)

    def serve(self, key: Hashable, q, k, v, backward: Callable | None, *, pop: bool = False, start: int = 0,
              prefetch: Hashable | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
        """The kept output of ``key`` as the attention of q (B, H, S, D), k, v (B, H_kv, S, D):
        an autograd node whose backward is ``backward(grad_out, q, k, v, out, lse)`` (None: a
        stand-in never differentiated). ``prefetch``: the key served next, fetched meanwhile.
        ``sink``: the attention sinks the kept output includes (their gradient)."""
        out, lse = self.fetch(key, pop=pop, start=start)
        if prefetch is not None:
            self.prefetch(prefetch)
        return attention_from_output(q, k, v, out, lse, self.backward_of(backward), sink=sink)


def _contiguous_backward(backward, grad_out, q, k, v, out, lse):
    return backward(grad_out, q, k, v, out.contiguous(), lse)


def attend_keeping(call: AttentionCall, module, q, k, v, *, scale, window, softcap, kept: KeptOutputStore,
                   key: Hashable, sink: torch.Tensor | None = None) -> tuple[torch.Tensor, Callable]:
    """Attention of ``call`` run once (output and LSE without autograd), kept in ``kept``
    under ``key``: (the output as an attention node of q, k, v, its backward). Raises
    :class:`NotImplementedError` where ``call`` cannot give its output (chunked engines')."""
    out, lse, backward = call.attend_keeping_output(module, q, k, v, scale=scale, window=window, softcap=softcap,
                                                    sink=sink)
    out, lse = kept.keep(key, out, lse)
    backward = kept.backward_of(backward)
    return attention_from_output(q, k, v, out, lse, backward, sink=sink), backward


class RecordingAttention(AttentionCall):
    """An attention call that runs ``inner`` once and records its output and LSE in
    ``kept`` under ``key`` (the forward of a layer whose recomputation replays them);
    ``refusal``: the error where ``inner`` cannot give it (None: NotImplementedError)."""

    def __init__(self, inner: AttentionCall, kept: KeptOutputStore, key: Hashable, refusal: str | None = None):
        self.inner, self.kept, self.key, self.refusal, self.mask = inner, kept, key, refusal, inner.mask
        self.rows = inner.rows

    def attend(self, module, q, k, v, *, scale, window, softcap, sink=None):
        try:
            out, _ = attend_keeping(self.inner, module, q, k, v, scale=scale, window=window, softcap=softcap,
                                    kept=self.kept, key=self.key, sink=sink)
        except NotImplementedError:
            if self.refusal is None:
                raise
            raise LongtrainError(self.refusal) from None
        return out


class ReplayingAttention(AttentionCall):
    """An attention call that replays the output kept under ``key`` (tokens from ``start``)
    instead of attending: with ``backward``, to attention's backward; without, as the
    stand-in of a recomputation that is never differentiated."""

    def __init__(self, kept: KeptOutputStore, key: Hashable, mask, backward: Callable | None = None, start: int = 0):
        self.kept, self.key, self.mask, self.backward, self.start = kept, key, mask, backward, start

    def attend(self, module, q, k, v, *, scale, window, softcap, sink=None):
        return self.kept.serve(self.key, q, k, v, self.backward, start=self.start, sink=sink)
