"""The training loop behind ``longtrain train``.

One obvious path: build or load the model, wrap it (LoRA) and apply the strategy, then
for each optimizer step run ``grad_accum`` micro-batches through the strategy's engine
with the loss normalized by the label tokens of the whole step, clip, step, measure,
log, and checkpoint atomically. Everything a resumed run needs — weights, optimizer,
scheduler, RNG states and the data position — is in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..engines.batch import count_label_tokens
from ..errors import LongtrainError
from ..memory.flops import device_peak_flops, mfu, model_flops_per_sample
from ..memory.measure import StepMemoryMeter
from ..memory.units import format_bytes, physical_memory
from ..models.loading import add_lora, build_from_config, is_model_dir, load_config, load_pretrained, parse_dtype
from ..optimizers import OPTIMIZERS, make_optimizer
from ..strategy import Strategy, applied_context, apply, pinned_host_bytes, step as strategy_step
from . import checkpoint as ckpt
from .data import TokenWindows, collate
from .metrics import MetricsLog, truncate_after
from .passkey import PasskeyTask
from .ranks import Ranks, check_distributed_engine
from .tokenizer import ByteTokenizer, load_tokenizer

MAX_SEQ_LEN = 1 << 24  # one sample of 16M tokens; beyond this int32 indexing in kernels overflows


@dataclass
class TrainConfig:
    """Everything that defines a run. The defaults are the embedded demo: a small
    Llama trained at 8K tokens on the built-in pass-key task, minutes on two CPU cores."""

    model: str = "demo"  # preset name or local Hugging Face model directory
    data: str | None = None  # text/JSONL file or directory; None = built-in pass-key task
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
    dtype: str | None = None  # default: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    seed: int = 0
    out: str = "runs/default"
    save_every: int = 100
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: evaluate only at the end
    eval_samples: int = 16
    task_loss: str = "all"  # pass-key task: loss on all text ("all") or on the needles and answer only ("task")
    packing: str = "concat"  # --data: "concat" (documents joined by EOS, attending across) or "documents" (attention and positions restart per document)
    sp: int = 1  # Ulysses sequence parallelism: ranks that share each sequence (under torchrun; the rest is data parallel)
    master_weights: str | None = None  # under --sp: keep parameters (and optimizer state) in this dtype, compute in --dtype
    resume: bool = False
    resume_from: str | None = None
    overwrite: bool = False
    extend_context: bool = False
    tensorboard: bool = False
    progress: bool = True

    # Settings a resumed run must share with the checkpoint it resumes.
    IDENTITY = ("model", "data", "seq_len", "batch_size", "grad_accum", "seed", "lora", "lora_rank", "optimizer", "task_loss",
                "packing", "sp")


class WarmupCosine:
    """Linear warm-up then cosine decay to 10% (a picklable LambdaLR factor)."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _check(config: TrainConfig) -> None:
    positive = ("seq_len", "batch_size", "grad_accum", "steps", "eval_samples", "lora_rank", "sp")
    for name in positive:
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise LongtrainError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if config.seq_len < 2:
        raise LongtrainError("--seq-len must be at least 2 (one input and one target token)")
    if config.seq_len > MAX_SEQ_LEN:
        raise LongtrainError(f"--seq-len {config.seq_len:,} exceeds the per-sample limit of {MAX_SEQ_LEN:,} tokens; use sequence parallelism or a shorter length")
    if config.lr <= 0:
        raise LongtrainError(f"--lr must be positive, got {config.lr}")
    if config.optimizer not in OPTIMIZERS or config.optimizer == "none":
        raise LongtrainError(f"--optimizer must be adamw or sgd for training, got {config.optimizer!r}")
    if config.task_loss not in ("task", "all"):
        raise LongtrainError(f"--task-loss must be 'task' or 'all', got {config.task_loss!r}")
    if config.packing not in ("concat", "documents"):
        raise LongtrainError(f"--packing must be 'concat' or 'documents', got {config.packing!r}")
    if config.master_weights is not None and config.sp <= 1:
        raise LongtrainError("--master-weights keeps sharded parameters in another dtype than the layers compute in: it needs --sp")
    if config.resume and config.overwrite:
        raise LongtrainError("--resume and --overwrite contradict each other; pick one")


