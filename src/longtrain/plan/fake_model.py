"""The model a simulation runs: fake tensors, LoRA adapters, and 4-bit bases.

A 4-bit base is held as bitsandbytes holds it (``BitsAndBytesConfig(load_in_4bit=True)``):
every ``nn.Linear`` but the LM head becomes a ``Linear4bit`` whose weight is packed two
values to a byte, with a float32 scale per block of 64 values (with
``bnb_4bit_use_double_quant``, an 8-bit scale per block and a float32 one per 256 blocks).
Its training matmul (``MatMul4Bit``) dequantizes the whole weight into the input's dtype
for the forward, again for the input's gradient, and saves only the packed weight.
:class:`SimulatedLinear4bit` is that on fake tensors: the packed bytes and scales as its
(frozen) parameters, the dequantized weight a transient of each call. Experts held as 3-D
parameters (a mixture of experts in Transformers 5) are no ``nn.Linear``: they stay in the
model's dtype, as bitsandbytes leaves them. A 4-bit base trains LoRA adapters only.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from ..errors import LongtrainError
from ..models.adapters import adapter_class, describe_model
from ..models.loading import add_lora, build_from_config

__all__ = ["SimulatedLinear4bit", "build_fake_model", "four_bit_weight_bytes", "hold_in_4bit", "represented_parameters",
           "with_4bit_base"]

_BLOCK, _SCALE_BLOCKS = 64, 256  # bitsandbytes' 4-bit block size; blocks per float32 scale of double quantization


def with_4bit_base(config: PretrainedConfig, double_quant: bool = False) -> PretrainedConfig:
    """``config`` saying its base is held in NF4 by bitsandbytes (the ``quantization_config``
    ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` records)."""
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_use_double_quant": double_quant, "bnb_4bit_compute_dtype": "bfloat16"}
    return config


class _Dequantized(torch.autograd.Function):
    """``x @ W.T + b`` with ``W`` dequantized whole for the call and again for the input's
    gradient; only the packed weight is kept between them (bitsandbytes' ``MatMul4Bit``)."""

    @staticmethod
    def forward(ctx, x, packed, bias, shape):
        ctx.shape = shape
        ctx.save_for_backward(packed)
        weight = torch.empty(shape, dtype=x.dtype, device=x.device)  # the dequantized weight (the simulator's values)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        weight = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        return grad @ weight, None, None, None


class SimulatedLinear4bit(nn.Module):
    """A frozen linear layer held in 4 bits, for the simulator only (its values are
    undefined): the bytes and transients of bitsandbytes' ``Linear4bit`` (module docstring)."""

    def __init__(self, linear: nn.Linear, double_quant: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        values = linear.in_features * linear.out_features
        device = linear.weight.device
        self.packed = nn.Parameter(torch.empty((-(-values // 2), 1), dtype=torch.uint8, device=device),
                                   requires_grad=False)
        blocks = -(-values // _BLOCK)
        scales = ((blocks, torch.uint8), (-(-blocks // _SCALE_BLOCKS), torch.float32)) if double_quant else \
            ((blocks, torch.float32),)
        self.scales = nn.ParameterList([nn.Parameter(torch.empty(n, dtype=dtype, device=device), requires_grad=False)
                                        for n, dtype in scales])
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.packed.represents = values  # the parameter count it stands for (the scales: none)
        for scale in self.scales:
            scale.represents = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _Dequantized.apply(x, self.packed, bias, (self.out_features, self.in_features))


def hold_in_4bit(model: nn.Module, double_quant: bool) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` but the LM head and LoRA's own adapters by
    :class:`SimulatedLinear4bit` (as bitsandbytes' loader replaces them)."""
    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            lora = any(part.startswith("lora_") for part in f"{name}.{child_name}".split("."))
            if type(child) is nn.Linear and child is not head and not lora:
                setattr(module, child_name, SimulatedLinear4bit(child, double_quant))
    return model


def build_fake_model(config: PretrainedConfig, dtype: torch.dtype, lora_rank: int | None = None) -> nn.Module:
    """The model of ``config`` for a simulation, with LoRA adapters of ``lora_rank`` when
    given, over a 4-bit base where the config says so; call it under ``FakeTensorMode``.

    Without LoRA the model is built in the fake mode directly. peft cannot add adapters
    there: it moves each new adapter to its base layer's device and dtype with
    ``Module.to``, and PyTorch swaps every fake parameter for its converted copy with
    ``torch.utils.swap_tensors`` — even when the copy is the tensor itself — which refuses
    tensors that the fake mode holds weak references to. So with LoRA the model and its
    adapters are built on the meta device (peft leaves meta adapters where they are; they
    are created in the default dtype, which :func:`run_training_steps` sets to the
    model's, as peft's move would), and every parameter and buffer is then replaced by a
    fake tensor of its shape, dtype and ``requires_grad`` — shared ones (tied embeddings)
    stay shared.

    A mixture of experts is simulated in bfloat16 only: its experts run as one grouped
    matmul, whose kernel takes bfloat16 alone on a GPU and in the fake mode (the
    one-by-one loop it has besides reads the routing's values, which fake tensors lack).
    """
    if dtype != torch.bfloat16 and describe_model(config).is_moe:
        raise LongtrainError(f"the simulator runs a mixture of experts ({config.model_type}) in bfloat16 only (its "
                             f"grouped-matmul kernel takes no {str(dtype).replace('torch.', '')}); simulate with "
                             "--dtype bfloat16")
    adapter = adapter_class(config.model_type)
    four_bit = adapter.base_bits(config) == 4
    if four_bit and not lora_rank:
        raise LongtrainError("a 4-bit base trains LoRA adapters only (its weights are frozen bytes); add --lora")
    if not lora_rank:
        return build_from_config(config, dtype)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("meta"):
        model = add_lora(build_from_config(config, dtype), rank=lora_rank)
    model = _meta_to_fake(model)
    return hold_in_4bit(model, adapter.double_quantized(config)) if four_bit else model


def four_bit_weight_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int | None:
    """The bytes of ``config``'s weights where its base is held in 4 bits (built on the meta
    device: nothing allocated), else None (the weights are their count times the dtype's size)."""
    adapter = adapter_class(config.model_type)
    if adapter.base_bits(config) != 4:
        return None
    with torch.device("meta"):
        model = hold_in_4bit(build_from_config(config, dtype), adapter.double_quantized(config))
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in unique)


def represented_parameters(model: nn.Module) -> int:
    """The parameter count ``model`` stands for (a 4-bit layer's packed bytes count as the
    values they hold; shared parameters once)."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(getattr(p, "represents", p.numel()) for p in unique)


def _meta_to_fake(model: nn.Module, device: str = "cpu") -> nn.Module:
    """Replace the meta parameters and buffers of ``model`` by (fake) tensors on ``device``."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                new = done.get(id(tensor))
                if new is None:
                    new = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    if isinstance(tensor, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                    done[id(tensor)] = new
                table[name] = new
    return model
