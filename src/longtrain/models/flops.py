"""Model FLOPs and MFU for causal decoders.

Model FLOPs per sample follow the usual convention, 6·s·P + 6·n·h·s²: 6 FLOPs per
matmul parameter per token (forward 2, backward 4) plus causal attention (QKᵀ and PV,
forward and backward, half the s×s square). Recomputation (checkpointing) does not
count: MFU measures useful work. A model's figures come from its description: a
mixture of experts counts the experts a token runs, not every expert it holds.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .adapters import describe_model
from .layers import unwrap

__all__ = [
    "active_matmul_parameters",
    "causal_lm_flops",
    "count_flops",
    "device_peak_flops",
    "matmul_parameters",
    "mfu",
    "model_flops_per_sample",
]

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def causal_lm_flops(seq_len: int, matmul_params: int, n_layers: int, attn_width: int) -> float:
    """FLOPs of one forward + backward over one sample of ``seq_len`` tokens."""
    return 6.0 * seq_len * matmul_params + 6.0 * n_layers * attn_width * seq_len**2


def matmul_parameters(model: nn.Module) -> int:
    """Parameters that take part in matmuls: weight matrices, except the input embedding
    table (a lookup). Norm weights and biases do no matmul. A head tied to the embedding
    table is counted once, as a matmul."""
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in unique.values() if p.dim() >= 2)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    return total if tied else total - embed.numel()


def active_matmul_parameters(model: nn.Module) -> int:
    """Matmul parameters one token multiplies by: all of them but the experts it is not routed to."""
    base = unwrap(model)
    return matmul_parameters(base) - describe_model(base.config).inactive_expert_parameters()


def model_flops_per_sample(model: nn.Module, seq_len: int) -> float:
    """Forward + backward FLOPs of one sample of ``seq_len`` tokens (the MFU convention)."""
    shape = describe_model(unwrap(model).config)
    return causal_lm_flops(seq_len, active_matmul_parameters(model), shape.layers, shape.attention_width)


def count_flops(fn, *args, **kwargs) -> tuple[int, object]:
    """Run ``fn`` under ``FlopCounterMode`` and return (FLOPs counted, fn's result).

    The counter sees matmuls and attention kernels that PyTorch registers formulas for;
    it counts attention as a full (non-causal) square.
    """
    with FlopCounterMode(display=False, custom_mapping=_cpu_flash_formulas()) as counter:
        result = fn(*args, **kwargs)
    return counter.get_total_flops(), result


def _cpu_flash_formulas() -> dict:
    """FLOP formulas for the CPU flash kernels our attention blocks call (and the
    simulator runs), which PyTorch counts only for its CUDA kernels: the same formula,
    halved for a causal call (a causal kernel skips the masked half, and whole-sequence
    causal attention must not look twice as expensive as the same attention in chunks).
    Passed to each counter, never registered process-wide."""
    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return {}

    def forward(query_shape, key_shape, value_shape, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query_shape, key_shape, value_shape) // (2 if is_causal else 1)

    def backward(grad_out_shape, query_shape, key_shape, value_shape, out_shape_, lse_shape, dropout_p=0.0,
                 is_causal=False, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape) // (2 if is_causal else 1)

    return {  # FlopCounterMode hands custom formulas the shapes of the arguments
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }


def device_peak_flops(device: torch.device | str) -> float | None:
    """Dense bf16 peak of a known CUDA device, or None (CPU, unknown GPU)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_BF16.items():
        if key in name:
            return peak
    return None


def mfu(flops: float, seconds: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization: achieved FLOP/s over the device's peak (None if unknown)."""
    if not peak_flops or seconds <= 0:
        return None
    return flops / seconds / peak_flops
