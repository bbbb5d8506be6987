"""The training loop behind ``longtrain train``.

One obvious path: build or load the model, wrap it (LoRA) and apply the strategy, then
for each optimizer step run ``grad_accum`` micro-batches through the strategy's engine
with the loss normalized by the label tokens of the whole step, clip, step, measure,
log, and checkpoint atomically. Everything a resumed run needs — weights, optimizer,
scheduler, RNG states and the data position — is in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..engines.batch import count_label_tokens
from ..engines.backprop import forward_loss
from ..errors import LongtrainError, writing
from ..memory.flops import device_peak_flops, mfu, model_flops_per_sample
from ..memory.allocator import allocator_setting
from ..memory.measure import StepMemoryMeter
from ..memory.units import format_bytes
from ..models.loading import add_lora, build_from_config, is_model_dir, load_config, load_pretrained, parse_dtype
from ..models.presets import packaged_checkpoint
from ..optimizers import make_optimizer
from ..optimizer_offload import HostAdamW, streaming
from ..strategy import Strategy, applied_context, apply, engine_context, pinned_host_bytes, step as strategy_step
from . import checkpoint as ckpt
from .config import MAX_SEQ_LEN, TrainConfig, check_config, config_from_dict, option  # noqa: F401  (re-exported: the Python API)
from .data import TokenWindows, collate
from .lock import RunLock, check_not_in_use
from .metrics import MetricsLog, check_tensorboard, read_metrics, strict_json
from .passkey import PasskeyTask
from .plot import plot_metrics
from .ranks import Ranks, check_distributed_engine
from .tokenizer import ByteTokenizer, load_tokenizer


class WarmupCosine:
    """Linear warm-up then cosine decay to 10% (a picklable LambdaLR factor)."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def resolve_device(name: str) -> torch.device:
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


def build_model(config: TrainConfig, dtype: torch.dtype):
    """The model and tokenizer a config names, with LoRA when asked (strategy not applied)."""
    pretrained = trained_weights(config)
    model_config = load_config(pretrained or config.model)
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and config.seq_len > max_pos:
        if pretrained == config.model and not config.extend_context:  # a user's model; a preset's grows
            raise LongtrainError(
                f"--seq-len {config.seq_len:,} exceeds the model's max_position_embeddings ({max_pos:,}); "
                "pass --extend-context to train beyond it (and set rope_scaling in its config.json for a pretrained model)"
            )
        model_config.max_position_embeddings = config.seq_len
    tokenizer = load_tokenizer(pretrained, config.tokenizer)
    if model_config.vocab_size < tokenizer.vocab_size:
        raise LongtrainError(
            f"the model's vocabulary ({model_config.vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size}); "
            "use the model's own tokenizer (--tokenizer auto) or a preset"
        )
    torch.manual_seed(config.seed)
    if pretrained:
        model = load_pretrained(pretrained, dtype)
        model.config.max_position_embeddings = model_config.max_position_embeddings
    else:
        model = build_from_config(model_config, dtype)
    model.config.use_cache = False
    if config.lora:
        model = add_lora(model, config.lora_rank, dropout=config.lora_dropout)
    return model, tokenizer


@torch.no_grad()
def held_out_loss(model, samples: list[dict], pad_id: int, device: torch.device) -> dict:
    """Mean next-token loss over held-out ``samples``, one forward each without a graph,
    through the model's applied strategy (MsT's head keeps the logits chunked) or plain
    backprop for a model without one (a gathered copy)."""
    context = applied_context(model) or engine_context(model, Strategy())
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for sample in samples:
            batch = {k: v.to(device) for k, v in collate([sample], pad_id).items()}
            count = count_label_tokens(batch["labels"])
            total += float(forward_loss(context, batch, max(count, 1))) * count  # the sum of token losses
            tokens += count
    finally:
        model.train(was_training)
    return {"loss": total / max(tokens, 1), "samples": len(samples), "tokens": tokens}


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