def _device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():  # under torchrun, each process takes its own GPU
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LongtrainError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return device


def build_model(config: TrainConfig, dtype: torch.dtype):
    """The model and tokenizer a config names, with LoRA when asked (strategy not applied)."""
    model_config = load_config(config.model)
    max_pos = getattr(model_config, "max_position_embeddings", None)
    pretrained = is_model_dir(config.model)
    if max_pos is not None and config.seq_len > max_pos:
        if pretrained and not config.extend_context:
            raise LongtrainError(
                f"--seq-len {config.seq_len:,} exceeds the model's max_position_embeddings ({max_pos:,}); "
                "pass --extend-context to train beyond it (and set rope_scaling in its config.json for a pretrained model)"
            )
        model_config.max_position_embeddings = config.seq_len
    tokenizer = load_tokenizer(config.model if pretrained else None)
    if model_config.vocab_size < tokenizer.vocab_size:
        raise LongtrainError(
            f"the model's vocabulary ({model_config.vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size}); "
            "use a model directory with its own tokenizer or a preset"
        )
    torch.manual_seed(config.seed)
    if pretrained:
        model = load_pretrained(config.model, dtype)
        model.config.max_position_embeddings = model_config.max_position_embeddings
    else:
        model = build_from_config(model_config, dtype)
    model.config.use_cache = False
    if config.lora:
        model = add_lora(model, config.lora_rank)
    return model, tokenizer


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
    from ..plan.planner import plan

    if config.engine != "backprop" or config.sp > 1 or config.lora:
        raise LongtrainError("--strategy auto picks the engine itself and plans one process of full fine-tuning; "
                             "drop --engine/--sp/--lora, or name a strategy")
    host = int(0.8 * physical_memory())
    device_memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host
    print(f"longtrain train: planning --strategy auto for {config.seq_len:,} tokens ...", flush=True)
    result = plan(config.model, config.seq_len, device_memory=device_memory, host_memory=host,
                  optimizer=config.optimizer, dtype=str(compute_dtype).replace("torch.", ""), batch=config.batch_size)
    if result.best is None:
        raise LongtrainError(f"--strategy auto: {result.verdict()}")
    print(f"longtrain train: --strategy auto chose {result.verdict()}", flush=True)
    return Strategy.from_dict(result.best.strategy)


def _strategy(config: TrainConfig, compute_dtype: torch.dtype, device: torch.device | None = None) -> Strategy:
    if config.strategy == "auto":
        return _planned_strategy(config, device or torch.device("cpu"), compute_dtype)
    sp = None
    if config.sp > 1:
        sp = {"degree": config.sp, "compute_dtype": str(compute_dtype).replace("torch.", "") if config.master_weights else None}
    return Strategy.parse(config.strategy, engine=None if config.engine == "backprop" else config.engine,
                          sequence_parallel=sp)


