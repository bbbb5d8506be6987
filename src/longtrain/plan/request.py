"""What a plan is asked (:class:`PlanRequest`): the model, the length, the machine and the
training it must fit, checked once, field by field, when it is built.

How the plan is computed — processes simulating at once, progress lines — is no part of
the question: those are :func:`~longtrain.plan.planner.plan`'s keyword arguments, and
they never change its answer."""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass
from typing import Any

from .. import engines as _builtin_engines  # noqa: F401  (registers the built-in engines)
from .. import registry
from ..errors import LongtrainError
from ..models.loading import parse_dtype
from .time_model import BUILT_IN, H100, MachineRates

__all__ = ["OPTIMIZERS", "PlanRequest"]

OPTIMIZERS = ("adamw", "adamw-16bit", "sgd", "none")  # whose state a plan counts ("none": no optimizer step)


@dataclass(frozen=True)
class PlanRequest:
    """One question for :func:`~longtrain.plan.planner.plan`::

        plan(PlanRequest("llama3-8b", 262144, device_memory=80 * 2**30, host_memory=120 * 2**30))

    ``model`` is a preset name, a local model directory or a ``PretrainedConfig``;
    ``seq_len`` tokens per sample; the rest by keyword. Each field is checked when the
    request is built; a wrong one is refused in one line naming it (and its ``longtrain
    plan`` option)."""

    model: Any
    seq_len: int
    _: KW_ONLY
    device_memory: int  # bytes of one GPU
    host_memory: int  # bytes of host memory the run may use, in all
    optimizer: str = "adamw"  # whose state is counted: adamw, sgd or none
    dtype: str = "bfloat16"  # parameter and activation dtype
    rates: MachineRates = H100  # the time model's rates
    rates_name: str = "h100"  # what the verdict calls them
    batch: int = 1  # samples per step
    gpus: int = 1  # GPUs in all: parameters, gradients and optimizer state sharded over them (FSDP2) when more than one
    sp: int | None = None  # GPUs that share each sequence (Ulysses; default: every GPU); the groups are data parallel
    lora_rank: int | None = None  # train LoRA adapters of this rank instead of every weight
    four_bit: bool = False  # the base held in 4 bits by bitsandbytes (NF4), under the LoRA adapters
    optimizer_offload: bool | None = None  # AdamW's state in host memory (True), on the device (False), both weighed (None)
    engine: str | None = None  # weigh only this engine's variants
    longest: bool = False  # also search the longest context each simulated strategy reaches
    exhaustive: bool = False  # simulate every candidate, not only those predicted faster than the fastest that fits
    carried: tuple[str, ...] = ()  # techniques every candidate carries where its engine takes them (e.g. liger)

    def __post_init__(self) -> None:
        for check in (self._model, self._seq_len, self._memories, self._optimizer, self._dtype, self._rates,
                      self._counts, self._lora_rank, self._optimizer_offload, self._engine, self._switches, self._carried):
            check()
        self._sequence_parallel()

    @property
    def degree(self) -> int:
        """GPUs that share each sequence (Ulysses sequence parallelism)."""
        return self.sp if self.sp is not None else self.gpus

    def _sequence_parallel(self) -> None:
        if self.sp is None:
            return
        if not _integer(self.sp) or self.sp < 1 or self.gpus % self.sp or (self.sp == 1 and self.gpus > 1):
            raise LongtrainError(f"sp (--sp) must divide gpus ({self.gpus}) and, with several GPUs, be at least 2 "
                                 f"(groups of that many share each sequence; the groups are data parallel), got {self.sp!r}")

    def _model(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) and not hasattr(self.model, "model_type"):
            raise LongtrainError(f"model (--model) must be a preset name, a model directory or a model config, "
                                 f"got {self.model!r}")
        if isinstance(self.model, str) and not self.model.strip():
            raise LongtrainError("model (--model) must be a preset name, a model directory or a model config, got ''")

    def _seq_len(self) -> None:
        if not _integer(self.seq_len) or self.seq_len < 2:
            raise LongtrainError(f"seq_len (--seq-len) must be a whole number of at least 2 tokens, got {self.seq_len!r}")

    def _memories(self) -> None:
        for name, flag in (("device_memory", "--device-memory"), ("host_memory", "--host-memory")):
            value = getattr(self, name)
            if not _integer(value) or value <= 0:
                raise LongtrainError(f"{name} ({flag}) must be a positive number of bytes, got {value!r}")

    def _optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise LongtrainError(f"optimizer (--optimizer) must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")

    def _dtype(self) -> None:
        item = parse_dtype(self.dtype).itemsize  # an unknown name is refused in one line, naming the known ones
        if self.optimizer == "adamw-16bit" and item > 2:
            raise LongtrainError(f"--optimizer adamw-16bit steps AdamW on 16-bit weights, and --dtype {self.dtype} is "
                                 f"not 16-bit (it would be plain AdamW): use --optimizer adamw, or a 16-bit --dtype")

    def _rates(self) -> None:
        if not isinstance(self.rates, MachineRates):
            raise LongtrainError(f"rates (--rates) must be MachineRates (longtrain.plan.time_model; "
                                 f"longtrain.plan.calibrate.load reads a calibration), got {self.rates!r}")
        if not isinstance(self.rates_name, str) or not self.rates_name:
            raise LongtrainError(f"rates_name must name the rates (e.g. 'h100'), got {self.rates_name!r}")

    @property
    def rates_label(self) -> str:
        """What a plan calls its rates: ``rates_name``, or where that was left at its default
        beside other rates, the built-in table they are (else "given")."""
        if self.rates_name != "h100" or self.rates is H100:
            return self.rates_name
        return next((name for name, table in BUILT_IN.items() if table is self.rates), "given")

    def _counts(self) -> None:
        for name, flag in (("batch", "--batch-size"), ("gpus", "--gpus")):
            value = getattr(self, name)
            if not _integer(value) or value < 1:
                raise LongtrainError(f"{name} ({flag}) must be a positive count, got {value!r}")

    def _lora_rank(self) -> None:
        if self.lora_rank is not None and (not _integer(self.lora_rank) or self.lora_rank < 1):
            raise LongtrainError(f"lora_rank (--lora-rank) must be a positive count or None (every weight trained), "
                                 f"got {self.lora_rank!r}")
        if self.four_bit not in (True, False):
            raise LongtrainError(f"four_bit (--4bit) must be True or False, got {self.four_bit!r}")
        if self.four_bit and self.lora_rank is None:
            raise LongtrainError("four_bit (--4bit) holds the base in 4 bits, which trains LoRA adapters only: add --lora")

    def _optimizer_offload(self) -> None:
        if self.optimizer_offload not in (None, True, False):
            raise LongtrainError(f"optimizer_offload (--optimizer-offload) must be True (host memory), False (the "
                                 f"device) or None (both weighed), got {self.optimizer_offload!r}")

    def _engine(self) -> None:
        if self.engine is not None:
            if not isinstance(self.engine, str):
                raise LongtrainError(f"engine (--engine) must be an engine's name or None (every engine), "
                                     f"got {self.engine!r}")
            if ":" in self.engine:
                raise LongtrainError(f"--engine {self.engine}: a plan takes an engine's name (e.g. "
                                     f"{self.engine.split(':')[0]}) and weighs its options itself")
            registry.engine(self.engine)  # an unknown name is refused in one line, naming the known ones

    def _carried(self) -> None:
        if not isinstance(self.carried, tuple) or not all(isinstance(name, str) for name in self.carried):
            raise LongtrainError(f"carried (--with) must be a tuple of technique names (a one-name tuple ends in a "
                                 f"comma), got {self.carried!r}")
        for name in self.carried:
            costs = registry.technique(name).costs  # an unknown name is refused in one line, naming the known ones
            if costs.candidates(None):
                raise LongtrainError(f"--with {name}: {name} is weighed as candidates of its own; --with takes a "
                                     f"technique every candidate carries (e.g. liger)")
            if costs.needs_frozen_layers and not self.lora_rank:
                raise LongtrainError(f"--with {name}: {name} serves layers whose weights do not train, and full "
                                     f"fine-tuning trains every one; plan with --lora, or leave it out")

    def _switches(self) -> None:
        for name in ("longest", "exhaustive"):
            if not isinstance(getattr(self, name), bool):
                raise LongtrainError(f"{name} (--{name}) must be True or False, got {getattr(self, name)!r}")


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
