"""Build or load the models longtrain trains: presets (random weights) or local
Hugging Face directories, optionally wrapped with LoRA."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import struct
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..errors import LongtrainError
from . import ssm_resnet  # noqa: F401  (registers model_type "ssm_resnet": local SSM-ResNet directories load too)
from .adapters import adapter_class, describe_model
from .attention import NAME as ATTENTION_BACKEND
from .presets import preset_config, resolve_preset

__all__ = [
    "add_lora",
    "build_from_config",
    "default_dtype",
    "is_model_dir",
    "load_config",
    "load_pretrained",
    "parse_dtype",
]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise LongtrainError(f"unknown dtype {name!r}; choose one of {', '.join(_DTYPES)}") from None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Create parameters directly in ``dtype`` (also under fake tensors, where a later
    ``.to(dtype)`` would count both copies)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def is_model_dir(spec: str) -> bool:
    return os.path.isdir(spec)


def load_config(spec: str | PretrainedConfig) -> PretrainedConfig:
    """Config of a preset name, a local model directory, or a config passed through."""
    if isinstance(spec, PretrainedConfig):
        return copy.deepcopy(spec)
    if is_model_dir(spec):
        if not (Path(spec) / "config.json").is_file():
            raise LongtrainError(f"{spec} is a directory without config.json; point --model at a Hugging Face model directory")
        try:
            config = AutoConfig.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            reason = " ".join(str(exc).split())
            raise LongtrainError(f"cannot read the model config in {spec}: {reason}; point --model at a Hugging Face "
                                 "model directory") from None
        check_causal(config, spec)
        return config
    if resolve_preset(spec) is None and (os.sep in spec or spec.startswith(".")):
        raise LongtrainError(f"model directory {spec} does not exist; check the path")
    return preset_config(spec)


def check_causal(config: PretrainedConfig, source: str) -> None:
    """Refuse a model that is not a causal (decoder-only) language model: an
    encoder-decoder, a model whose ``architectures`` name no causal-LM class, or an
    encoder family (BERT-like: it has a masked-LM head) not configured as a decoder.
    Trained as a causal LM, such a model would run and learn nothing useful."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    names = list(getattr(config, "architectures", None) or [])
    causal_name = any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names)
    encoder_family = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if getattr(config, "is_encoder_decoder", False) or (names and not causal_name) or encoder_family:
        what = names[0] if names else f"{config.model_type} model"
        raise LongtrainError(f"{source} holds a {what}, not a causal (decoder-only) language model; longtrain trains "
                             "causal LMs (Llama, Qwen, Mistral, Gemma, Phi, ...): point --model at one of those")


def _attention_kwargs(config: PretrainedConfig, dtype: torch.dtype | None = None) -> dict:
    """Our attention backend for transformers; nothing for attention-free models
    (SSM-ResNet). A mixture of experts in float64 runs its experts one by one (the
    grouped-matmul kernels take no float64)."""
    has_attention = adapter_class(getattr(config, "model_type", None)).has_attention
    kwargs = {"attn_implementation": ATTENTION_BACKEND} if has_attention else {}
    if dtype == torch.float64 and _has_experts(config):
        kwargs["experts_implementation"] = "eager"
    return kwargs


def _has_experts(config: PretrainedConfig) -> bool:
    try:
        return describe_model(config).is_moe
    except LongtrainError:  # a family we cannot describe (refused when trained)
        return False


def build_from_config(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A randomly initialized causal LM with longtrain's attention backend."""
    with default_dtype(dtype):
        model = AutoModelForCausalLM.from_config(config, **_attention_kwargs(config, dtype))
    return model


_WEIGHTS_FIX = "copy or download the model's weight files again, or point --model at another model directory"


def _four_bit(dtype: torch.dtype):
    """bitsandbytes' NF4 loading settings, computing in ``dtype``."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise LongtrainError("--4bit quantizes with bitsandbytes: pip install bitsandbytes (or the qlora extra)")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def check_safetensors(file: Path) -> None:
    """Refuse a ``.safetensors`` file that is cut short or garbled, naming it: its 8-byte
    header length, JSON header and the tensors' byte ranges must fit the file exactly
    (read from the header alone, no tensor data)."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8)) if size >= 8 else (None,)
            if length is None or 8 + length > size:
                raise ValueError("its header is cut short")
            header = json.loads(f.read(length))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error) as exc:
        reason = str(exc) if "cut short" in str(exc) else "its header is not readable"
        raise LongtrainError(f"{file} is truncated or corrupt ({reason}, {size:,} bytes); {_WEIGHTS_FIX}") from None
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        what = "truncated" if size < expected else "corrupt"
        raise LongtrainError(f"{file} is {what}: {size:,} bytes where its header describes {expected:,}; {_WEIGHTS_FIX}")


def load_pretrained(path: str, dtype: torch.dtype, four_bit: bool = False, device: torch.device | None = None
                    ) -> nn.Module:
    """The model in ``path`` in ``dtype``; with ``four_bit`` its linear layers but the head
    quantized to 4 bits as they load onto ``device`` (bitsandbytes NF4, computing in ``dtype``)."""
    attn = _attention_kwargs(load_config(path), dtype)
    if four_bit:
        attn["quantization_config"] = _four_bit(dtype)
        if device is not None:
            attn["device_map"] = {"": str(device)}
    for file in sorted(Path(path).glob("*.safetensors")):  # a damaged file named in one line, not a loader's traceback
        check_safetensors(file)
    try:
        try:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **attn)
        except TypeError:  # transformers 4.x names the argument torch_dtype
            return AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, local_files_only=True, **attn)
    except Exception as exc:  # noqa: BLE001 - only what reading the files raises becomes one line
        if not isinstance(exc, (OSError, ValueError)) and type(exc).__name__ != "SafetensorError" \
                and "PytorchStreamReader" not in str(exc):
            raise
        reason = " ".join(str(exc).split())  # transformers' messages span lines
        raise LongtrainError(f"cannot load the model in {path}: {reason}; check its weight files ({_WEIGHTS_FIX})") from None


def add_lora(model: nn.Module, rank: int = 8, alpha: float | None = None, dropout: float = 0.0) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters on every linear layer but the head, ``dropout``
    on their inputs."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise LongtrainError("LoRA needs peft: pip install peft") from None
    if rank <= 0:
        raise LongtrainError(f"--lora-rank must be positive, got {rank}")
    exclude = adapter_class(getattr(getattr(model, "config", None), "model_type", None)).lora_exclude
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules="all-linear", lora_dropout=dropout,
                        task_type="CAUSAL_LM", **({"exclude_modules": list(exclude)} if exclude else {}))
    return get_peft_model(model, config)
