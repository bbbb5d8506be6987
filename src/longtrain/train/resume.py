"""A run's state in a checkpoint, and a run continued from one.

What a checkpoint holds is everything a resumed run needs to go on as if it had never
stopped: the trainable weights, the optimizer's state, the RNG states, the step and
the data position, and what the run was (its identity, settings, strategy, parameters
and process count) so a resume with a different model or setup is refused instead of
silently mixing the two. Under layer groups or sharded parameters each process writes
and reads its own pair of files. The atomic writing and verification are
:mod:`longtrain.train.run_checkpoints`'s.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import LongtrainError
from . import run_checkpoints as ckpt
from .config import TrainConfig, option, warmup_steps
from .records import fingerprint_change
from .run_dir import checkpoints_dir
from .schedule import make_scheduler

__all__ = [
    "check_checkpoint", "checkpoint_files", "continue_schedule", "finite_weights", "identity", "load", "resume_point", "save",
    "settings", "trainable_parameters",
]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP) tensor, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _local_tensors(obj):
    """``obj`` (an optimizer state dict) with every sharded tensor replaced by this rank's shard."""
    if isinstance(obj, dict):
        return {k: _local_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local_tensors(v) for v in obj)
    return _local(obj) if isinstance(obj, torch.Tensor) else obj


def _as_parameters_shards(optimizer, state: dict) -> dict:
    """The inverse of :func:`_local_tensors` for an optimizer's state: each parameter's
    state tensors become shards laid out as the (sharded) parameter is."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in state["state"].items():
        param = params[int(index)]
        if not isinstance(param, DTensor):
            continue
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape and value.dim() > 0:
                entry[key] = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                                shape=param.shape, stride=param.stride())
    return state


def trainable_parameters(model) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters this process holds (under layer groups, its own layers')."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad and not p.is_meta}


def finite_weights(model) -> bool:
    """Whether every trainable weight this process holds is finite."""
    return all(bool(torch.isfinite(_local(p)).all()) for p in trainable_parameters(model).values())


def _fingerprint(model) -> dict:
    """Names and shapes of every trainable parameter, on whichever rank it lives."""
    return {name: list(p.shape) for name, p in model.named_parameters() if p.requires_grad}


def identity(config: TrainConfig) -> dict:
    """The settings a resumed run must share with its checkpoint (TrainConfig.IDENTITY);
    --loss-on not given is the "assistant" it means (and checkpoints always recorded)."""
    values = {k: getattr(config, k) for k in TrainConfig.IDENTITY}
    values["loss_on"] = values["loss_on"] or "assistant"
    return values


_PATHS = ("model", "data", "tokenizer")  # settings that name a file or folder


def _same_path(was, now) -> bool:
    """Whether two spellings of --model, --data or --tokenizer name one existing file or folder
    from here (``mdl``, ``./mdl``, ``/abs/mdl``)."""
    return (isinstance(was, str) and isinstance(now, str) and os.path.exists(now)
            and os.path.realpath(was) == os.path.realpath(now))


def settings(config: TrainConfig, dtype: torch.dtype) -> dict:
    """The settings a resumed run may change (TrainConfig.ADJUSTABLE), as this run has them."""
    values = {k: getattr(config, k) for k in TrainConfig.ADJUSTABLE}
    values["warmup_steps"] = warmup_steps(config)  # the one in effect, not "default"
    values["dtype"] = str(dtype).replace("torch.", "")  # likewise
    return values


def checkpoint_files(ranks) -> tuple[str, str]:
    """This rank's checkpoint files (one pair per rank under layer groups)."""
    if not ranks.distributed:
        return "weights.safetensors", "trainer_state.pt"
    return f"weights-rank{ranks.rank}.safetensors", f"trainer_state-rank{ranks.rank}.pt"


def save(checkpoints: Path, config: TrainConfig, ranks, *, model, optimizer, scheduler, strategy, dtype: torch.dtype,
         step: int, samples_seen: int, data: dict | None = None) -> Path:
    """Checkpoint the run at ``step`` in ``checkpoints`` (every rank calls it); its directory.
    ``data``: the fingerprint of --data (:func:`longtrain.train.records.fingerprint`), which
    a resume must match."""
    trainable = trainable_parameters(model)
    weights_file, state_file = checkpoint_files(ranks)

    def weights(path):  # this rank's parameters (its layers, or its shards)
        save_file({n: _local(p).detach().to("cpu").contiguous() for n, p in trainable.items()}, str(path))

    def state(path):
        torch.save(
            {
                "optimizer": _local_tensors(optimizer.state_dict()),
                "scheduler": scheduler.state_dict(),
                "rng": {
                    "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                    "python": random.getstate(),
                },
            },
            path,
        )

    meta = {
        "step": step,
        "samples_seen": samples_seen,
        "identity": identity(config),
        "settings": settings(config, dtype),
        "strategy": strategy.to_dict(),
        "parameters": _fingerprint(model),
        "processes": ranks.world_size,
    }
    if data is not None:
        meta["data"] = data
    return ckpt.save_checkpoint(
        checkpoints, step, {weights_file: weights, state_file: state}, meta,
        keep=config.keep_checkpoints, ranks=ranks,
    )


