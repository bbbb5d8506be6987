"""AdamW with its state — and fp32 master weights — in host memory (``--optimizer-offload``).

Full fine-tuning of an 8B model keeps 16 GiB of bf16 weights, 16 GiB of gradients and
32 GiB of bf16 AdamW moments on the device before any activation. ALST's single-GPU
recipe moves the optimizer to the CPU (DeepSpeed's CPU Adam); :class:`HostAdamW` does
the same with plain PyTorch:

- **state on the host**: each trainable parameter has a master copy in host memory
  (float32 for half-precision parameters: the moments and the update are computed at
  full precision, and the device copy is the master rounded) with AdamW's two moments
  beside it, updated by ``torch.optim.AdamW(fused=True)`` on the CPU — the fastest of
  PyTorch's CPU AdamW implementations (docs/planner.md has the measurement);
- **gradients streamed during backward**: a parameter's gradient is copied to a
  host buffer (in the parameter's dtype, pinned) as soon as backward has moved past the
  parameter's layer, and freed on the device, so the device holds about two layers'
  gradients instead of all of them. Backward visits layers from the top; a group
  (embeddings 0, decoder layer ``l`` at ``l + 1``, final norm and head at ``n + 1``) is
  complete once a gradient of a lower group arrives. Chunked engines accumulate a
  layer's gradient chunk by chunk, so a layer is never copied while its chunks are still
  running (the first layer's group waits for the end of backward: each chunk's backward
  runs on through the embeddings); a gradient that arrives for a group already copied (tied
  embeddings, SeCO's chunk-major order) is added to the host buffer, exactly but
  synchronously;
- **weights streamed back**: after the CPU step the masters are rounded into the (now
  free) pinned buffers and copied to the device on a side stream, in buckets, so the
  CPU's update of one bucket overlaps the copy of the previous one.

Clipping (``clip_grad_norm``) reads the host gradients, in float64, as the trainer's
clipping does on the device. With gradient accumulation only the last micro-batch
streams (:func:`streaming`): earlier ones accumulate on the device as usual, so the
result is that of AdamW on the summed gradient. Checkpoints hold the masters and the
moments: a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .memory.pinned import host_empty
from .memory.tracker import host_allocations

__all__ = ["HostAdamW", "parameter_groups", "streaming"]

# Masters of at most this many bytes are updated and copied back per bucket: large enough
# for the fused kernel to run at full speed, small enough to overlap with the copies.
BUCKET_BYTES = 256 * 2**20

# What a checkpoint without master weights means to an optimizer that keeps float32 masters.
NO_MASTERS = ("this optimizer state holds no master weights (its weights were their own: float32, or pure 16-bit "
              "AdamW): the float32 masters start from the weights as loaded")


def buckets(masters: list[torch.Tensor], limit: int):
    """Consecutive runs of indices into ``masters``, each closed once it holds ``limit`` bytes
    (one master larger than that is a run of its own): a step's transient share."""
    bucket, size = [], 0
    for i, master in enumerate(masters):
        bucket.append(i)
        size += master.numel() * master.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def adamw_update(optimizer: torch.optim.AdamW) -> None:
    """AdamW's update of ``optimizer``'s parameters that have a gradient (one bucket of a
    step), without the step hooks: once any AdamW exists, torch wraps ``AdamW.step`` with
    them, and they already run around the whole step."""
    step = torch.optim.AdamW.step
    getattr(step, "__wrapped__", step)(optimizer)


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's host master copy: float32 for half-precision parameters."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def parameter_groups(model, params: list[torch.nn.Parameter]) -> list[int]:
    """Each parameter's place in backward order (module docstring): 0 for the embeddings,
    ``l + 1`` for decoder layer ``l``, ``n + 1`` for everything else (final norm, head).
    Models without a decoder adapter get one group: gradients move at the end of backward."""
    from .errors import LongtrainError
    from .models.adapters import adapter_for

    try:
        adapter = adapter_for(model)
        layers = list(adapter.layers)
        embeddings = adapter.embeddings()
    except (LongtrainError, AttributeError):
        return [0] * len(params)
    place = {}
    for p in embeddings.parameters():
        place[id(p)] = 0
    for index, layer in enumerate(layers):
        for p in layer.parameters():
            place[id(p)] = index + 1
    return [place.get(id(p), len(layers) + 1) for p in params]


