"""Float64 kept through the float32 casts of stock models, for the family check.

The family check compares longtrain's step with stock autograd on the same float64 model
to 1e-10. Hugging Face's norms, routers and some softmaxes cast their input to float32
whatever its dtype (``hidden_states.to(torch.float32)``, ``x.float()``,
``F.softmax(..., dtype=torch.float32)``), with no config setting that turns the cast off.
Identical inputs round identically, but a chunked engine sums attention in another
order, and float32 rounding of a 1e-16 difference would hide the method's own error. So
within :func:`float64_throughout` those three calls leave a float64 tensor in float64,
for the stock model and longtrain's alike; every other call, and every other dtype, is
untouched.

Why the three attributes are replaced for the duration of the block, and not
intercepted by a ``TorchFunctionMode``: the casts must keep float64 in the backward pass
too (a checkpointed layer's recomputation, the chunked engines' backward), and a function
mode is off there — ``Tensor.backward`` is itself a call the mode intercepts, and a mode
is inactive while its handler runs a call — and off on a thread started inside the block
(the tests run backward on one, as CUDA does). The attributes are the process's, so the
block is meant for a check or a test that owns the process while it runs, as ``longtrain
families`` does (one child process per family). Blocks nest; each restores what it
replaced.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

__all__ = ["float64_throughout"]


@contextlib.contextmanager
def float64_throughout() -> Iterator[None]:
    """Within the block, ``Tensor.to(torch.float32)``, ``Tensor.float()`` and
    ``F.softmax(..., dtype=torch.float32)`` leave float64 tensors in float64 (see the
    module). Other dtypes and every other call behave as without the block."""
    to, softmax = torch.Tensor.to, F.softmax

    def keep_float64(self, *args, **kwargs):
        wanted = kwargs.get("dtype", args[0] if args and isinstance(args[0], torch.dtype) else None)
        if wanted == torch.float32 and self.dtype == torch.float64:
            return self
        return to(self, *args, **kwargs)

    def float_keeping(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to(self, torch.float32)

    def softmax_keeping(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype)

    with _replaced(torch.Tensor, "to", keep_float64), _replaced(torch.Tensor, "float", float_keeping), \
            _replaced(F, "softmax", softmax_keeping):
        yield


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Callable) -> Iterator[None]:
    """``owner.name`` is ``value`` within the block. Afterwards the attribute is what it
    was: set back where ``owner`` held it itself, removed where it was inherited (a
    method of ``torch.Tensor``'s C base class), so lookups find the base's again."""
    own = name in vars(owner)
    original = vars(owner)[name] if own else None
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
