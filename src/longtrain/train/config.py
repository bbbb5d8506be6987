"""What defines a training run, and the checks of its values.

Kept free of torch and transformers: the command line builds its options (and its
``--help``) from :class:`TrainConfig` without paying for them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

from ..errors import LongtrainError

__all__ = [
    "DTYPES", "ENGINES", "MAX_SEED", "MAX_SEQ_LEN", "TECHNIQUES", "TrainConfig", "check_config", "config_from_dict",
    "model_config_json", "option", "warmup_steps",
]

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
    warmup_steps: int | None = None  # None: DEFAULT_WARMUP, or a tenth of --steps where that is not below --steps
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    optimizer: str = "adamw"
    strategy: str = "none"
    engine: str = "backprop"  # gradient engine with its options: "fpdt:chunk=8192:offload=true", "spaco:chunk=128:budget=8"
    lora: bool = False
    lora_rank: int = 8
    lora_dropout: float = 0.0  # dropout on the adapters' inputs (replayed exactly by every recomputation)
    four_bit: bool = False  # the base loaded in 4 bits by bitsandbytes (NF4), under the LoRA adapters
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
    # --data chat and prompt/completion records: loss on the assistant/completion tokens ("assistant") or every token
    # ("all"); None: "assistant" (a run settles it so), where text records have it on every token.
    loss_on: str | None = None
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
                "packing", "loss_on", "sp", "tokenizer", "four_bit")
    # Settings a resumed run may change: applied from the checkpoint's step on, each change logged.
    # (The rest — where to write, how often to save or evaluate, the strategy, which change
    # how a step is computed but not what it computes — apply as given.)
    ADJUSTABLE = ("steps", "lr", "warmup_steps", "weight_decay", "max_grad_norm", "dtype", "optimizer_offload")


DEFAULT_WARMUP = 20  # steps of warm-up without --warmup-steps (a tenth of the demo's 200 steps)

# The built-in engines, techniques and dtypes by name, for the checks that run before torch
# loads (the registry and the dtype table import it); tests/test_cli_probes.py checks that
# they are the registry's and models.loading's. The one place these lists live.
ENGINES = ("adjoint", "backprop", "fpdt", "seco", "spaco")
TECHNIQUES = ("checkpoint", "liger", "memo", "mst", "stream")
MOVED_TECHNIQUES = ("attention",)  # spellings strategy.py refuses with a line of their own
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64")
_DEVICE = re.compile(r"(cpu|cuda)(:[0-9]+)?")

# Range rules, by field: what the command line calls the option and what it must be.
_POSITIVE = ("seq_len", "batch_size", "grad_accum", "steps", "eval_samples", "lora_rank", "sp", "save_every",
             "keep_checkpoints")
_NON_NEGATIVE = ("warmup_steps", "eval_every", "seed")
_CHOICES = {"optimizer": ("adamw", "adamw-16bit", "sgd"), "task_loss": ("task", "all"), "packing": ("auto", "concat", "documents", "best-fit"),
            "loss_on": ("assistant", "all", None)}
# Options that only mean something with --lora.
_LORA_OPTIONS = ("lora_rank", "lora_dropout")


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


def warmup_steps(config: TrainConfig) -> int:
    """The warm-up a run uses: --warmup-steps as given, or without it DEFAULT_WARMUP (20)
    steps where that is below --steps, else a tenth of --steps (none below ten steps): a
    short run with the default reaches --lr instead of staying at a few percent of it.
    (An explicit --warmup-steps at or above --steps is refused by :func:`check_config`.)"""
    if config.warmup_steps is not None:
        return config.warmup_steps
    return DEFAULT_WARMUP if DEFAULT_WARMUP < config.steps else config.steps // 10


def _check_ranges(config: TrainConfig) -> None:
    if not 0 <= config.lora_dropout < 1:
        raise LongtrainError(f"--lora-dropout must be at least 0 and below 1, got {config.lora_dropout}")
    for name in _POSITIVE:
        if getattr(config, name) <= 0:
            raise LongtrainError(f"{option(name)} must be a positive integer, got {getattr(config, name)}")
    for name in _NON_NEGATIVE:
        if getattr(config, name) is not None and getattr(config, name) < 0:
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
            named = ", ".join(c for c in choices if c is not None)
            raise LongtrainError(f"{option(name)} must be one of {named}, got {getattr(config, name)!r}")
    if config.warmup_steps and config.warmup_steps >= config.steps:
        w, n = config.warmup_steps, config.steps
        raise LongtrainError(f"--warmup-steps {w} is not below --steps {n}: the learning rate would only rise from "
                             f"{1 / w:.1%} to {n / w:.1%} of --lr, warming up the whole run; pass --warmup-steps below {n} "
                             "(0: none), or raise --steps")
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


def known_names(kind: str, static: tuple[str, ...]) -> set[str]:
    """The names of ``kind`` ("engines", "techniques"): the built-ins, and where the registry
    is loaded already (a program that registered its own), those it holds."""
    registry = sys.modules.get("longtrain.registry")
    return set(static) | (set(getattr(registry, kind)()) if registry is not None else set())


def _check_names(config: TrainConfig) -> None:
    """--engine, --strategy (each item's name), --dtype, --master-weights and --device
    read as text against the known names: the options themselves are read (by the type
    each declares) once torch is loaded."""
    engines, techniques = known_names("engines", ENGINES), known_names("techniques", TECHNIQUES)
    engine = config.engine.split(":", 1)[0].strip()
    if engine not in engines:
        raise LongtrainError(f"unknown engine {engine!r} in --engine {config.engine!r}; available: {', '.join(sorted(engines))}")
    spec = config.strategy.strip()
    head, sep, tail = spec.rpartition("+sp")
    if sep and tail.strip().isdigit():  # a plan's row for several GPUs: "fpdt:chunk=8192,mst+sp8"
        spec = head
    if spec.endswith((".yaml", ".yml", ".json")):
        if not os.path.isfile(spec):
            raise LongtrainError(f"cannot read strategy file {spec!r}: no such file; pass the path of a .yaml or .json file "
                                 "written by Strategy.to_yaml() or to_json()")
    elif spec not in ("auto", "none") and "·" not in spec:  # a plan's note is refused with a line of its own
        for item in spec.split(","):
            name = item.split(":", 1)[0].strip()
            if item.strip() and name not in engines | techniques | set(MOVED_TECHNIQUES):
                raise LongtrainError(f"unknown technique {name!r} in --strategy {config.strategy!r}; available: "
                                     f"{', '.join(sorted(techniques))} (or an engine: {', '.join(sorted(engines))})")
    for name in ("dtype", "master_weights"):
        value = getattr(config, name)
        if value is not None and value.lower() not in DTYPES:
            raise LongtrainError(f"{option(name)} {value!r} is not a dtype; choose one of {', '.join(DTYPES)}")
    if config.device != "auto" and not _DEVICE.fullmatch(config.device):
        raise LongtrainError(f"--device {config.device!r} is not a device longtrain trains on; use auto, cpu, cuda or cuda:N")


# Sizes a model's config.json must give as positive integers, where it gives them.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "state_size", "conv_kernel", "expand", "num_heads",
          "n_layer", "n_embd", "n_head", "n_positions")
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def model_config_json(spec: str, does: str = "trains") -> dict | None:
    """``--model`` checked from files alone (no torch, no transformers): a preset name
    (None), or a model directory's ``config.json`` (returned) that reads as JSON, names a
    causal LM and gives positive sizes. ``does``: what longtrain does with it, for the
    message ("trains", "evaluates")."""
    from ..models.presets import preset_fields, resolve_preset

    if not os.path.isdir(spec):
        preset = resolve_preset(spec)
        if preset is None and os.path.isfile(spec):
            raise LongtrainError(f"--model {spec} is a file, not a model directory; point it at the directory that holds "
                                 "config.json and the weights, or name a preset (longtrain presets)")
        if preset is None and (os.sep in spec or spec.startswith(".")):
            raise LongtrainError(f"model directory {spec} does not exist; check the path, or name a preset (longtrain presets)")
        preset_fields(spec)  # refuses an unknown preset in one line
        return None
    path = Path(spec) / "config.json"
    if not path.is_file():
        raise LongtrainError(f"{spec} is a directory without config.json; point --model at a Hugging Face model directory")
    try:
        config = json.loads(path.read_text())
        if not isinstance(config, dict):
            raise ValueError("it is not a JSON object")
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        raise LongtrainError(f"cannot read the model config {path}: {reason}; point --model at a Hugging Face model directory") from None
    names = config.get("architectures") or []
    if config.get("is_encoder_decoder") or (names and not any(str(n).endswith(_CAUSAL_SUFFIXES) for n in names)):
        what = names[0] if names else f"{config.get('model_type', 'encoder-decoder')} model"
        raise LongtrainError(f"{spec} holds a {what}, not a causal (decoder-only) language model; longtrain {does} "
                             "causal LMs (Llama, Qwen, Mistral, Gemma, Phi, ...): point --model at one of those")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for where, fields in (("", config), ("text_config.", text)):
        for key in _SIZES:
            value = fields.get(key)
            if isinstance(value, bool) or (value is not None and not (isinstance(value, (int, float)) and value > 0)):
                raise LongtrainError(f"{path} gives {where}{key} as {value!r}, but a size must be positive: set it to the value "
                                     "the model's weights were saved with, or point --model at an intact model directory")
    return config


def check_config(config: TrainConfig, given: frozenset[str] | set[str] = frozenset()) -> None:
    """Refuse, in one line, a config whose values have the wrong type or range, or
    that names an engine, technique, dtype, device or model that does not exist. Needs
    neither torch nor transformers: the command line checks before loading them.
    ``given``: the fields the command line was given explicitly (a value equal to its
    default counts too), for the options that mean nothing without another."""
    if not isinstance(config, TrainConfig):
        raise LongtrainError(f"a run is described by a TrainConfig, got {type(config).__name__}")
    _check_types(config)
    _check_ranges(config)
    _check_paths(config)
    _check_names(config)
    model_config_json(config.model)
    if config.four_bit and not config.lora:
        raise LongtrainError("--4bit loads the base in 4 bits, which trains LoRA adapters only: add --lora")
    if not config.lora:
        defaults = TrainConfig()
        for name in _LORA_OPTIONS:
            if name in given or getattr(config, name) != getattr(defaults, name):
                raise LongtrainError(f"{option(name)} has no effect without --lora; add --lora (or drop {option(name)})")
    if config.data is not None and ("task_loss" in given or config.task_loss != "all"):
        raise LongtrainError("--task-loss chooses the loss of the built-in pass-key task; with --data, --loss-on "
                             "chooses the tokens that carry it: drop --task-loss")
    if config.data is None and ("packing" in given or config.packing != "auto"):
        raise LongtrainError("--packing arranges the records of --data into sequences; without --data (the pass-key "
                             "task) it has no effect: drop it, or pass --data")
    if config.data is None and config.loss_on is not None:
        raise LongtrainError("--loss-on chooses the tokens of --data records that carry the loss; without --data (the "
                             "pass-key task) it has no effect: drop it, or use --task-loss")
    if config.resume and config.overwrite:
        raise LongtrainError("--resume and --overwrite contradict each other; pick one")
    if config.overwrite and config.resume_from and _inside(config.resume_from, config.out):
        raise LongtrainError(f"--resume-from {config.resume_from} lies inside --out {config.out}, which --overwrite clears "
                             "before training; drop --overwrite to continue that run in place, or copy the checkpoint "
                             "out of --out first")
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


def _inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies under it (links resolved)."""
    path, root = Path(path).resolve(), Path(root).resolve()
    return path == root or root in path.parents


def config_from_dict(values: dict) -> TrainConfig:
    """A config from a mapping (the command line's namespace); names it does not know are skipped."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in values.items() if k in known})
