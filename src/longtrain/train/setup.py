"""What a run trains with, settled before the first step: the device, the model and
tokenizer a config names, and the strategy applied to them.

Kept apart from the loop so that ``longtrain eval`` and the loop's own evaluation build
the very model a run builds, and so that a wrong device, length or strategy is refused
before anything is loaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..errors import LongtrainError
from ..models.adapters import adapter_class, describe_model
from ..models.loading import add_lora, build_from_config, check_safetensors, is_model_dir, load_config, load_pretrained
from ..models.presets import packaged_checkpoint
from ..strategy import Strategy
from .config import TrainConfig
from .tokenizer import load_tokenizer

__all__ = ["build_model", "check_weights_fit", "choose_strategy", "planned_strategy", "resolve_device", "trained_weights"]


def resolve_device(name: str) -> torch.device:
    """The device ``--device`` names (``auto``: this process's GPU, else the CPU), refused
    in one line when longtrain cannot train on it here."""
    if name == "auto":
        if torch.cuda.is_available():  # under torchrun, each process takes its own GPU
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # torch names every device type it knows; longtrain trains on two
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise LongtrainError(f"--device {name!r} is not a device longtrain trains on; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LongtrainError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise LongtrainError(f"--device {name} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s); "
                             "use cuda:0 ... or auto")
    if device.type == "cuda":  # under torchrun: the local rank's GPU
        from ..parallel.distributed import rank_device

        device = rank_device(device)
    return device


def trained_weights(config: TrainConfig) -> str | None:
    """Where a run's starting weights come from: a model directory, the weights longtrain
    ships for a preset (the demo's), or None for a random initialization."""
    if is_model_dir(config.model):
        return config.model
    return None if config.from_scratch else packaged_checkpoint(config.model)


def build_model(config: TrainConfig, dtype: torch.dtype, device: torch.device | None = None):
    """The model and tokenizer a config names, with LoRA when asked (strategy not applied);
    a 4-bit base is quantized as it loads onto ``device``."""
    pretrained = trained_weights(config)
    model_config = load_config(pretrained or config.model)
    adapter = adapter_class(model_config.model_type)
    max_pos = describe_model(model_config).max_positions
    if max_pos is not None and config.seq_len > max_pos:
        if pretrained == config.model and not config.extend_context:  # a user's model; a preset's grows
            raise LongtrainError(
                f"--seq-len {config.seq_len:,} exceeds the model's max_position_embeddings ({max_pos:,}); "
                "pass --extend-context to train beyond it (and set rope_scaling in its config.json for a pretrained model)"
            )
        adapter.allow_positions(model_config, config.seq_len)
    tokenizer = load_tokenizer(pretrained, config.tokenizer)
    vocab = describe_model(model_config).vocab
    if vocab < tokenizer.vocab_size:
        raise LongtrainError(
            f"the model's vocabulary ({vocab}) is smaller than the tokenizer's ({tokenizer.vocab_size}); "
            "use the model's own tokenizer (--tokenizer auto) or a preset"
        )
    torch.manual_seed(config.seed)
    if config.four_bit and not pretrained:
        raise LongtrainError("--4bit quantizes a model's weights as they load: point --model at a model directory "
                             "(this preset has no weights to load)")
    if pretrained:
        check_weights_fit(pretrained, model_config)
        try:
            model = load_pretrained(pretrained, dtype, four_bit=config.four_bit, device=device)
        except RuntimeError as exc:  # what check_weights_fit cannot see (.bin weights): transformers' size report
            if "mismatched" not in str(exc) and "size mismatch" not in str(exc):
                raise
            raise LongtrainError(f"the weights in {pretrained} do not fit its config.json (transformers: "
                                 f"{' '.join(str(exc).split())[:300]}); {_FIT_FIX}") from None
        adapter.allow_positions(model.config, describe_model(model_config).max_positions or 0)
    else:
        model = build_from_config(model_config, dtype)
    model.config.use_cache = False
    if config.lora:
        model = add_lora(model, config.lora_rank, dropout=config.lora_dropout)
    return model, tokenizer


_FIT_FIX = ("set config.json's sizes to those the weights were saved with, or point --model at the directory the "
            "weights came from")
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def _shape(shape) -> str:
    return "×".join(map(str, shape)) or "a scalar"


def check_weights_fit(path: str, model_config) -> None:
    """Refuse, in one line naming the tensors, a model directory whose ``*.safetensors``
    weights do not fit the model its ``config.json`` describes: a tensor of another shape,
    or layers the weights hold and the config does not (or the reverse) — read from the
    files' headers and a model built on the meta device, before anything is loaded.
    Names the two describe differently (a family whose loader renames or fuses tensors)
    are left to the loader."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return
    stored: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        check_safetensors(file)  # a damaged file named in one line
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                stored[name] = (tuple(f.get_slice(name).get_shape()), file.name)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in build_from_config(model_config).state_dict().items()}
    wrong = [(name, stored[name], shape) for name, shape in expected.items() if name in stored and stored[name][0] != shape]
    sizes = ", ".join(f"{k} {getattr(model_config, k)}" for k in _SIZE_FIELDS if getattr(model_config, k, None) is not None)
    if wrong:
        name, (shape, file), wanted = wrong[0]
        more = f", and {len(wrong) - 1} more tensor{'s' if len(wrong) > 2 else ''}" if len(wrong) > 1 else ""
        raise LongtrainError(f"the weights in {path} do not fit its config.json: {name} is {_shape(shape)} in {file} but "
                             f"{_shape(wanted)} by config.json ({sizes}){more}; {_FIT_FIX}")
    held = {int(m.group(1)) for name in stored if (m := _LAYER.search(name))}
    described = {int(m.group(1)) for name in expected if (m := _LAYER.search(name))}
    if held and described and held != described:
        raise LongtrainError(f"the weights in {path} hold {len(held)} layer{'s' if len(held) != 1 else ''} but its "
                             f"config.json describes {len(described)} ({sizes}); {_FIT_FIX}")


def planned_strategy(config: TrainConfig, device: torch.device, compute_dtype: torch.dtype) -> Strategy:
    """``--strategy auto``: the fastest strategy the planner finds fitting this machine."""
    from ..plan.auto import auto_strategy

    if config.engine != "backprop" or config.sp > 1 or config.lora:
        raise LongtrainError("--strategy auto picks the engine itself and plans one process of full fine-tuning; "
                             "drop --engine/--sp/--lora, or name a strategy")
    # The optimizer's place is the run's own setting (--optimizer-offload): auto plans the strategy around it.
    return auto_strategy(config.model, config.seq_len, device, dtype=str(compute_dtype).replace("torch.", ""),
                         batch=config.batch_size, optimizer=config.optimizer,
                         optimizer_offload=bool(config.optimizer_offload),
                         say=lambda line: print(f"longtrain train: {line}", flush=True))


def choose_strategy(config: TrainConfig, compute_dtype: torch.dtype, device: torch.device | None = None) -> Strategy:
    """The strategy a run applies: --strategy (with --engine and --sp) parsed, or planned for ``auto``."""
    if config.strategy == "auto":
        return planned_strategy(config, device or torch.device("cpu"), compute_dtype)
    sp = None
    if config.sp > 1:
        sp = {"degree": config.sp, "compute_dtype": str(compute_dtype).replace("torch.", "") if config.master_weights else None}
    strategy = Strategy.parse(config.strategy, engine=None if config.engine == "backprop" else config.engine,
                              sequence_parallel=sp)
    degree = strategy.sequence_parallel.degree if strategy.sequence_parallel is not None else 1
    if degree != config.sp:  # a plan's "+spN" row: the processes are --sp's to set (under torchrun)
        raise LongtrainError(f"--strategy {config.strategy} runs sequence parallel over {degree} processes; pass --sp {degree} "
                             f"and launch with torchrun --nproc-per-node {degree}")
    return strategy