def check_checkpoint(path: Path, config: TrainConfig, ranks, *, model, data: dict | None = None) -> dict:
    """Refuse, in one line, the checkpoint at ``path`` if it is corrupt or of another run:
    other settings, model, process count or data (``data``: this run's fingerprint of
    --data), or a step beyond --steps; its metadata. Reads the manifest and checksums,
    not the tensors: a run checks before it touches its --out."""
    meta = ckpt.verify_checkpoint(path)
    saved_identity = meta.get("identity", {})
    defaults = identity(TrainConfig())
    for key, value in identity(config).items():
        was = saved_identity.get(key, defaults[key])  # a setting newer than the checkpoint had its default
        if was != value and not (key in _PATHS and _same_path(was, value)):
            same = " (leave --loss-on out: that is assistant)" if key == "loss_on" and was == "assistant" else ""
            raise LongtrainError(
                f"checkpoint {path} was written with {key}={was!r} but this run has {key}={value!r}; "
                f"resume with the same settings{same} or start a new --out"
            )
    if meta.get("parameters") != _fingerprint(model):
        raise LongtrainError(f"checkpoint {path} holds parameters of a different model; resume with the model it was written for")
    if meta.get("processes", 1) != ranks.world_size:
        raise LongtrainError(
            f"checkpoint {path} was written by {meta.get('processes', 1)} processes but this run has {ranks.world_size}; "
            "resume with the same --nproc-per-node"
        )
    if meta["step"] > config.steps:
        raise LongtrainError(f"checkpoint {path} is at step {meta['step']}, beyond --steps {config.steps}; "
                             f"pass --steps {meta['step']} or more")
    saved_data = meta.get("data")  # checkpoints written before fingerprints were kept have none
    if saved_data is not None and data is not None and saved_data != data:
        raise LongtrainError(
            f"--data {config.data} is not the data checkpoint {path} was trained on ({fingerprint_change(saved_data, data)}); "
            "restore the data it trained on to resume, or train on this data in a new --out"
        )
    return meta


def load(path: Path, config: TrainConfig, ranks, *, model, optimizer, dtype: torch.dtype, data: dict | None = None,
         meta: dict | None = None):
    """Restore the checkpoint at ``path`` into ``model``, ``optimizer`` and the RNGs,
    refusing one of another run (:func:`check_checkpoint`, skipped where ``meta`` is what
    it returned for ``path``); ``(scheduler, step, samples_seen)`` to continue with."""
    if meta is None:
        meta = check_checkpoint(path, config, ranks, model=model, data=data)
    weights_file, state_file = checkpoint_files(ranks)
    try:
        weights = load_file(str(path / weights_file))
        state = torch.load(path / state_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any decoding failure means a corrupt file
        reason = " ".join(str(exc).split())[:200]
        raise LongtrainError(f"checkpoint {path} cannot be read ({reason}); pass --resume-from with an earlier checkpoint "
                             f"(ls {path.parent})") from None
    with torch.no_grad():
        for name, param in trainable_parameters(model).items():
            _local(param).copy_(weights[name])
    optimizer.load_state_dict(_as_parameters_shards(optimizer, state["optimizer"]))
    scheduler = continue_schedule(optimizer, config, dtype, ranks, meta["step"], meta.get("settings", {}))
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():  # as many GPUs as this machine shows (a resume may see fewer)
        for index, rng in enumerate(state["rng"]["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, index)
    random.setstate(state["rng"]["python"])
    return scheduler, meta["step"], meta["samples_seen"]


def continue_schedule(optimizer, config: TrainConfig, dtype: torch.dtype, ranks, step: int, saved: dict):
    """Resume the learning-rate schedule at ``step`` from this run's settings; the scheduler.

    The rule: the schedule is a function of the step and the current --lr,
    --warmup-steps and --steps (warm-up, then cosine to 10% at --steps), as if the run
    had been planned with them from the start. Unchanged settings give the very rates
    the checkpointed run would have used; a changed one (a longer --steps for a
    finished run, a new --lr) takes effect from ``step`` on and is logged, as is a new
    --weight-decay or dtype. Nothing the checkpoint holds overrides what was asked."""
    c = config
    for group in optimizer.param_groups:
        group["initial_lr"] = c.lr  # LambdaLR's base rate
        if "weight_decay" in group:
            group["weight_decay"] = c.weight_decay
    scheduler = make_scheduler(optimizer, c, last_epoch=step - 1)
    changed = {k: (saved[k], v) for k, v in settings(c, dtype).items() if k in saved and saved[k] != v}
    if not changed or not ranks.main:
        return scheduler
    for key, (was, now) in changed.items():
        print(f"longtrain train: resuming with {option(key)} {now} (the checkpoint's run had {was}), applied from step {step}",
              flush=True)
    if changed.keys() & {"lr", "warmup_steps", "steps"}:
        print(f"longtrain train: the learning rate continues at {scheduler.get_last_lr()[0]:.3g} "
              f"(warm-up {warmup_steps(c)} steps, cosine to 10% of --lr {c.lr:g} at step {c.steps})", flush=True)
    return scheduler


def resume_point(out: Path, config: TrainConfig, ranks, say: bool = True) -> Path | None:
    """The checkpoint to continue from: --resume-from's, or with --resume the run's
    latest (none yet: the run starts from step 0, which is all there is to continue;
    ``say`` says so)."""
    if config.resume_from:
        return ckpt.resolve_checkpoint(config.resume_from)
    if config.resume:
        path = ckpt.latest_checkpoint(checkpoints_dir(out))
        if path is None and say and ranks.main:
            print(f"longtrain train: {out} holds no checkpoint yet; starting from step 0", flush=True)
        return path
    return None