class Trainer:
    def __init__(self, config: TrainConfig):
        _check(config)
        self.config = config
        self.device = _device(config.device)
        compute = parse_dtype(config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        # The parameters' dtype: the compute dtype, or with --master-weights (FSDP2 mixed precision) their own.
        self.dtype = parse_dtype(config.master_weights) if config.master_weights else compute
        self.strategy = _strategy(config, compute, self.device)
        self.out = Path(config.out)
        self.checkpoints = self.out / "checkpoints"
        self.ranks = Ranks.from_env(self.device, config.sp)
        check_distributed_engine(self.ranks, self.strategy.engine)

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
            self.data = TokenWindows(config.data, self.tokenizer, config.seq_len, seed=config.seed,
                                     restart_per_document=config.packing == "documents")

        # Only now, with the model and data known to be good, touch the output directory.
        self._prepare_output_dir()
        self.ranks.barrier()
        self.optimizer = make_optimizer(config.optimizer, self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupCosine(config.warmup_steps, config.steps))
        self.step_index = 0
        self.samples_seen = 0
        self.history: list[dict] = []

    # ---- output directory and checkpoints ---------------------------------------------
    def _prepare_output_dir(self) -> None:
        c = self.config
        has_run = (self.checkpoints / ckpt.LATEST).exists() or (self.out / "metrics.jsonl").exists()
        if has_run and not (c.resume or c.resume_from or c.overwrite):
            raise LongtrainError(f"{self.out} already holds a run; pass --resume to continue it, --overwrite to replace it, or --out NEW_DIR")
        if not self.ranks.main:
            return
        if c.overwrite and self.out.exists():
            for child in ("checkpoints", "metrics.jsonl", "summary.json", "final", "tensorboard"):
                path = self.out / child
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)

    def _identity(self) -> dict:
        return {k: getattr(self.config, k) for k in TrainConfig.IDENTITY}

    def _files(self) -> tuple[str, str]:
        """This rank's checkpoint files (one pair per rank under layer groups)."""
        if not self.ranks.distributed:
            return "weights.safetensors", "trainer_state.pt"
        return f"weights-rank{self.ranks.rank}.safetensors", f"trainer_state-rank{self.ranks.rank}.pt"

    def save(self) -> Path:
        trainable = _trainable(self.model)
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
        for key, value in self._identity().items():
            if identity.get(key) != value:
                raise LongtrainError(
                    f"checkpoint {path} was written with {key}={identity.get(key)!r} but this run has {key}={value!r}; "
                    "resume with the same settings or start a new --out"
                )
        if meta.get("parameters") != _fingerprint(self.model):
            raise LongtrainError(f"checkpoint {path} holds parameters of a different model; resume with the model it was written for")
        if meta.get("processes", 1) != self.ranks.world_size:
            raise LongtrainError(
                f"checkpoint {path} was written by {meta.get('processes', 1)} processes but this run has {self.ranks.world_size}; "
                "resume with the same --nproc-per-node"
            )
        weights_file, state_file = self._files()
        try:
            weights = load_file(str(path / weights_file))
            state = torch.load(path / state_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any decoding failure means a corrupt file
            raise LongtrainError(f"checkpoint {path} cannot be read ({exc}); delete it or pass --resume-from an earlier one") from None
        with torch.no_grad():
            for name, param in _trainable(self.model).items():
                _local(param).copy_(weights[name])
        self.optimizer.load_state_dict(_as_parameters_shards(self.optimizer, state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])
        self.step_index = meta["step"]
        self.samples_seen = meta["samples_seen"]

    def _resume_point(self) -> Path | None:
        c = self.config
        if c.resume_from:
            path = Path(c.resume_from)
            if not path.is_dir():
                raise LongtrainError(f"--resume-from {path} is not a checkpoint directory")
            return path
        if c.resume:
            path = ckpt.latest_checkpoint(self.checkpoints)
            if path is None:
                raise LongtrainError(f"--resume: {self.checkpoints} holds no checkpoint yet; run without --resume to start")
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
        if self.task is None:
            return None
        model = self.full_model()
        return None if model is None else self.task.evaluate(model, self.config.eval_samples, self.device)

    def train(self) -> dict:
        c = self.config
        resume = self._resume_point()
        if resume is not None:
            self.load(resume)
            if self.ranks.main:
                truncate_after(self.out / "metrics.jsonl", self.step_index)
        log = MetricsLog(self.out / "metrics.jsonl", self.out / "tensorboard" if c.tensorboard else None) if self.ranks.main else None
        flops_per_sample = model_flops_per_sample(self.model, c.seq_len) if hasattr(self.model, "get_input_embeddings") else None
        peak_flops = device_peak_flops(self.device)
        tokens_per_step = c.seq_len * c.batch_size * c.grad_accum * self.ranks.data_parallel  # every group's
        trainable = list(_trainable(self.model).values())
        peak_bytes, step_times = 0, []
        bar = tqdm(total=c.steps, initial=self.step_index, disable=not (c.progress and self.ranks.main), desc="train", unit="step", dynamic_ncols=True)
        start = time.perf_counter()
        try:
            with StepMemoryMeter(self.device, self.model, self.optimizer) as meter:
                while self.step_index < c.steps:
                    meter.start_step()
                    t0 = time.perf_counter()
                    batches = self._micro_batches()
                    n_label = self.ranks.sum_over_data_parallel(sum(count_label_tokens(b["labels"]) for b in batches), self.device)
                    loss = sum(float(strategy_step(self.model, b, self.strategy, num_label_tokens=n_label)) for b in batches)
                    grad_norm = self.ranks.clip_grad_norm(trainable, c.max_grad_norm)
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
        model = self.full_model()
        peak_bytes = int(self.ranks.max(peak_bytes))  # under layer groups: the largest rank's
        if model is None:  # a rank other than 0 of several: rank 0 evaluates and reports
            self.ranks.close()
            return {}
        evaluation = None if self.task is None else self.task.evaluate(model, c.eval_samples, self.device)
        if evaluation is not None:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": self.step_index, "eval": evaluation}) + "\n")
        self._save_final(model)
        summary = self._summary(evaluation, peak_bytes, step_times, time.perf_counter() - start)
        self.ranks.close()
        return summary

    def _save_final(self, model) -> None:
        final = self.out / "final"
        # For LoRA, peft would otherwise look the base model up on the Hub to decide
        # whether to save embeddings; nothing here trains them.
        extra = {"save_embedding_layers": False} if self.config.lora else {}
        model.save_pretrained(final, **extra)
        self.tokenizer.save_pretrained(final)

    def _summary(self, evaluation, peak_bytes, step_times, seconds) -> dict:
        from ..plan.simulate import simulate

        c = self.config
        losses = [r["loss"] for r in self.history]
        window = max(1, min(10, len(losses) // 4))
        steady = step_times[1:] or step_times
        base_config = self.model.get_base_model().config if c.lora else self.model.config
        # LoRA is not simulated yet: the stock figure is full fine-tuning, an upper bound.
        stock = simulate(base_config, c.seq_len, batch_size=c.batch_size, strategy="none", optimizer=c.optimizer, dtype=self.dtype)
        summary = {
            "model": c.model, "seq_len": c.seq_len, "strategy": self.strategy.name, "steps": self.step_index,
            "first_loss": sum(losses[:window]) / window if losses else None,
            "final_loss": sum(losses[-window:]) / window if losses else None,
            "task": evaluation,
            "tokens_per_s": c.seq_len * c.batch_size * c.grad_accum * len(steady) / sum(steady) if steady else None,
            "measured_peak_bytes": peak_bytes,
            "measured_with": "cuda-allocator" if self.device.type == "cuda" else "tracked-storages",
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
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def format_summary(summary: dict) -> str:
    task = summary["task"]
    if task is None:
        task_line = "n/a (custom data)"
    else:
        task_line = f"{task['digit_accuracy']:.1%} of answer digits, {task['key_accuracy']:.1%} of whole keys ({task['samples']} held-out samples)"
    rows = [
        ("loss", f"{summary['final_loss']:.4f} (mean of the last steps; first steps: {summary['first_loss']:.4f})"),
        ("pass-key accuracy", task_line),
        ("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s on {summary['device']}"),
        ("measured peak memory", f"{format_bytes(summary['measured_peak_bytes'])} ({summary['measured_with']})"),
        ("simulated stock peak", f"{format_bytes(summary['simulated_stock_peak_bytes'])} (same model, no techniques, {summary['simulated_stock_setup']}, seq_len {summary['seq_len']:,})"),
        ("wall time", f"{summary['seconds']:.0f} s for {summary['steps']} steps, strategy {summary['strategy']}"),
    ]
    if summary.get("processes", 1) > 1:
        rows[3] = (rows[3][0], rows[3][1] + f", the largest of {summary['processes']} processes")
    if summary.get("host_pool_bytes"):
        rows.insert(4, ("host memory", f"{format_bytes(summary['host_pool_bytes'])} in the pinned pool of parked chunks"))
    notes = summary.get("strategy_notes") or {}
    if "memo_alpha" in notes:
        how = ("measured: one layer {:.3g} s, host link {:.3g} GB/s".format(notes["memo_layer_seconds"], notes["memo_host_bandwidth"] / 1e9)
               if notes.get("memo_measured") else "given" if "memo_layer_seconds" not in notes else "modelled")
        rows.append(("memo alpha", f"{notes['memo_alpha']:.3f} of the other activations' tokens swapped ({how})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def config_from_dict(values: dict) -> TrainConfig:
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in values.items() if k in known})
