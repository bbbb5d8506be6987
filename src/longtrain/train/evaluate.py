"""Long-context evaluation: pass-key accuracy by length and needle-in-a-haystack accuracy
by length × depth (``longtrain eval``).

Both tasks are the built-in pass-key task (:mod:`longtrain.train.passkey`), scored by its
own :meth:`~longtrain.train.passkey.PasskeyTask.evaluate` (teacher-forced greedy answers
on held-out samples): ``passkey`` as the trainer evaluates it (needles at random points
at least a quarter of the sample, up to 2,048 tokens, before the question), ``needle``
with one needle at each relative depth (0: the first token, 1: just before the
question). Called from Python, for example from a Hugging Face Trainer's evaluation
hook::

    from longtrain.train.evaluate import evaluate_long_context, flat_metrics

    cells = evaluate_long_context(model, tokenizer, lengths=(2048, 8192), depths=(0.0, 0.5, 1.0),
                                  samples=16, task="both", seed=0, device=None, progress=None)
    trainer.log(flat_metrics(cells))   # {"eval_passkey_2048": 0.94, "eval_needle_2048_d0.50": 1.0, ...}

``evaluate_long_context(model, tokenizer, lengths, depths=DEFAULT_DEPTHS, *, samples=16,
task="both", seed=0, device=None, progress=None) -> list[dict]``

- ``model``: a causal LM taking ``input_ids``, ``use_cache`` and ``logits_to_keep``
  (any Hugging Face one, also after ``lt.apply``); put in eval mode for the call and
  restored after. ``device``: where the samples go (default: the model's parameters').
- ``tokenizer``: longtrain's (``ByteTokenizer``, ``HFTokenizer``) or a Hugging Face tokenizer.
- ``lengths``: tokens per sample; ``depths``: needle depths in [0, 1] (``task`` "needle"
  or "both"); ``samples``: held-out samples per cell; ``task``: "passkey", "needle" or
  "both"; ``seed``: the samples (the same seed, length and index give the same key and
  filler at every depth). A length too short for the task is refused before any forward.
- ``progress``: called with each cell as it is finished.
- Returns one cell per (length, depth) and per length for ``passkey``, as dicts:
  ``task``, ``length``, ``depth`` (None for ``passkey``), ``needles`` (how many copies of
  the key), ``accuracy`` (whole keys right), ``digit_accuracy`` (answer tokens right:
  digits with the byte tokenizer), ``samples``.

:func:`run_eval` is the command: load the model, evaluate, write ``eval.json`` and the
heat map ``eval.png``; :func:`format_table` prints the cells.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import LongtrainError, writing
from .config import TrainConfig
from .eval_config import (
    DEFAULT_DEPTHS,
    EvalConfig,
    check_eval_config,
    check_out,
    check_settings,
    default_out,
    format_length,
)
from .metrics import strict_json
from .passkey import PasskeyTask, TooShortForTask
from .plot import plot_accuracy_map
from .run_checkpoints import write_text_atomic
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["evaluate_long_context", "flat_metrics", "format_table", "run_eval"]


def evaluate_long_context(model, tokenizer, lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS, *,
                          samples: int = 16, task: str = "both", seed: int = 0, device: str | torch.device | None = None,
                          progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Pass-key and needle-in-a-haystack accuracy of ``model`` (see the module docstring)."""
    lengths, depths = list(lengths), list(depths)
    check_settings(lengths, depths, samples, task, seed)
    depths = [float(d) for d in depths] if task != "passkey" else []
    tasks = _tasks(_our_tokenizer(tokenizer), lengths, depths, task, seed)  # refuses a short length before any forward
    if device is None:
        device = next(model.parameters()).device
    cells = []
    for cell, passkey in tasks:
        result = passkey.evaluate(model, samples, device)
        cell.update(accuracy=result["key_accuracy"], digit_accuracy=result["digit_accuracy"], samples=result["samples"])
        cells.append(cell)
        if progress is not None:
            progress(cell)
    return cells


def flat_metrics(cells: list[dict], prefix: str = "eval_") -> dict[str, float]:
    """Whole-key accuracies by name, for a metrics logger: ``eval_passkey_8192`` and
    ``eval_needle_8192_d0.50``."""
    return {f"{prefix}{c['task']}_{c['length']}" + ("" if c["depth"] is None else f"_d{c['depth']:.2f}"): c["accuracy"]
            for c in cells}


def _our_tokenizer(tokenizer):
    """longtrain's tokenizer interface (``encode`` without special tokens) for any tokenizer."""
    if isinstance(tokenizer, (ByteTokenizer, HFTokenizer)):
        return tokenizer
    from transformers import PreTrainedTokenizerBase

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return HFTokenizer(tokenizer)
    return tokenizer  # anything else with the same small interface


