"""The optimizers longtrain trains and simulates with, built in one place so that the
simulator models exactly what the trainer runs."""

from __future__ import annotations

import warnings

import torch

from .errors import LongtrainError
from .optimizer_offload import NO_MASTERS, adamw_update, buckets

__all__ = ["MasterAdamW", "make_optimizer"]

OPTIMIZERS = ("adamw", "adamw-16bit", "adamw-offload", "sgd", "none")
HALF = (torch.bfloat16, torch.float16)
BUCKET_BYTES = 256 * 2**20  # float32 gradients made at once by MasterAdamW's step


def make_optimizer(name: str, params, lr: float = 1e-4, weight_decay: float = 0.0, model=None):
    """``adamw``: AdamW with float32 master weights and moments for 16-bit parameters
    (:class:`MasterAdamW`, mixed precision as users train), plain AdamW for the others;
    ``adamw-16bit``: AdamW on the 16-bit parameters themselves (pure 16-bit: small updates
    round away); ``adamw-offload`` (state and fp32 master weights in host memory, gradients
    streamed there during backward: :class:`~longtrain.optimizer_offload.HostAdamW`;
    ``model``, the parameters' model, tells it the layers' backward order); ``sgd`` (momentum
    0.9) or ``none`` (returns ``None``). AdamW is fused on CUDA and per-parameter elsewhere
    (no whole-model temporaries)."""
    # Meta parameters belong to another rank (layer groups): no state here.
    params = [p for p in params if p.requires_grad and not p.is_meta]
    if name == "none":
        return None
    if not params:
        raise LongtrainError("the model has no trainable parameters; enable LoRA or unfreeze some weights")
    if name in ("adamw", "adamw-16bit"):
        on_cuda = all(p.is_cuda for p in params)
        # foreach=False off CUDA: the foreach path would allocate a transient copy of the
        # whole optimizer state, which neither the fused CUDA kernel nor this path needs.
        extra = {"fused": True} if on_cuda else {"foreach": False}
        if name == "adamw" and any(p.dtype in HALF for p in params):
            return MasterAdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), **extra)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), **extra)
    if name == "adamw-offload":
        from .optimizer_offload import HostAdamW, parameter_groups

        groups = parameter_groups(model, params) if model is not None else None
        return HostAdamW(params, groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay, foreach=False)
    raise LongtrainError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


class MasterAdamW(torch.optim.AdamW):
    """AdamW over float32 master copies of 16-bit parameters, on the parameters' device: each
    step makes the gradients float32 a bucket at a time (``BUCKET_BYTES``, or one parameter
    where it is larger), updates the
    masters and their float32 moments, and rounds the masters into the parameters. A
    learning rate times an update below a bfloat16 weight's spacing still accumulates in
    its master. 12 bytes of state per parameter (master and two moments), beside the
    parameter and its gradient. Its ``param_groups`` hold the masters, so schedulers work on
    it as on any optimizer; parameters in float32 or wider are their own masters. Weights
    written from outside (a state dict loaded into the model after the optimizer was built)
    become their masters again at the next step. What reads ``param_groups`` for gradients
    (``GradScaler.unscale_``, clipping over the groups' parameters) sees the masters, which
    hold none: clip ``model.parameters()`` instead."""

    def __init__(self, params, **options):
        self.model_params = list(params)
        self.masters = [p.detach().float() if p.dtype in HALF else p for p in self.model_params]
        self._building = True
        super().__init__(self.masters, **options)
        self._building = False
        self._written = [self._version_of(p) for p in self.model_params]

    @staticmethod
    def _version_of(param: torch.Tensor) -> int | None:
        try:
            return param._version
        except (AttributeError, RuntimeError):  # a tensor subclass without a version counter
            return None

    def add_param_group(self, param_group) -> None:
        if not self._building:
            raise LongtrainError("MasterAdamW makes its float32 masters when it is built: build a new optimizer "
                                 "with every parameter instead of adding a group")
        super().add_param_group(param_group)

    def _adopt_outside_writes(self) -> None:
        """Masters of weights written since this optimizer last wrote them start from those weights."""
        for i, (param, master) in enumerate(zip(self.model_params, self.masters)):
            if master is not param and self._written[i] is not None and self._version_of(param) != self._written[i]:
                master.copy_(param)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterAdamW does not take a closure")
        self._adopt_outside_writes()
        # Parameters that are their own masters show their gradient to their bucket's step only.
        own = {i: p.grad for i, (p, m) in enumerate(zip(self.model_params, self.masters)) if m is p and p.grad is not None}
        for i in own:
            self.model_params[i].grad = None
        try:
            for bucket in buckets(self.masters, BUCKET_BYTES):
                live = [i for i in bucket if i in own or (self.masters[i] is not self.model_params[i]
                                                          and self.model_params[i].grad is not None)]
                if not live:
                    continue
                for i in live:
                    param, master = self.model_params[i], self.masters[i]
                    master.grad = own[i] if master is param else param.grad.float()
                adamw_update(self)  # masters without .grad (other buckets) are skipped
                for i in live:
                    param, master = self.model_params[i], self.masters[i]
                    master.grad = None
                    if master is not param:
                        param.copy_(master)
                        self._written[i] = self._version_of(param)
        finally:
            for i, grad in own.items():
                self.model_params[i].grad = grad

    def device_state_tensors(self) -> list[torch.Tensor]:
        """The float32 masters, which exist from construction (the moments appear in the first
        step): what memory trackers count as optimizer state."""
        return [m for m, p in zip(self.masters, self.model_params) if m is not p]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none=True)

    def state_dict(self):
        state = super().state_dict()
        state["master_weights"] = [m for m, p in zip(self.masters, self.model_params) if m is not p]
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        if "master_weights" not in state_dict and any(m is not p for m, p in zip(self.masters, self.model_params)):
            warnings.warn(NO_MASTERS, stacklevel=2)
        saved = iter(state_dict.pop("master_weights", ()))
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for i, (master, param) in enumerate(zip(self.masters, self.model_params)):
                if master is param:
                    continue
                value = next(saved, None)
                if value is None:  # a checkpoint without masters: start them from the weights
                    master.copy_(param)
                    continue
                # (a sharded master restores from this rank's shard)
                (master.to_local() if hasattr(master, "to_local") and not hasattr(value, "to_local") else master).copy_(
                    value.to(master.device) if not hasattr(master, "to_local") else value)
                param.copy_(master)
                self._written[i] = self._version_of(param)
