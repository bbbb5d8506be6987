"""Parameter gradients summed over several backward calls in float32 and rounded once.

A chunked engine backpropagates a layer once per chunk, and autograd adds each call's
gradient into ``.grad`` in the parameter's dtype. For bf16 parameters every addition
rounds the running sum to 8 bits of mantissa, so the error grows with the chunk count:
against float64 on the CPU (tiny-llama, 2,048 tokens, FPDT in 64 chunks; docs/chunked_attention.md)
a bf16 sum puts the LM head's gradient 2.2× as far off as stock bf16 backprop's (one GEMM
over every token, rounded once), ``down_proj``'s and ``o_proj``'s 1.6×. Stock training only pays
that price across micro-batches; the chunks are one sequence.

:class:`Float32GradientSum` keeps the sum in float32 instead, as Megatron-LM's
``main_grad`` does: around a group of backward calls that reach the same parameters
(one FPDT layer over all its chunks; the final norm over the head's calls — the fused
LM head sums its own weight gradient over them in its float32 buffer,
:class:`~longtrain.ops.chunked_loss.GradientCarry`), each call's gradient
is taken out of ``.grad`` and added into a float32 buffer, and when the group ends the
buffer, plus what ``.grad`` held before (earlier micro-batches), is rounded once into
``.grad``. Each chunk's own gradient is still one GEMM rounded once, as stock's is, so
the result is as precise as stock's whatever the chunk count (tests/test_fpdt.py).

It costs a float32 copy of the group's parameters while the group runs (one layer's,
4 bytes per parameter), which the simulator sees, and nothing where the
parameters are float32 or float64 (their sums already are). Post-accumulate hooks
(optimizer offload) still fire once per call; the summed gradient is in ``.grad`` before
the backward of the next group, which is when they move a finished layer to the host.
"""

from __future__ import annotations

import torch

from ..memory.tracker import mark_gradient

__all__ = ["Float32GradientSum"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


class Float32GradientSum:
    """``with Float32GradientSum(params) as sums:`` run backward calls, each followed by
    ``sums.collect()``; on leaving, ``.grad`` holds what it held before plus every
    collected gradient, summed in float32 and rounded once. Parameters that are not
    trainable or not in bf16/fp16 are left to autograd, as are all of them when not
    ``enabled``."""

    def __init__(self, params, enabled: bool = True):
        unique = {id(p): p for p in params}.values() if enabled else ()
        self.params = [p for p in unique if p.requires_grad and p.dtype in LOW_PRECISION]
        self._before: list[torch.Tensor | None] = []
        self._sums: list[torch.Tensor | None] = []

    def __enter__(self) -> "Float32GradientSum":
        # What earlier micro-batches left stays aside, so that .grad holds one call's gradient at a time.
        self._before = [p.grad for p in self.params]
        self._sums = [None] * len(self.params)
        for p in self.params:
            p.grad = None
        return self

    def collect(self) -> None:
        """Move the gradient the last backward call left in ``.grad`` into the float32 sum."""
        for n, p in enumerate(self.params):
            grad = p.grad
            if grad is None:
                continue
            if self._sums[n] is None:
                self._sums[n] = grad.to(torch.float32)
                mark_gradient(self._sums[n])
            else:
                self._sums[n].add_(grad)
            p.grad = None

    def __exit__(self, *exc) -> None:
        # Also after an error: what was summed is not lost (autograd would have added it too).
        self.collect()
        for p, total, before in zip(self.params, self._sums, self._before):
            if total is None:
                p.grad = before
                continue
            if before is not None:
                total.add_(before)
            p.grad = total.to(p.dtype)
            mark_gradient(p.grad)
        self._before, self._sums = [], []
