"""What defines a long-context evaluation (``longtrain eval``), and the checks of its values.

Kept free of torch and transformers, as :mod:`longtrain.train.config` is: a mistake in
the values, the model directory (no ``config.json``, not a causal LM, no tokenizer) or
the output directory is refused in one line before either loads. What only the loaded
tokenizer can tell (a length too short for the task) is checked before the model loads.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ..errors import LongtrainError
from .config import MAX_SEED, MAX_SEQ_LEN, model_config_json

__all__ = [
    "DEFAULT_DEPTHS",
    "EvalConfig",
    "check_eval_config",
    "check_out",
    "check_settings",
    "default_out",
    "format_length",
    "parse_depths",
    "parse_lengths",
]

TASKS = ("passkey", "needle", "both")
DEFAULT_LENGTHS = (2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
RESULT_FILES = ("eval.json", "eval.png")
# Files that make a directory a model's tokenizer (Hugging Face's, or longtrain's byte tokenizer).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                    "longtrain_tokenizer.json")


@dataclass
class EvalConfig:
    """Everything that defines an evaluation. ``lengths=None``: :data:`DEFAULT_LENGTHS`,
    those within the model's ``max_position_embeddings``."""

    model: str  # preset name or local Hugging Face model directory (a run's final/)
    lengths: tuple[int, ...] | None = None
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    samples: int = 16
    task: str = "both"
    seed: int = 0
    out: str | None = None  # None: a new eval-DATE-TIME directory (see default_out)
    tokenizer: str = "auto"  # as train's --tokenizer: auto, bytes, or a tokenizer directory
    device: str = "auto"
    dtype: str | None = None  # default: bfloat16 on CUDA, float32 on CPU
    extend_context: bool = False  # allow lengths beyond the model's max_position_embeddings
    progress: bool = True
    max_positions: int | None = field(default=None, init=False)  # read from the model's config by check_eval_config


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"2K,4K,8K"`` -> ``(2048, 4096, 8192)``; each length positive and at most the
    per-sample limit."""
    from ..memory.units import parse_tokens

    lengths = []
    for item in text.split(","):
        item = item.strip()
        try:
            length = parse_tokens(item)
        except LongtrainError:
            length = None
        if length is None or length <= 0:
            raise LongtrainError(f"--lengths takes positive token counts separated by commas (2K,4K,8K), got {item!r} in {text!r}")
        if length > MAX_SEQ_LEN:
            raise LongtrainError(f"--lengths {item} exceeds the per-sample limit of {MAX_SEQ_LEN:,} tokens")
        lengths.append(length)
    return tuple(sorted(set(lengths)))


def parse_depths(text: str | None, task: str = "both") -> tuple[float, ...]:
    """``"0,0.5,1"`` -> ``(0.0, 0.5, 1.0)``: relative depths of the needle, each in [0, 1]
    (None: the default depths). The pass-key task places its needles at random: depths
    given for it alone are refused."""
    if text is None:
        return DEFAULT_DEPTHS
    if task == "passkey":
        raise LongtrainError("--depths places the needle of --task needle (or both); --task passkey places its needles "
                             "at random: drop --depths, or use --task needle")
    depths = []
    for item in text.split(","):
        try:
            depth = float(item)
        except ValueError:
            depth = math.nan
        if not 0 <= depth <= 1:  # NaN fails too
            raise LongtrainError(f"--depths takes numbers in [0, 1] separated by commas (0: start of the context, 1: just "
                                 f"before the question), got {item.strip()!r} in {text!r}")
        depths.append(depth)
    return tuple(sorted(set(depths)))


def check_settings(lengths, depths, samples: int, task: str, seed: int) -> None:
    """Refuse, in one line, settings the evaluation cannot run (shared by the command line
    and :func:`longtrain.train.evaluate.evaluate_long_context`)."""
    if task not in TASKS:
        raise LongtrainError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in lengths):
        raise LongtrainError(f"--lengths must be positive token counts, got {lengths!r}")
    if task != "passkey" and (not depths or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1
                                                for d in depths)):
        raise LongtrainError(f"--depths must be numbers in [0, 1], got {depths!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0:
        raise LongtrainError(f"--samples must be a positive integer, got {samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise LongtrainError(f"--seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")


def _model_facts(spec: str) -> tuple[int | None, bool]:
    """A model's ``max_position_embeddings`` (None where it has none) and whether it comes
    with a tokenizer, read from files alone; a directory that is no causal LM, or whose
    config gives a size that is none, is refused."""
    from ..models.presets import preset_fields

    config = model_config_json(spec, "evaluates")
    if config is None:  # a preset
        _, fields = preset_fields(spec)
        return fields.get("max_position_embeddings"), True
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    max_positions = config.get("max_position_embeddings", text.get("max_position_embeddings"))
    has_tokenizer = any((Path(spec) / name).is_file() for name in _TOKENIZER_FILES)
    return (max_positions if isinstance(max_positions, int) and max_positions > 0 else None), has_tokenizer


def format_length(n: int) -> str:
    """2048 -> "2K", 3000 -> "3,000"."""
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def check_out(out: str) -> None:
    """An --out that can take a new evaluation: not a file, not under one, and not holding
    an earlier evaluation (never replaced)."""
    path = Path(out)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise LongtrainError(f"--out {out} cannot be a directory: {blocker} is a file; pass --out a directory path")
    earlier = [name for name in RESULT_FILES if (path / name).exists()]
    if earlier:
        raise LongtrainError(f"--out {out} holds an earlier evaluation ({', '.join(earlier)}), which is never replaced; "
                             "pass --out NEW_DIR, or leave --out out for a new eval-DATE-TIME directory")
    existing = next(p for p in (path, *path.parents, Path(".")) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LongtrainError(f"--out {out} cannot be written: {existing} is not writable; pass --out a directory you can write to")


def default_out(model: str, now: datetime | None = None) -> str:
    """Where an evaluation goes without --out: ``eval-DATE-TIME`` in the run directory when
    ``model`` is a run's ``final/`` (its ``summary.json`` or ``metrics.jsonl`` beside), else
    under ``runs/``; ``-2``, ``-3``, ... appended where that directory exists already."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    model_dir = Path(model)
    run = model_dir.resolve().parent if model_dir.is_dir() else None
    in_run = run is not None and model_dir.resolve().name == "final" and \
        any((run / name).is_file() for name in ("summary.json", "metrics.jsonl"))
    base = (run if in_run else Path("runs")) / f"eval-{stamp}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return str(candidate)


