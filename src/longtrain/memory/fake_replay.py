"""FakeTensor's answers replayed: the simulator's ATen ops at a quarter of their cost.

The simulator runs a training step on fake tensors, and ``FakeTensorMode`` answers each
op with its outputs' metadata. It caches those answers itself, but its general machinery
(cache keys that cover symbolic sizes, sparse layouts and more) costs about 100 µs an op
on a CPU core: most of a simulation's time. An op's outputs depend only on its inputs'
metadata and its other arguments, so :func:`dispatch` sends the first call of each such
key through ``FakeTensorMode`` and records what came out — per output a fresh storage
(shape, stride, dtype, device), a view of an input (its offset, shape and stride), the
input itself (in place), or a plain value — and later calls with the same key are built
from the record directly.

Only what a record reproduces exactly is replayed. An op is answered by ``FakeTensorMode``
every time where another mode sits between the tracker and it, where the mode has symbolic
shapes or real tensors beside the fakes, in inference mode; when an argument is a tensor that
is not a plain ``FakeTensor`` of the active mode (a real tensor, a constant, another
subclass) or a value the key cannot hold (a device without its index); when it is not an ATen op,
resizes or re-points a storage, or writes an ``out=`` argument; when it changed an input's
metadata or storage; when its outputs include no tensor, a storage the record would not
rebuild byte for byte, two outputs sharing a new storage, or a view of a storage two inputs
share. tests/test_fake_replay.py compares replayed simulations with unreplayed ones to the byte.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig

__all__ = ["dispatch", "replaying"]

_RECORDS: dict = {}  # key -> tuple of output recipes, or _NEVER
_NEVER = object()  # the key's op is answered by FakeTensorMode every time
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_STORAGE_OPS = ("resize", "set_")  # ops whose effect depends on a storage's size, which no key holds
_ENABLED = [True]
_MOST_RECORDS = 500_000  # a few KB each: what a long-lived process keeps at most


class _Unkeyed(Exception):
    """An argument the key cannot hold: the op goes to FakeTensorMode unrecorded."""


def replaying(enabled: bool) -> None:
    """Turn replaying on or off (tests compare both; off, every op goes to FakeTensorMode)."""
    _ENABLED[0] = enabled


def dispatch(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)``, replayed from a record where there is one (module docstring).
    Called from a dispatch mode; replayed only where the one mode below it is FakeTensorMode
    (another mode there would not see a replayed op)."""
    if not _ENABLED[0] or getattr(func, "namespace", None) != "aten" or torch._C._len_torch_dispatch_stack() != 1:
        return func(*args, **kwargs)
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None or mode.shape_env is not None or getattr(mode, "propagate_real_tensors", False) \
            or torch.is_inference_mode_enabled():
        return func(*args, **kwargs)
    tensors: list[FakeTensor] = []
    try:
        key = _key(func, args, kwargs, mode, tensors)
    except _Unkeyed:
        return func(*args, **kwargs)
    record = _RECORDS.get(key)
    if record is _NEVER or not tensors:
        return func(*args, **kwargs)
    if record is not None:
        return _rebuilt(record, tensors)
    before = [_state(t) for t in tensors]
    out = func(*args, **kwargs)
    if len(_RECORDS) >= _MOST_RECORDS:  # a bound on what a long-lived process keeps
        _RECORDS.clear()
    _RECORDS[key] = _record(func, kwargs, out, tensors, before)
    return out


def _key(func, args: tuple, kwargs: dict, mode, tensors: list) -> tuple:
    parts = [func, torch.get_default_dtype(), mode.allow_fallback_kernels, mode.allow_non_fake_inputs]
    for value in args:
        _describe(value, parts, mode, tensors)
    for name, value in kwargs.items():
        parts.append(name)
        _describe(value, parts, mode, tensors)
    return tuple(parts)


def _describe(value, parts: list, mode, tensors: list) -> None:
    kind = type(value)
    if kind is FakeTensor:
        if value.fake_mode is not mode or value.constant is not None or value.layout is not torch.strided \
                or value.is_conj() or value.is_neg():
            raise _Unkeyed
        tensors.append(value)
        parts.append((value.shape, value.stride(), value.storage_offset(), value.dtype, value.fake_device,
                      value.requires_grad, value.is_inference()))
    elif kind is list or kind is tuple:
        parts.append((kind, len(value)))
        for item in value:
            _describe(item, parts, mode, tensors)
    elif kind is torch.device and value.index is None and value.type not in ("cpu", "meta"):
        raise _Unkeyed  # the current device of its kind, which no key holds
    elif kind in _PLAIN:
        parts.append((kind, value))
    else:  # a real or meta tensor, another subclass, a symbolic size, ...
        raise _Unkeyed