def _tasks(tokenizer, lengths: list[int], depths: list[float], task: str, seed: int) -> list[tuple[dict, PasskeyTask]]:
    """Each cell's description and the task whose held-out samples score it, in order:
    per length, the pass key, then the needle at each depth."""
    tasks = []
    for length in lengths:
        try:
            if task in ("passkey", "both"):
                passkey = PasskeyTask(tokenizer, length, seed=seed)
                tasks.append(({"task": "passkey", "length": length, "depth": None, "needles": passkey.copies}, passkey))
            if task in ("needle", "both"):
                tasks += [({"task": "needle", "length": length, "depth": depth, "needles": 1},
                           PasskeyTask(tokenizer, length, seed=seed, depth=depth)) for depth in depths]
        except TooShortForTask as exc:
            raise LongtrainError(f"--lengths {length:,} is too short for the pass-key task (it needs at least "
                                 f"{exc.shortest:,} tokens); pass longer --lengths") from None
    return tasks


def format_table(cells: list[dict]) -> str:
    """Whole-key accuracy in percent: a row per needle depth and one for the pass key, a
    column per length."""
    lengths = sorted({c["length"] for c in cells})
    rows = [(f"needle {d:.2f}", [c for c in cells if c["task"] == "needle" and c["depth"] == d])
            for d in sorted({c["depth"] for c in cells if c["task"] == "needle"})]
    passkey = [c for c in cells if c["task"] == "passkey"]
    if passkey:
        rows.append(("pass key", passkey))
    width = max(7, *(len(format_length(n)) + 1 for n in lengths))
    lines = ["depth".ljust(12) + "".join(format_length(n).rjust(width) for n in lengths)]
    for label, row in rows:
        by_length = {c["length"]: c for c in row}
        lines.append(label.ljust(12) + "".join((f"{by_length[n]['accuracy']:.0%}" if n in by_length else "-").rjust(width)
                                              for n in lengths))
    samples = cells[0]["samples"] if cells else 0
    lines.append(f"whole keys found, {samples} held-out samples per cell; answer-digit accuracy in eval.json "
                 "(chance: 10% of digits)")
    return "\n".join(lines)


def _say(line: str) -> None:
    print(f"longtrain eval: {line}", file=sys.stderr, flush=True)


def run_eval(config: EvalConfig, say: Callable[[str], None] = _say) -> dict:
    """``longtrain eval``: load the model ``config`` names, evaluate it, write ``eval.json``
    and ``eval.png`` in a new output directory; the document written. ``say`` prints
    progress and notes (on stderr)."""
    from ..models.loading import parse_dtype
    from .trainer import build_model, resolve_device, trained_weights

    check_eval_config(config)
    device = resolve_device(config.device)
    dtype = parse_dtype(config.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    # As a run builds it: a preset's weights (the demo's shipped ones) from the seed, a directory's its own.
    model_config = TrainConfig(model=config.model, tokenizer=config.tokenizer, seq_len=max(config.lengths),
                               extend_context=config.extend_context, seed=config.seed)
    tasks_tokenizer = load_tokenizer(trained_weights(model_config), config.tokenizer)
    _tasks(tasks_tokenizer, list(config.lengths), list(config.depths), config.task, config.seed)  # before the model loads
    model, tokenizer = build_model(model_config, dtype)
    model.to(device).eval()

    started, last = time.perf_counter(), [time.perf_counter()]

    def report(cell: dict) -> None:
        n = cell["needles"]
        where = f"pass key ({n} needle{'s' * (n > 1)})" if cell["depth"] is None else f"needle at depth {cell['depth']:.2f}"
        now = time.perf_counter()
        say(f"{format_length(cell['length'])} tokens, {where}: {round(cell['accuracy'] * cell['samples'])}/{cell['samples']} keys "
            f"({now - last[0]:.1f} s)")
        last[0] = now

    with torch.inference_mode():
        cells = evaluate_long_context(model, tokenizer, config.lengths, config.depths, samples=config.samples,
                                      task=config.task, seed=config.seed, device=device,
                                      progress=report if config.progress else None)
    seconds = time.perf_counter() - started
    out = Path(config.out or default_out(config.model))
    document = {
        "model": os.path.abspath(config.model) if os.path.isdir(config.model) else config.model,
        "tokenizer": config.tokenizer, "task": config.task, "lengths": list(config.lengths),
        "depths": list(config.depths) if config.task != "passkey" else [], "samples": config.samples, "seed": config.seed,
        "max_position_embeddings": config.max_positions, "extend_context": config.extend_context,
        "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "date": datetime.now().isoformat(timespec="seconds"), "seconds": round(seconds, 2),
        "measures": "accuracy: whole keys right (teacher-forced greedy answer); digit_accuracy: answer tokens right",
        "cells": cells,
    }
    check_out(str(out))  # again: another evaluation may have finished there meanwhile
    with writing("the evaluation", out):
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "eval.json", strict_json(document, indent=2) + "\n")
    model_dir = Path(config.model).resolve()
    name = (f"{model_dir.parent.name}/{model_dir.name}" if model_dir.name == "final" else model_dir.name) \
        if os.path.isdir(config.model) else config.model  # a run's final/ goes by its run's name
    title = f"{name}: whole keys found"
    if plot_accuracy_map(cells, out / "eval.png", title=title) is None:
        say("no eval.png (matplotlib is not installed: pip install matplotlib)")
    document["out"] = str(out)
    return document
