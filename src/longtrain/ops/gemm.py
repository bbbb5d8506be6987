"""``acc += a @ b`` into a gradient sum, as one GEMM where the device has it.

A weight gradient summed over tiles or chunks of tokens (the chunked head's, the tiled
MLP's) is a sum of products, one per tile. For a half-precision weight the sum is kept
in float32 and rounded once (each bf16 rounding of a running sum adds error that grows
with the tile count). Formed as a bf16 product per tile and then added, every tile
writes and reads a weight-sized temporary and reads and writes the float32 sum once more
outside the GEMM: for Llama-3-8B's MLP, about a third of the weight-gradient GEMM's own
time per tile (estimated from bytes and FLOPs, not measured). On CUDA one GEMM reads the
bf16 operands and accumulates into the float32 buffer in place (``addmm(out_dtype=float32)``,
cuBLAS at tensor-core speed), and a simulation (fake tensors) plans exactly that.
"""

from __future__ import annotations

import warnings

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["add_product", "addmm_fallback_devices"]

_dtype_addmm_fails: set[torch.device] = set()  # devices whose addmm refused out_dtype


def addmm_fallback_devices() -> frozenset[torch.device]:
    """The devices where :func:`add_product` fell back to a product in the inputs' dtype
    because ``addmm`` refused ``out_dtype`` (empty where the float32-accumulating GEMM ran)."""
    return frozenset(_dtype_addmm_fails)


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` as one GEMM per call. Half-precision ``a``/``b`` into a float32
    ``acc``: on CUDA the GEMM reads bf16/fp16 and accumulates into the float32 buffer in
    place; elsewhere the product is formed in the input dtype and added (one rounding per
    call). Same dtypes: ``addmm_`` in place everywhere."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if is_fake(acc):
        # A simulation plans a GPU: the CUDA GEMM adds into the buffer in place, allocating
        # nothing (the CPU's product would add 1 GiB for Llama-3-8B's head). Not run: fake
        # tensors in PyTorch before 2.12 cannot (a decomposition read out_dtype as beta).
        if a.shape[1] != b.shape[0] or acc.shape != (a.shape[0], b.shape[1]):
            raise RuntimeError(f"addmm shapes {tuple(a.shape)} @ {tuple(b.shape)} into {tuple(acc.shape)}")
        return
    if acc.device.type == "cuda" and acc.device not in _dtype_addmm_fails:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except torch.OutOfMemoryError:  # not a missing GEMM: the step is out of memory
            raise
        except (RuntimeError, TypeError) as error:  # an older PyTorch without the out_dtype GEMM
            _dtype_addmm_fails.add(acc.device)
            warnings.warn(f"addmm with out_dtype={acc.dtype} is not available on {acc.device} ({error}); weight "
                          "gradients summed over tiles are formed tile by tile and added instead", stacklevel=2)
    acc += a @ b