def _record(func, kwargs: dict, out, tensors: list, before: list):
    """(the container of ``out``, a recipe per output), or _NEVER (module docstring).
    ``before``: each input's :func:`_state` before the op."""
    name = func.__name__
    if "out" in kwargs or func._overloadname.startswith("out") or any(op in name for op in _STORAGE_OPS):
        return _NEVER
    if any(state != _state(t) for state, t in zip(before, tensors)):
        return _NEVER
    items = out if type(out) in (tuple, list) else (out,)
    recipes, fresh = [], set()
    for item in items:
        recipe = _recipe(item, tensors, fresh)
        if recipe is None:
            return _NEVER
        recipes.append(recipe)
    if not any(recipe[0] != "value" for recipe in recipes):
        return _NEVER
    return (type(out) if type(out) in (tuple, list) else None, tuple(recipes))


def _recipe(item, tensors: list, fresh: set):
    if type(item) in _PLAIN:
        return ("value", item)
    if type(item) is not FakeTensor or item.constant is not None or item.layout is not torch.strided \
            or item.is_conj() or item.is_neg():
        return None
    for i, tensor in enumerate(tensors):
        if item is tensor:
            return ("same", i)
    storage = item.untyped_storage()
    meta = (tuple(item.shape), item.stride(), item.dtype, item.fake_device, item.requires_grad)
    holders = [i for i, tensor in enumerate(tensors) if tensor.untyped_storage()._cdata == storage._cdata]
    if len(holders) > 1:  # which input it views would not follow from the key
        return None
    if holders:
        return ("view", holders[0], item.storage_offset(), *meta)
    if storage._cdata in fresh or item.storage_offset() != 0 or storage.nbytes() != _bytes(item.shape, item.stride(),
                                                                                            item.element_size()):
        return None
    fresh.add(storage._cdata)
    return ("fresh", *meta)


def _bytes(shape, stride, item: int) -> int:
    """What ``torch.empty_strided(shape, stride)`` allocates."""
    if any(size == 0 for size in shape):
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(shape, stride))) * item


def _state(tensor) -> tuple:
    """What an op must leave as it was for its record to be replayed: the tensor's metadata
    and its storage (which one, and its size)."""
    storage = tensor.untyped_storage()
    return (tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.fake_device,
            storage._cdata, storage.nbytes())


def _rebuilt(record, tensors: list):
    container, recipes = record
    mode = tensors[0].fake_mode
    outputs = []
    for recipe in recipes:
        kind = recipe[0]
        if kind == "value":
            outputs.append(recipe[1])
        elif kind == "same":
            outputs.append(tensors[recipe[1]])
        elif kind == "fresh":
            _, shape, stride, dtype, device, grad = recipe
            with torch._C._DisableTorchDispatch():
                meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            outputs.append(_fake(mode, meta, device, grad))
        else:
            _, i, offset, shape, stride, dtype, device, grad = recipe
            with torch._C._DisableTorchDispatch():
                meta = torch.empty((0,), dtype=dtype, device="meta")
                meta.set_(tensors[i].untyped_storage(), offset, shape, stride)
            outputs.append(_fake(mode, meta, device, grad))
    return outputs[0] if container is None else container(outputs)


# (mode, device, a FakeTensor's attributes as its constructor sets them): the last mode and device
# built for, replaced whole (a backward on another thread reads it whole, never half of two).
_TEMPLATE: list = [None]
_QUICK = [True]  # whether _fake builds FakeTensors itself (False where this torch builds them otherwise)


def _fake(mode, meta: torch.Tensor, device: torch.device, grad: bool) -> FakeTensor:
    """``FakeTensor(mode, meta, device)`` requiring grad if ``grad``, at a quarter of the
    constructor's cost: the subclass made from ``meta`` as the constructor makes it, and the
    attributes a constructed one has copied onto it. The first time for a mode and device,
    both ways are compared (attributes and dispatch keys); should they differ, the
    constructor builds every one."""
    if grad:
        meta.requires_grad_(True)
    if not _QUICK[0] or FakeTensorConfig.debug:  # in debug, each keeps the trace of its own creation
        return FakeTensor(mode, meta, device)
    template = _TEMPLATE[0]
    if template is not None and template[0] is mode and template[1] == device:
        return _quick(mode, meta, device, template[2])
    made = FakeTensor(mode, meta, device)
    attributes = dict(made.__dict__)
    try:
        quick = _quick(mode, meta, device, attributes)
        _QUICK[0] = (quick.__dict__ == made.__dict__ and type(quick) is type(made)
                     and torch._C._dispatch_keys(quick) == torch._C._dispatch_keys(made))
    except (AttributeError, TypeError, RuntimeError):
        _QUICK[0] = False
    _TEMPLATE[0] = (mode, device, attributes)
    return made


def _quick(mode, meta: torch.Tensor, device: torch.device, attributes: dict) -> FakeTensor:
    fake = torch.Tensor._make_subclass(FakeTensor, meta, meta.requires_grad, dispatch_device=True,
                                       device_for_backend_keys=device)
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(fake)
    else:
        torch._C._set_throw_on_mutable_data_ptr(fake)
    fake.__dict__.update(attributes)
    return fake