def check_eval_config(config: EvalConfig) -> None:
    """Refuse, in one line, an evaluation that cannot run, reading only files (no torch, no
    transformers); fills in the default lengths and ``config.max_positions``."""
    if not config.model or not config.model.strip():
        raise LongtrainError("--model is empty; name a preset (longtrain presets) or a model directory (a run's final/)")
    if config.out is not None and not config.out.strip():
        raise LongtrainError("--out is empty (it would mean the current directory); name a directory, or leave --out out "
                             "for a new eval-DATE-TIME directory")
    if config.tokenizer not in ("auto", "bytes") and not os.path.isdir(config.tokenizer):
        raise LongtrainError(f"--tokenizer {config.tokenizer!r} is neither auto, bytes nor a tokenizer directory; pass one of those")
    max_positions, has_tokenizer = _model_facts(config.model)
    if config.tokenizer == "auto" and not has_tokenizer:
        raise LongtrainError(f"{config.model} has no tokenizer files; add the model's tokenizer there, pass --tokenizer DIR, "
                             "or --tokenizer bytes for the byte tokenizer")
    config.max_positions = max_positions
    if config.lengths is None:
        within = tuple(n for n in DEFAULT_LENGTHS if max_positions is None or n <= max_positions)
        config.lengths = within or (max_positions,)
    check_settings(config.lengths, config.depths, config.samples, config.task, config.seed)
    beyond = [n for n in config.lengths if max_positions is not None and n > max_positions]
    if beyond and not config.extend_context:
        raise LongtrainError(f"--lengths {','.join(map(format_length, beyond))} exceed{'s' if len(beyond) == 1 else ''} the model's "
                             f"max_position_embeddings ({max_positions:,}); pass --extend-context to evaluate at positions "
                             f"it was not configured for, or lengths up to {format_length(max_positions)}")
    if config.out is not None:
        check_out(config.out)