def _trainable(model) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters this process holds (under layer groups, its own layers')."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad and not p.is_meta}


def _fingerprint(model) -> dict:
    """Names and shapes of every trainable parameter, on whichever rank it lives."""
    return {name: list(p.shape) for name, p in model.named_parameters() if p.requires_grad}


def _planned_strategy(config: TrainConfig, device: torch.device, compute_dtype: torch.dtype) -> Strategy:
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


def _strategy(config: TrainConfig, compute_dtype: torch.dtype, device: torch.device | None = None) -> Strategy:
    if config.strategy == "auto":
        return _planned_strategy(config, device or torch.device("cpu"), compute_dtype)
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


class Trainer:
    def __init__(self, config: TrainConfig):
        check_config(config)  # types, ranges and combinations of every field (train/config.py)
        self.config = config
        self.device = resolve_device(config.device)
        compute = self.compute_dtype = parse_dtype(config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        # The parameters' dtype: the compute dtype, or with --master-weights (FSDP2 mixed precision) their own.
        self.dtype = parse_dtype(config.master_weights) if config.master_weights else compute
        self.strategy = _strategy(config, compute, self.device)
        self.out = Path(config.out)
        self.checkpoints = self.out / "checkpoints"
        self._lock = RunLock(self.out)  # held from the first write to --out until the run ends
        if os.environ.get("RANK", "0") == "0":  # the process that will hold the lock (torchrun's others never take it)
            check_not_in_use(self.out)
        self._check_output_dir()  # before the model is built: a refusal costs nothing
        if config.tensorboard:
            check_tensorboard()
        self.ranks = Ranks.from_env(self.device, config.sp)
        check_distributed_engine(self.ranks, self.strategy.engine)
        if config.optimizer_offload and self.ranks.distributed:  # its clipping norm is this process's alone
            raise LongtrainError(f"--optimizer-offload keeps AdamW's state in one process's host memory; {self.ranks.world_size} "
                                 "processes were launched: run one process, or drop --optimizer-offload (layer groups "
                                 "already split the optimizer state over the processes)")

        self.model, self.tokenizer = build_model(config, self.dtype)
        self.model.to(self.device).train()
        apply(self.model, self.strategy)  # under --sp this shards the parameters over the ranks (FSDP2)
        if self.ranks.distributed and self.strategy.engine == "adjoint":
            from ..parallel.layer_groups import shard_model

            shard_model(applied_context(self.model), self.ranks.rank, self.ranks.world_size)

        if config.data is None:
            if not isinstance(self.tokenizer, ByteTokenizer):
                raise LongtrainError("the built-in pass-key task needs the byte tokenizer (a preset model); pass --data for this model")
            self.task = PasskeyTask(self.tokenizer, config.seq_len, seed=config.seed, loss_on=config.task_loss)
            self.data = self.task
        else:
            self.task = None
            self.data = TokenWindows(config.data, self.tokenizer, config.seq_len, seed=config.seed, packing=config.packing,
                                     held_out=config.eval_samples, loss_on=config.loss_on)
        if config.packing == "auto":  # the packing the data settled on is what a resumed run must share
            self.config = config = dataclasses.replace(config, packing=self.data.packing if self.task is None else "concat")

        # Only now, with the model and data known to be good, touch the output directory.
        try:
            self._prepare_output_dir()
            self.ranks.barrier()
            optimizer = "adamw-offload" if config.optimizer_offload else config.optimizer
            self.optimizer = make_optimizer(optimizer, self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                            model=self.model)
        except BaseException:
            self._lock.release()
            raise
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupCosine(config.warmup_steps, config.steps))
        self.step_index = 0
        self.samples_seen = 0
        self.history: list[dict] = []

    # ---- output directory and checkpoints ---------------------------------------------
    def _check_output_dir(self) -> None:
        """Refuse an --out that cannot take this run, touching nothing: a path through a
        file, or a run with a checkpoint (or a final model) that this command neither
        resumes nor replaces. A start that stopped before its first checkpoint has
        nothing to continue: it is simply started again."""
        c = self.config
        blocker = next((p for p in (self.out, *self.out.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise LongtrainError(f"--out {self.out} cannot be a run directory: {blocker} is a file; pass --out a directory path")
        if c.overwrite:
            return
        if (self.checkpoints / ckpt.LATEST).is_file() and not (c.resume or c.resume_from):
            step = ckpt.checkpoint_step(self.checkpoints / (self.checkpoints / ckpt.LATEST).read_text().strip())
            at = f"step {step}" if step is not None else "unreadable"
            raise LongtrainError(f"{self.out} already holds a run (last checkpoint: {at}); pass --resume to continue it, "
                                 "--out NEW_DIR to start another beside it, or --overwrite to replace it")
        if (self.out / "final").exists() and not (self.checkpoints / ckpt.LATEST).is_file() and not c.resume_from:
            raise LongtrainError(f"{self.out} holds a trained model (final/) but no checkpoint to continue from; "
                                 "pass --out NEW_DIR, or --overwrite to replace it")

    def _prepare_output_dir(self) -> None:
        """Create --out and lock it (another run holding it is refused), check again what
        it holds (a run may have ended there since the first look), check it takes files,
        and clear what interrupted saves left."""
        c = self.config
        if not self.ranks.main:
            return
        with writing("the run directory", self.out):
            self.out.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
            self._check_output_dir()
            if c.overwrite:
                for child in ("checkpoints", "metrics.jsonl", "metrics.png", "summary.json", "final", "tensorboard"):
                    path = self.out / child
                    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            tempfile.TemporaryFile(dir=self.out).close()  # writable? better now than at the first checkpoint
            ckpt.remove_leftovers(self.checkpoints)
            for stale in [*self.out.glob(".*.tmp-*"), *self.out.glob(".final.old-*")]:  # interrupted atomic writes
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()

    def _identity(self) -> dict:
        return {k: getattr(self.config, k) for k in TrainConfig.IDENTITY}

    def _settings(self) -> dict:
        """The settings a resumed run may change (TrainConfig.ADJUSTABLE), as this run has them."""
        settings = {k: getattr(self.config, k) for k in TrainConfig.ADJUSTABLE}
        settings["dtype"] = str(self.dtype).replace("torch.", "")  # the one in effect, not "default"
        return settings

    # ---- divergence ------------------------------------------------------------------------
    def _flagged(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (every rank must call it)."""
        return bool(self.ranks.max(float(flag))) if self.ranks.distributed else flag

    def _check_finite(self, loss: float, grad_norm: float) -> None:
        """Stop at the first step whose loss or gradient norm is NaN or infinite."""
        bad_loss = self._flagged(not math.isfinite(loss))
        if bad_loss or not math.isfinite(grad_norm):  # the norm is the same on every rank
            what = f"the loss is {loss}" if bad_loss and not math.isfinite(loss) else \
                "the loss is not finite on another rank" if bad_loss else f"the gradient norm is {grad_norm}"
            raise self._diverged(what, step=self.step_index + 1)

    def _diverged(self, what: str, step: int | None = None) -> LongtrainError:
        """One line: the step, what was not finite, what was kept and what to try."""
        c = self.config
        step = self.step_index if step is None else step
        pointer = self.checkpoints / ckpt.LATEST
        at = ckpt.checkpoint_step(self.checkpoints / pointer.read_text().strip()) if pointer.is_file() else None
        kept = (f"{pointer} still names the last good checkpoint (step {at})" if at is not None
                else "no checkpoint was written")
        try_ = f"lower --lr (now {c.lr:g}) or lengthen --warmup-steps (now {c.warmup_steps})"
        if self.compute_dtype == torch.float16:
            try_ = "use --dtype bfloat16 or float32 (float16 without loss scaling overflows), or " + try_
        then = "then continue with --resume" if at is not None else "then start again"
        return LongtrainError(f"training diverged at step {step}: {what}; nothing of step {step} was saved and {kept}; "
                              f"{try_}, {then}")

    def _files(self) -> tuple[str, str]:
        """This rank's checkpoint files (one pair per rank under layer groups)."""
        if not self.ranks.distributed:
            return "weights.safetensors", "trainer_state.pt"
        return f"weights-rank{self.ranks.rank}.safetensors", f"trainer_state-rank{self.ranks.rank}.pt"

    def save(self) -> Path:
        trainable = _trainable(self.model)
        if self._flagged(not all(bool(torch.isfinite(_local(p)).all()) for p in trainable.values())):
            raise self._diverged("the optimizer step left non-finite weights")
        weights_file, state_file = self._files()

        def weights(path):  # this rank's parameters (its layers, or its shards)
            save_file({n: _local(p).detach().to("cpu").contiguous() for n, p in trainable.items()}, str(path))

        def state(path):
            torch.save(
                {
                    "optimizer": _local_tensors(self.optimizer.state_dict()),
                    "scheduler": self.scheduler.state_dict(),
                    "rng": {
                        "torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                        "python": random.getstate(),
                    },
                },
                path,
            )

        meta = {
            "step": self.step_index,
            "samples_seen": self.samples_seen,
            "identity": self._identity(),
            "settings": self._settings(),
            "strategy": self.strategy.to_dict(),
            "parameters": _fingerprint(self.model),
            "processes": self.ranks.world_size,
        }
        return ckpt.save_checkpoint(
            self.checkpoints, self.step_index, {weights_file: weights, state_file: state}, meta,
            keep=self.config.keep_checkpoints, ranks=self.ranks,
        )

    def load(self, path: Path) -> None:
        meta = ckpt.verify_checkpoint(path)
        identity = meta.get("identity", {})
        defaults = TrainConfig()
        for key, value in self._identity().items():
            was = identity.get(key, getattr(defaults, key))  # a setting newer than the checkpoint had its default
            if was != value:
                raise LongtrainError(
                    f"checkpoint {path} was written with {key}={was!r} but this run has {key}={value!r}; "
                    "resume with the same settings or start a new --out"
                )
        if meta.get("parameters") != _fingerprint(self.model):
            raise LongtrainError(f"checkpoint {path} holds parameters of a different model; resume with the model it was written for")
        if meta.get("processes", 1) != self.ranks.world_size:
            raise LongtrainError(
                f"checkpoint {path} was written by {meta.get('processes', 1)} processes but this run has {self.ranks.world_size}; "
                "resume with the same --nproc-per-node"
            )
        if meta["step"] > self.config.steps:
            raise LongtrainError(f"checkpoint {path} is at step {meta['step']}, beyond --steps {self.config.steps}; "
                                 f"pass --steps {meta['step']} or more")
        weights_file, state_file = self._files()
        try:
            weights = load_file(str(path / weights_file))
            state = torch.load(path / state_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any decoding failure means a corrupt file
            reason = " ".join(str(exc).split())[:200]
            raise LongtrainError(f"checkpoint {path} cannot be read ({reason}); pass --resume-from with an earlier checkpoint "
                                 f"(ls {path.parent})") from None
        with torch.no_grad():
            for name, param in _trainable(self.model).items():
                _local(param).copy_(weights[name])
        self.optimizer.load_state_dict(_as_parameters_shards(self.optimizer, state["optimizer"]))
        self._continue_schedule(meta["step"], meta.get("settings", {}))
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] and torch.cuda.is_available():  # as many GPUs as this machine shows (a resume may see fewer)
            for index, rng in enumerate(state["rng"]["cuda"][:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(rng, index)
        random.setstate(state["rng"]["python"])
        self.step_index = meta["step"]
        self.samples_seen = meta["samples_seen"]

    def _continue_schedule(self, step: int, saved: dict) -> None:
        """Resume the learning-rate schedule at ``step`` from this run's settings.

        The rule: the schedule is a function of the step and the current --lr,
        --warmup-steps and --steps (warm-up, then cosine to 10% at --steps), as if the run
        had been planned with them from the start. Unchanged settings give the very rates
        the checkpointed run would have used; a changed one (a longer --steps for a
        finished run, a new --lr) takes effect from ``step`` on and is logged, as is a new
        --weight-decay or dtype. Nothing the checkpoint holds overrides what was asked."""
        c = self.config
        for group in self.optimizer.param_groups:
            group["initial_lr"] = c.lr  # LambdaLR's base rate
            if "weight_decay" in group:
                group["weight_decay"] = c.weight_decay
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupCosine(c.warmup_steps, c.steps),
                                                           last_epoch=step - 1)
        changed = {k: (saved[k], v) for k, v in self._settings().items() if k in saved and saved[k] != v}
        if not changed or not self.ranks.main:
            return
        for key, (was, now) in changed.items():
            print(f"longtrain train: resuming with {option(key)} {now} (the checkpoint's run had {was}), applied from step {step}",
                  flush=True)
        if changed.keys() & {"lr", "warmup_steps", "steps"}:
            print(f"longtrain train: the learning rate continues at {self.scheduler.get_last_lr()[0]:.3g} "
                  f"(warm-up {c.warmup_steps} steps, cosine to 10% of --lr {c.lr:g} at step {c.steps})", flush=True)

    def _resume_point(self) -> Path | None:
        """The checkpoint to continue from: --resume-from's, or with --resume the run's
        latest (none yet: the run starts from step 0, which is all there is to continue)."""
        c = self.config
        if c.resume_from:
            return ckpt.resolve_checkpoint(c.resume_from)
        if c.resume:
            path = ckpt.latest_checkpoint(self.checkpoints)
            if path is None and self.ranks.main:
                print(f"longtrain train: {self.out} holds no checkpoint yet; starting from step 0", flush=True)
            return path
        return None

    # ---- the loop ------------------------------------------------------------------------
    def _micro_batches(self) -> list[dict]:
        """This rank's micro-batches: its data-parallel group's share of the step's samples
        (every rank of a sequence-parallel group reads the same ones)."""
        c = self.config
        batches = []
        own = self.samples_seen + self.ranks.data_rank * c.batch_size * c.grad_accum
        for micro in range(c.grad_accum):
            first = own + micro * c.batch_size
            samples = [self.data.sample(first + i) for i in range(c.batch_size)]
            batch = collate(samples, self.tokenizer.pad_token_id)
            batches.append({k: v.to(self.device) for k, v in batch.items()})
        return batches

    def full_model(self):
        """The whole model: this one, or under layer groups or sharded parameters the
        ranks' parameters gathered into a fresh copy on rank 0 (None on the other ranks).
        Every rank must call it (it gathers)."""
        if not self.ranks.distributed:
            return self.model
        state = self.ranks.full_state(self.model)
        if not self.ranks.main:
            return None
        model, _ = build_model(self.config, self.dtype)
        model.load_state_dict(state, strict=True)
        return model.to(self.device)

    def evaluate(self) -> dict | None:
        """The pass-key task's accuracy, or the held-out loss of a --data run (None
        without held-out windows, and on ranks other than 0)."""
        if self.task is None and len(self.data.held_rows) == 0:
            return None
        model = self.full_model()
        return None if model is None else self._evaluate(model)

    def _evaluate(self, model) -> dict | None:
        if self.task is not None:
            return self.task.evaluate(model, self.config.eval_samples, self.device)
        if len(self.data.held_rows) == 0:
            return None
        samples = [self.data.held_out_sample(i) for i in range(len(self.data.held_rows))]
        return held_out_loss(model, samples, self.tokenizer.pad_token_id, self.device)

    def train(self) -> dict:
        """Train to --steps (or continue); the summary (empty on ranks other than 0). The
        run's lock on --out is let go when it returns or fails."""
        try:
            return self._train()
        finally:
            self._lock.release()

    def _train(self) -> dict:
        c = self.config
        resume = self._resume_point()
        if resume is not None:
            self.load(resume)
        if self.step_index >= c.steps:  # resumed at its last step (load refuses a later one)
            return self._at_the_end(resume)
        # Records past the checkpoint (or of a start without one) are redone: dropped with the first new one.
        log = MetricsLog(self.out / "metrics.jsonl", self.out / "tensorboard" if c.tensorboard else None,
                         after_step=self.step_index) if self.ranks.main else None
        if self.task is not None and self.step_index == 0 and trained_weights(c):  # the accuracy fine-tuning starts from
            before = self.evaluate()
            if before is not None and log is not None:
                log.write({"step": 0, "eval": before})
                print(f"longtrain train: starting from the weights in {trained_weights(c)}: pass-key accuracy "
                      f"{before['digit_accuracy']:.1%} of answer digits before training (chance 10%)", flush=True)
        flops_per_sample = model_flops_per_sample(self.model, c.seq_len) if hasattr(self.model, "get_input_embeddings") else None
        peak_flops = device_peak_flops(self.device)
        tokens_per_step = c.seq_len * c.batch_size * c.grad_accum * self.ranks.data_parallel  # every group's
        trainable = list(_trainable(self.model).values())
        peak_bytes, reserved_bytes, step_times = 0, 0, []
        bar = tqdm(total=c.steps, initial=self.step_index, disable=not (c.progress and self.ranks.main), desc="train", unit="step", dynamic_ncols=True)
        start = time.perf_counter()
        try:
            with StepMemoryMeter(self.device, self.model, self.optimizer) as meter:
                while self.step_index < c.steps:
                    meter.start_step()
                    t0 = time.perf_counter()
                    batches = self._micro_batches()
                    n_label = self.ranks.sum_over_data_parallel(sum(count_label_tokens(b["labels"]) for b in batches), self.device)
                    loss = 0.0
                    for k, b in enumerate(batches):  # with --optimizer-offload the last one streams its gradients to the host
                        with streaming(self.optimizer, last=k == len(batches) - 1):
                            loss += float(strategy_step(self.model, b, self.strategy, num_label_tokens=n_label))
                    if isinstance(self.optimizer, HostAdamW):
                        grad_norm = self.optimizer.clip_grad_norm(c.max_grad_norm)
                    else:
                        grad_norm = self.ranks.clip_grad_norm(trainable, c.max_grad_norm)
                    self._check_finite(loss, grad_norm)  # before the optimizer step: a diverged step changes nothing
                    lr = self.scheduler.get_last_lr()[0]
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    seconds = time.perf_counter() - t0
                    peak = meter.end_step()
                    self.step_index += 1
                    self.samples_seen += c.batch_size * c.grad_accum * self.ranks.data_parallel
                    step_times.append(seconds)
                    peak_bytes = max(peak_bytes, peak.peak_bytes)
                    record = {
                        "step": self.step_index, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                        "tokens_per_s": tokens_per_step / seconds, "step_seconds": seconds, "peak_bytes": peak.peak_bytes,
                    }
                    if peak.reserved_bytes is not None:
                        record["reserved_bytes"] = peak.reserved_bytes
                        reserved_bytes = max(reserved_bytes, peak.reserved_bytes)
                    if flops_per_sample and peak_flops:
                        per_rank = flops_per_sample * c.batch_size * c.grad_accum * self.ranks.data_parallel / self.ranks.world_size
                        record["mfu"] = mfu(per_rank, seconds, peak_flops)
                    if log is not None:
                        log.write(record)
                    self.history.append(record)
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / seconds:,.0f}", mem=format_bytes(peak.peak_bytes))
                    if c.eval_every and self.step_index % c.eval_every == 0 and self.step_index < c.steps:
                        result = self.evaluate()
                        if result is not None and log is not None:
                            log.write({"step": self.step_index, "eval": result})
                    if self.step_index % c.save_every == 0 or self.step_index == c.steps:
                        self.save()
        finally:
            bar.close()
            if log is not None:
                log.close()
        return self._finish(peak_bytes, reserved_bytes, step_times, start)

    def _at_the_end(self, resume: Path) -> dict:
        """A run resumed at its last step: nothing to train. If it was stopped after its
        last checkpoint but before its final model and summary, those are written now;
        otherwise nothing is touched."""
        c = self.config
        finished = (self.out / "final").is_dir() and (self.out / "summary.json").is_file()
        if self.ranks.main:
            run = resume if c.resume_from else self.out
            print(f"longtrain train: {run} already finished step {self.step_index} of --steps {c.steps}; nothing to train, "
                  + ("nothing changed" if finished else "writing its final model and summary, which are missing")
                  + f" (pass --steps above {c.steps} to continue it)", flush=True)
        if finished:
            self.ranks.close()
            return {}
        return self._finish(0, 0, [], time.perf_counter())

    def _finish(self, peak_bytes: int, reserved_bytes: int, step_times: list[float], start: float) -> dict:
        """Evaluate, write final/, metrics.png and summary.json (rank 0); the summary."""
        c = self.config
        model = self.full_model()
        peak_bytes = int(self.ranks.max(peak_bytes))  # under layer groups: the largest rank's
        reserved_bytes = int(self.ranks.max(reserved_bytes))
        if model is None:  # a rank other than 0 of several: rank 0 evaluates and reports
            self.ranks.close()
            return {}
        evaluation = self._evaluate(model)
        if evaluation is not None and not self._eval_logged():
            with writing("the metrics log", self.out / "metrics.jsonl"), open(self.out / "metrics.jsonl", "a") as f:
                f.write(strict_json({"step": self.step_index, "eval": evaluation}) + "\n")
        base_config = self.model.get_base_model().config if c.lora else self.model.config  # before LoRA is merged
        self._save_final(model)
        self._plot()
        summary = self._summary(evaluation, peak_bytes, reserved_bytes, step_times, time.perf_counter() - start, base_config)
        self.ranks.close()
        return summary

    def _eval_logged(self) -> bool:
        """Whether metrics.jsonl holds an evaluation at this step already (a run stopped
        while writing its final model logged it before)."""
        path = self.out / "metrics.jsonl"
        return path.exists() and any("eval" in r and r.get("step") == self.step_index for r in read_metrics(path))

    def _plot(self) -> None:
        """metrics.png beside metrics.jsonl, over the whole run (resumed parts included)."""
        if plot_metrics(read_metrics(self.out / "metrics.jsonl"), self.out / "metrics.png") is None:
            print("longtrain train: no metrics.png (matplotlib is not installed: pip install 'longtrain[plot]')", flush=True)

    def _save_final(self, model) -> None:
        """The trained model in final/, replaced as a whole: written beside, then swapped in."""
        final = self.out / "final"
        tmp, old = self.out / f".final.tmp-{os.getpid()}", self.out / f".final.old-{os.getpid()}"
        with writing("the final model", final, "continue with --resume"):
            try:
                if self.config.lora:
                    self._save_lora(model, tmp)
                else:
                    model.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if final.exists():
                os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)

    def _save_lora(self, peft_model, final: Path) -> None:
        """A LoRA run's final/: the merged model (what transformers and `longtrain train
        --model` load) and, in final/adapter, the adapter for peft. The adapter names its
        base by absolute path: the --model directory, or for a preset (random weights that
        exist only in this run) the base saved in final/base. Merging is the last use of
        the model, so it is done in place."""
        c = self.config
        base = peft_model.get_base_model()
        config = peft_model.peft_config[peft_model.active_adapter]
        if is_model_dir(c.model):
            config.base_model_name_or_path = os.path.abspath(c.model)
        else:
            base_weights = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
            base.save_pretrained(final / "base", state_dict=base_weights)
            self.tokenizer.save_pretrained(final / "base")
            config.base_model_name_or_path = os.path.abspath(self.out / "final" / "base")
        # save_embedding_layers=False: peft would otherwise look the base up on the Hub to
        # decide whether to save embeddings; nothing here trains them.
        peft_model.save_pretrained(final / "adapter", save_embedding_layers=False)
        peft_model.merge_and_unload().save_pretrained(final)

    def _summary(self, evaluation, peak_bytes, reserved_bytes, step_times, seconds, base_config) -> dict:
        from ..plan.simulate import simulate

        c = self.config
        # The whole run's losses, the parts before a resume included.
        losses = [r["loss"] for r in read_metrics(self.out / "metrics.jsonl") if "loss" in r]
        window = max(1, min(10, len(losses) // 4))
        steady = step_times[1:] or step_times
        # LoRA is not simulated yet: the stock figure is full fine-tuning, an upper bound.
        stock = simulate(base_config, c.seq_len, batch_size=c.batch_size, strategy="none", optimizer=c.optimizer, dtype=self.dtype)
        summary = {
            "model": c.model, "seq_len": c.seq_len, "strategy": self.strategy.name, "steps": self.step_index,
            "steps_trained": len(step_times),  # by this command (fewer than "steps" when it resumed)
            "first_loss": sum(losses[:window]) / window if losses else None,
            "final_loss": sum(losses[-window:]) / window if losses else None,
            "task": evaluation,
            # The pass-key accuracy before the first step (logged as step 0 by a run that started from it).
            "task_before": next((r["eval"] for r in read_metrics(self.out / "metrics.jsonl")
                                 if r.get("step") == 0 and "eval" in r), None) if self.task is not None else None,
            "tokens_per_s": c.seq_len * c.batch_size * c.grad_accum * len(steady) / sum(steady) if steady else None,
            "measured_peak_bytes": peak_bytes,
            "measured_with": "cuda-allocator" if self.device.type == "cuda" else "tracked-storages",
            # What runs out on a GPU is the allocator's reservation (fragmentation included), and the setting that shapes it.
            "measured_reserved_bytes": reserved_bytes if self.device.type == "cuda" else None,
            "allocator": allocator_setting() if self.device.type == "cuda" else None,
            # The kernel of unmasked attention blocks (masks and soft-capping use explicit scores).
            "attention_kernel": _attention_kernel(base_config, self.device, self.compute_dtype),
            # Host memory longtrain parked chunks in (chunked attention's pinned pool).
            "host_pool_bytes": pinned_host_bytes(self.model),
            "simulated_stock_peak_bytes": stock.device_peak_bytes,
            "simulated_stock_setup": "full fine-tuning" if c.lora else "same setup",
            "seconds": seconds,
            "device": str(self.device),
            "processes": self.ranks.world_size,
            # What techniques measured or chose on this machine (memo's alpha and its inputs).
            "strategy_notes": dict(applied_context(self.model).notes),
        }
        with writing("the run summary", self.out / "summary.json"):
            ckpt.write_text_atomic(self.out / "summary.json", strict_json(summary, indent=2))
        return summary


def _evaluation_row(task: dict | None, before: dict | None = None) -> tuple[str, str]:
    if task is not None and "digit_accuracy" in task:
        text = (f"{task['digit_accuracy']:.1%} of answer digits, {task['key_accuracy']:.1%} of whole keys "
                f"({task['samples']} held-out samples)")
        if before is not None:
            text += f"; before training {before['digit_accuracy']:.1%} and {before['key_accuracy']:.1%}"
        return ("pass-key accuracy", text + "; chance 10% of digits")
    if task is not None and "loss" in task:
        return ("held-out loss", f"{task['loss']:.4f} on {task['samples']} windows of --data set aside from training")
    return ("held-out loss", "none: the data holds fewer than 10 windows of --seq-len, too few to set one aside")


def _attention_kernel(config, device: torch.device, dtype: torch.dtype) -> str | None:
    heads = getattr(config, "num_attention_heads", None)
    if not heads:  # no attention (SSM-ResNet)
        return None
    from ..ops.attention_blocks import attention_kernel

    return attention_kernel(device, dtype, getattr(config, "head_dim", None) or config.hidden_size // heads)


def _throughput_row(summary: dict) -> tuple[str, str]:
    if summary["tokens_per_s"] is None:
        return ("throughput", f"n/a (no step trained by this command) on {summary['device']}")
    kernel = f" (attention kernel {summary['attention_kernel']})" if summary.get("attention_kernel") and \
        summary["device"].startswith("cuda") else ""
    return ("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s on {summary['device']}{kernel}")


def _peak_text(summary: dict) -> str:
    text = f"{format_bytes(summary['measured_peak_bytes'])} ({summary['measured_with']})"
    if summary.get("measured_reserved_bytes"):  # CUDA: the reservation is what runs out
        text += (f", {format_bytes(summary['measured_reserved_bytes'])} reserved "
                 f"({summary['measured_reserved_bytes'] / max(1, summary['measured_peak_bytes']):.2f}×, allocator {summary['allocator']})")
    return text


def _steps_phrase(summary: dict) -> str:
    trained = summary.get("steps_trained", summary["steps"])
    return f"{trained} steps" + ("" if trained == summary["steps"] else f" (resumed: {summary['steps']} in all)")


def format_summary(summary: dict) -> str:
    rows = [
        ("loss", f"{summary['final_loss']:.4f} (mean of the last steps; first steps: {summary['first_loss']:.4f})"
                 if summary["final_loss"] is not None else "n/a (no step logged in this run directory)"),
        _evaluation_row(summary["task"], summary.get("task_before")),
        _throughput_row(summary),
        ("measured peak memory", _peak_text(summary) if summary.get("steps_trained", 1) else "n/a (no step trained by this command)"),
        ("simulated stock peak", f"{format_bytes(summary['simulated_stock_peak_bytes'])} (same model, no techniques, {summary['simulated_stock_setup']}, seq_len {summary['seq_len']:,})"),
        ("wall time", f"{summary['seconds']:.0f} s for {_steps_phrase(summary)}, strategy {summary['strategy']}"),
    ]
    if summary.get("processes", 1) > 1:
        rows[3] = (rows[3][0], rows[3][1] + f", the largest of {summary['processes']} processes")
    if summary.get("host_pool_bytes"):
        parked = format_bytes(summary["host_pool_bytes"])
        if summary["device"].startswith("cpu"):  # one memory: the parked chunks add to the measured peak
            rows.insert(4, ("parked chunks", f"{parked} (on a CPU run offload parks them in the same memory as the "
                                             "device: the run's peak is up to the measured peak plus this)"))
        else:
            rows.insert(4, ("host memory", f"{parked} in the pinned pool of parked chunks"))
    notes = summary.get("strategy_notes") or {}
    if "memo_alpha" in notes:
        how = ("measured: one layer {:.3g} s, host link {:.3g} GB/s".format(notes["memo_layer_seconds"], notes["memo_host_bandwidth"] / 1e9)
               if notes.get("memo_measured") else "given" if "memo_layer_seconds" not in notes else "modelled")
        rows.append(("memo alpha", f"{notes['memo_alpha']:.3f} of the other activations' tokens swapped ({how})"))
    if "kept_attention_outputs" in notes:
        rows.append(("kept attention", f"the lowest {notes['kept_attention_outputs']} layers keep their attention "
                                       "output (no second attention forward in their backward)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
