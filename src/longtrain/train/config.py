"""What defines a training run, and the checks of its values.

Kept free of torch and transformers: the command line builds its options (and its
``--help``) from :class:`TrainConfig` without paying for them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass

from ..errors import LongtrainError

__all__ = ["MAX_SEED", "MAX_SEQ_LEN", "TrainConfig", "check_config", "config_from_dict", "option"]

MAX_SEQ_LEN = 1 << 24  # one sample of 16M tokens; beyond this int32 indexing in kernels overflows
MAX_SEED = 2**32 - 1  # data order and chunk draws seed generators with seed·10^6 + epoch: keep it far from int64's edge


@dataclass
class TrainConfig:
    """Everything that defines a run. The defaults are the embedded demo: the small
    pretrained Llama longtrain ships, fine-tuned at 8K tokens on the built-in pass-key
    task, minutes on two CPU cores (docs/demo.md)."""

    model: str = "demo"  # preset name or local Hugging Face model directory
    from_scratch: bool = False  # a preset from random weights even where longtrain ships trained ones (the demo's)
    data: str | None = None  # text or record files (jsonl, json, parquet, arrow, csv), a directory, a save_to_disk folder; None = built-in pass-key task
    seq_len: int = 8192
    batch_size: int = 1
    grad_accum: int = 1
    steps: int = 200
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    optimizer: str = "adamw"
    strategy: str = "none"
    engine: str = "backprop"  # gradient engine with its options: "fpdt:chunk=8192:offload=true", "spaco:chunk=128:budget=8"
    lora: bool = False
    lora_rank: int = 8
    lora_dropout: float = 0.0  # dropout on the adapters' inputs (replayed exactly by every recomputation)
    dtype: str | None = None  # default: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    seed: int = 0
    out: str = "runs/default"
    save_every: int = 100
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: evaluate only at the end
    eval_samples: int = 16
    task_loss: str = "all"  # pass-key task: loss on all text ("all") or on the needles and answer only ("task")
    # --data packing: "concat" (documents joined by EOS, attending across), "documents" (joined and cut as concat, positions
    # and attention restart per document), "best-fit" (whole documents best-fit into windows, restarting per document),
    # "auto" (best-fit for chat and prompt/completion records, else concat)
    packing: str = "auto"
    loss_on: str = "assistant"  # --data chat and prompt/completion records: loss on the assistant/completion tokens ("assistant") or every token ("all")
    sp: int = 1  # Ulysses sequence parallelism: ranks that share each sequence (under torchrun; the rest is data parallel)
    master_weights: str | None = None  # under --sp: keep parameters (and optimizer state) in this dtype, compute in --dtype
    optimizer_offload: bool = False  # AdamW state and fp32 master weights in host memory, gradients streamed there
    tokenizer: str = "auto"  # "auto": a model directory's own (presets: bytes); "bytes"; or a tokenizer directory
    resume: bool = False
    resume_from: str | None = None
    overwrite: bool = False
    extend_context: bool = False
    tensorboard: bool = False
    progress: bool = True

    # Settings a resumed run must share with the checkpoint it resumes (refused if changed).
    IDENTITY = ("model", "from_scratch", "data", "seq_len", "batch_size", "grad_accum", "seed", "lora", "lora_rank", "optimizer", "task_loss",
                "packing", "loss_on", "sp", "tokenizer")
    # Settings a resumed run may change: applied from the checkpoint's step on, each change logged.
    # (The rest — where to write, how often to save or evaluate, the strategy, which change
    # how a step is computed but not what it computes — apply as given.)
    ADJUSTABLE = ("steps", "lr", "warmup_steps", "weight_decay", "max_grad_norm", "dtype")


# Range rules, by field: what the command line calls the option and what it must be.
_POSITIVE = ("seq_len", "batch_size", "grad_accum", "steps", "eval_samples", "lora_rank", "sp", "save_every",
             "keep_checkpoints")
_NON_NEGATIVE = ("warmup_steps", "eval_every", "seed")
_CHOICES = {"optimizer": ("adamw", "sgd"), "task_loss": ("task", "all"), "packing": ("auto", "concat", "documents", "best-fit"),
            "loss_on": ("assistant", "all")}


def option(name: str) -> str:
    """The command-line spelling of a field: ``save_every`` -> ``--save-every``."""
    return "--" + name.replace("_", "-")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond any float
        return False


def _check_types(config: TrainConfig) -> None:
    """Each field holds a value of its declared type (a bool is no integer here, and an
    integer is a fine float)."""
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        value, hint = getattr(config, field.name), hints[field.name]
        kinds = typing.get_args(hint) or (hint,)
        if value is None and type(None) in kinds:
            continue
        if bool in kinds:
            ok = isinstance(value, bool)
        elif int in kinds:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif float in kinds:
            ok = not isinstance(value, bool) and isinstance(value, (int, float)) and _finite(value)
        else:
            ok = isinstance(value, str)
        if not ok:
            wanted = " or ".join("a finite number" if k is float else k.__name__.replace("NoneType", "None") for k in kinds)
            raise LongtrainError(f"{option(field.name)} must be {wanted}, got {value!r}")


def _check_ranges(config: TrainConfig) -> None:
    if not 0 <= config.lora_dropout < 1:
        raise LongtrainError(f"--lora-dropout must be at least 0 and below 1, got {config.lora_dropout}")
    for name in _POSITIVE:
        if getattr(config, name) <= 0:
            raise LongtrainError(f"{option(name)} must be a positive integer, got {getattr(config, name)}")
    for name in _NON_NEGATIVE:
        if getattr(config, name) < 0:
            raise LongtrainError(f"{option(name)} must be 0 or more, got {getattr(config, name)}")
    if config.seed > MAX_SEED:
        raise LongtrainError(f"--seed must be at most {MAX_SEED}, got {config.seed}")
    if config.seq_len < 2:
        raise LongtrainError("--seq-len must be at least 2 (one input and one target token)")
    if config.seq_len > MAX_SEQ_LEN:
        raise LongtrainError(f"--seq-len {config.seq_len:,} exceeds the per-sample limit of {MAX_SEQ_LEN:,} tokens; "
                             "use sequence parallelism or a shorter length")
    if config.lr <= 0:
        raise LongtrainError(f"--lr must be positive, got {config.lr}")
    if config.weight_decay < 0:
        raise LongtrainError(f"--weight-decay must be 0 or more (it shrinks weights by lr·decay per step), got {config.weight_decay}")
    if config.max_grad_norm <= 0:
        raise LongtrainError(f"max_grad_norm must be positive, got {config.max_grad_norm}")
    for name, choices in _CHOICES.items():
        if getattr(config, name) not in choices:
            raise LongtrainError(f"{option(name)} must be one of {', '.join(choices)}, got {getattr(config, name)!r}")
    if config.tokenizer not in ("auto", "bytes") and not os.path.isdir(config.tokenizer):
        raise LongtrainError(f"--tokenizer {config.tokenizer!r} is neither auto, bytes nor a tokenizer directory; "
                             "pass one of those")


# Paths that must name something: an empty one would mean the current directory.
_PATHS = {
    "model": "name a preset (longtrain presets) or a model directory",
    "data": "name a data file (text, .jsonl, .json, .parquet, .arrow, .csv), a directory of them or a save_to_disk folder, "
            "or drop --data for the built-in pass-key task",
    "out": "name the run directory, e.g. --out runs/NAME",
    "resume_from": "name a checkpoint directory or a run directory",
}


def _check_paths(config: TrainConfig) -> None:
    for name, fix in _PATHS.items():
        value = getattr(config, name)
        if value is not None and not value.strip():
            raise LongtrainError(f"{option(name)} is empty (it would mean the current directory); {fix}")


def check_config(config: TrainConfig) -> None:
    """Refuse, in one line, a config whose values have the wrong type or range. Needs
    neither torch nor transformers: the command line checks before loading them."""
    if not isinstance(config, TrainConfig):
        raise LongtrainError(f"a run is described by a TrainConfig, got {type(config).__name__}")
    _check_types(config)
    _check_ranges(config)
    _check_paths(config)
    if config.resume and config.overwrite:
        raise LongtrainError("--resume and --overwrite contradict each other; pick one")
    if config.from_scratch and os.path.isdir(config.model):
        raise LongtrainError(f"--from-scratch starts a preset from random weights, but --model {config.model} is a model "
                             "directory, whose weights are what it holds; drop --from-scratch or name a preset")
    if config.resume and config.resume_from:
        raise LongtrainError("--resume continues --out's latest checkpoint and --resume-from a given one; pick one")
    if config.optimizer_offload and (config.sp > 1 or config.optimizer != "adamw"):
        raise LongtrainError("--optimizer-offload keeps AdamW's state in host memory on one process; it needs --optimizer adamw "
                             "and no --sp (under --sp, FSDP2 already shards the optimizer state over the ranks)")
    if config.master_weights is not None and config.sp <= 1:
        raise LongtrainError("--master-weights keeps sharded parameters in another dtype than the layers compute in: it needs --sp")


def config_from_dict(values: dict) -> TrainConfig:
    """A config from a mapping (the command line's namespace); names it does not know are skipped."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in values.items() if k in known})