class HostAdamW(torch.optim.AdamW):
    """AdamW whose state and master weights live in host memory (module docstring).

    ``params``: the model's trainable parameters (on the device); ``groups``: their
    backward order (:func:`parameter_groups`). Its ``param_groups`` hold the host masters,
    so learning-rate schedulers work on it as on any optimizer."""

    def __init__(self, params, groups: list[int] | None = None, *, lr: float = 1e-4, weight_decay: float = 0.0,
                 betas=(0.9, 0.95), fused: bool = True):
        self.device_params = list(params)
        self.order = list(groups) if groups is not None else [0] * len(self.device_params)
        cuda = [p.device for p in self.device_params if p.is_cuda]
        self.cuda = cuda[0] if cuda else None
        pin = self.cuda is not None
        masters, self.host_grads = [], []
        with host_allocations():  # (what the simulator counts as host memory)
            for p in self.device_params:
                master = host_empty(p.numel(), master_dtype(p.dtype), pin=pin).view(p.shape)
                master.copy_(p.detach())
                masters.append(master)
                self.host_grads.append(host_empty(p.numel(), p.dtype, pin=pin).view(p.shape))
        super().__init__(masters, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
        self.masters = masters
        self._index = {id(p): i for i, p in enumerate(self.device_params)}
        self._filled = [False] * len(masters)  # the host buffer holds this step's gradient
        self._pending: dict[int, set[int]] = {}  # group -> parameters with a gradient still on the device
        self._streaming = True
        self._stream = torch.cuda.Stream(self.cuda) if self.cuda is not None else None
        self._hooks = [p.register_post_accumulate_grad_hook(self._arrived) for p in self.device_params]

    # ---- gradients, device -> host ---------------------------------------------------
    def _arrived(self, param: torch.Tensor) -> None:
        if not self._streaming:
            return
        i = self._index[id(param)]
        group = self.order[i]
        # Backward has moved below every group above this one: their gradients are final.
        # Not the first layer's at an embeddings gradient: chunked engines run each chunk's
        # backward on through its embeddings, so the first layer's later chunks are still to
        # come (copied at that point, each would be added on the host, synchronously); its
        # group moves at the end of backward.
        for done in [g for g in self._pending if g > max(group, 1)]:
            self._flush(self._pending.pop(done))
        self._pending.setdefault(group, set()).add(i)

    def _flush(self, indices) -> None:
        for i in sorted(indices):
            param = self.device_params[i]
            grad = param.grad
            if grad is None:
                continue
            host = self.host_grads[i]
            if self._filled[i]:  # a second arrival in this step: add it (synchronously)
                self._wait()
                with host_allocations():
                    host.add_(grad.to("cpu"))
            elif self._stream is None:
                host.copy_(grad)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(self.cuda))
                with torch.cuda.stream(self._stream):
                    host.copy_(grad, non_blocking=True)
                grad.record_stream(self._stream)  # the allocator keeps it until the copy is done
            self._filled[i] = True
            param.grad = None

    def _wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def set_streaming(self, streaming: bool) -> None:
        """Stream gradients to the host during this backward (the last micro-batch) or
        let them accumulate on the device (earlier micro-batches)."""
        self._streaming = streaming

    def finish_backward(self) -> None:
        """Move every gradient still on the device to the host and wait for the copies."""
        pending = set().union(*self._pending.values()) if self._pending else set()
        self._pending.clear()
        pending.update(i for i, p in enumerate(self.device_params) if p.grad is not None)
        self._flush(pending)
        self._wait()

    # ---- clipping, step, weights host -> device --------------------------------------
    def clip_grad_norm(self, max_norm: float) -> float:
        """The gradient norm over the host gradients, clipped to ``max_norm`` as
        :meth:`longtrain.train.ranks.Ranks.clip_grad_norm` does on the device."""
        self.finish_backward()
        grads = [g for g, filled in zip(self.host_grads, self._filled) if filled]
        if not grads:
            return 0.0
        total = float(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).square().sum().sqrt())
        scale = min(1.0, max_norm / (total + 1e-6))
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
        return total

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostAdamW does not take a closure")
        self.finish_backward()
        for bucket in buckets(self.masters, BUCKET_BYTES):
            live = [i for i in bucket if self._filled[i]]
            if not live:
                continue
            with host_allocations():
                for i in live:
                    grad = self.host_grads[i]
                    self.masters[i].grad = grad if grad.dtype == self.masters[i].dtype else grad.to(self.masters[i].dtype)
                adamw_update(self)  # parameters without .grad (other buckets) are skipped
            for i in live:
                self.masters[i].grad = None
            self._push(live)
        if self._stream is not None:  # the next forward reads the new weights
            torch.cuda.current_stream(self.cuda).wait_stream(self._stream)

    def _push(self, indices) -> None:
        """Copy the masters of ``indices`` to the device parameters (rounded to their dtype)."""
        for i in indices:
            param, master = self.device_params[i], self.masters[i]
            if self._stream is None:
                param.detach().copy_(master)
                continue
            staging = self.host_grads[i]  # free until the next backward, and in the parameter's dtype
            staging.copy_(master)
            with torch.cuda.stream(self._stream):
                param.detach().copy_(staging, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            p.grad = None
        self._filled = [False] * len(self.masters)
        self._pending.clear()
        super().zero_grad(set_to_none=True)

    # ---- checkpoints -----------------------------------------------------------------
    def state_dict(self):
        state = super().state_dict()
        state["master_weights"] = list(self.masters)
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            if masters is None:  # an on-device AdamW's: float32 weights, loaded by now, are their own masters
                if any(p.element_size() < 4 for p in self.device_params):
                    warnings.warn(NO_MASTERS, stacklevel=2)
                for master, param in zip(self.masters, self.device_params):
                    master.copy_(param.detach())
            else:
                for master, saved in zip(self.masters, masters):
                    master.copy_(saved)
        if masters is not None:
            self._push(range(len(self.masters)))
            if self._stream is not None:
                torch.cuda.current_stream(self.cuda).wait_stream(self._stream)
                self._wait()

    def host_tensors(self) -> list[torch.Tensor]:
        """The host buffers that exist from construction (masters, gradient buffers), for
        memory trackers; the moments appear in the first step."""
        return self.masters + self.host_grads

    def host_bytes(self) -> int:
        """Host memory held: masters, moments and gradient buffers."""
        per_master = sum(m.numel() * m.element_size() for m in self.masters)
        return 3 * per_master + sum(g.numel() * g.element_size() for g in self.host_grads)


def streaming(optimizer, last: bool):
    """Around one micro-batch's forward and backward: with a :class:`HostAdamW`, stream
    the gradients to the host on the last micro-batch (and finish the copies after it);
    otherwise nothing."""
    if not isinstance(optimizer, HostAdamW):
        return contextlib.nullcontext()
    return _streaming(optimizer, last)


@contextlib.contextmanager
def _streaming(optimizer: HostAdamW, last: bool):
    optimizer.set_streaming(last)
    try:
        yield
    finally:
        optimizer.set_streaming(True)
    if last:
        optimizer.finish_backward()
