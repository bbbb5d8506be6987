"""What ``stream`` installs: each decoder layer's frozen parameters moved to host memory
(:class:`~longtrain.memory.weight_stream.WeightStream`), and a forward pre-hook and hook
on every module of the layer that owns some, which put the layer's weights on the device
and push the hooks that keep them out of the autograd graph while the module runs — in
the forward and in any recomputation alike."""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ...errors import LongtrainError
from ...memory.tracker import host_state_of
from ...memory.weight_stream import WeightStream
from .options import StreamOptions


def _streamable(param: torch.nn.Parameter) -> bool:
    """A frozen parameter held as a plain tensor (a quantized base's packed weights, a
    subclass with its own storage layout, stays where it is)."""
    return not param.requires_grad and (type(param) is torch.nn.Parameter or isinstance(param, FakeTensor))


def frozen_groups(layers) -> list[list[torch.nn.Parameter]]:
    """Each layer's frozen, plainly stored parameters, in the layer's own order."""
    seen: set[int] = set()
    groups = []
    for layer in layers:
        group = []
        for param in layer.parameters():
            if id(param) in seen:
                raise LongtrainError("stream moves each layer's own frozen weights to host memory, and a parameter is "
                                     "shared between decoder layers; drop stream for this model")
            seen.add(id(param))
            if _streamable(param):
                group.append(param)
        groups.append(group)
    return groups


def _holders(layer, group: list[torch.nn.Parameter]) -> list[torch.nn.Module]:
    """Every module of ``layer`` holding some of ``group`` in its subtree: the layer itself
    and each module down to the owners. Not only the owners: a wrapper may read its inner
    module's weight before calling it (peft's LoRA over an expert's 3-D parameters adds its
    delta to the weight first), and a recomputation may enter the layer below its top."""
    ids = {id(p) for p in group}
    return [m for m in layer.modules() if any(id(p) in ids for p in m.parameters())]


def install_stream(context, options: StreamOptions) -> WeightStream:
    layers = context.adapter.layers
    groups = frozen_groups(layers)
    if not any(groups):
        raise LongtrainError("stream keeps frozen weights in host memory, and every decoder-layer weight of this model "
                             "trains; drop stream (it serves LoRA and frozen experts)")
    device = next(p.device for group in groups for p in group)
    stream = WeightStream(groups, device, ahead=options.ahead)
    for index, (layer, group) in enumerate(zip(layers, groups)):
        for module in _holders(layer, group):
            module.register_forward_pre_hook(functools.partial(_enter, stream, index))
            module.register_forward_hook(functools.partial(_leave, stream), always_call=True)
    host_state_of(context.model).append(stream.host_tensors)
    context.host_held += sum(t.nbytes for t in stream.host_tensors())  # out of every default host budget
    context.weight_stream = stream
    return stream


def _enter(stream: WeightStream, group: int, module, args) -> None:
    stream.entering(group)


def _leave(stream: WeightStream, module, args, output) -> None:
    stream.leaving()
