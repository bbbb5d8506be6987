"""The training loop behind ``longtrain train``.

One obvious path: build or load the model, wrap it (LoRA) and apply the strategy, then
for each optimizer step run ``grad_accum`` micro-batches through the strategy's engine
with the loss normalized by the label tokens of the whole step, clip, step, measure,
log, and checkpoint atomically. Everything a resumed run needs — weights, optimizer,
scheduler, RNG states and the data position — is in the checkpoint.

The loop's other jobs live beside it: the device, model and strategy in
:mod:`~longtrain.train.setup`, the run directory in :mod:`~longtrain.train.run_dir`,
checkpoints and resuming in :mod:`~longtrain.train.resume`, the learning-rate schedule
in :mod:`~longtrain.train.schedule`, stopping a diverged run in
:mod:`~longtrain.train.divergence`, final/ and metrics.png in :mod:`~longtrain.train.final`
and the summary in :mod:`~longtrain.train.summary`. Their public names are importable
from here too.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .. import registry
from ..engines.backprop import forward_loss
from ..engines.batch import count_label_tokens
from ..errors import LongtrainError
from ..memory.measure import StepMemoryMeter
from ..memory.units import format_bytes
from ..models.flops import device_peak_flops, mfu, model_flops_per_sample
from ..models.loading import parse_dtype
from ..optimizer_offload import HostAdamW, streaming
from ..optimizers import make_optimizer
from ..strategy import Strategy, applied_context, apply, engine_context
from ..strategy import step as strategy_step
from . import resume
from .config import MAX_SEQ_LEN, TrainConfig, check_config, config_from_dict, option
from .data import TokenWindows, collate
from .divergence import any_rank, diverged, not_finite
from .final import log_final_evaluation, plot_run, save_final
from .lock import RunLock, check_not_in_use
from .metrics import MetricsLog, check_tensorboard, read_metrics
from .passkey import PasskeyTask
from .ranks import Ranks, check_distributed_engine
from .records import fingerprint
from .run_dir import check_output_dir, checkpoints_dir, prepare_output_dir
from .schedule import WarmupCosine, make_scheduler
from .setup import build_model, choose_strategy, resolve_device, trained_weights
from .summary import format_summary, write_summary
from .tokenizer import ByteTokenizer

__all__ = [
    "MAX_SEQ_LEN", "TrainConfig", "Trainer", "WarmupCosine", "build_model", "check_config", "config_from_dict",
    "format_summary", "held_out_loss", "option", "resolve_device", "trained_weights",
]


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


class Trainer:
    """One run of ``longtrain train``: the constructor sets it up (what it refuses, it
    refuses before writing anything), :meth:`train` trains it to --steps."""

    def __init__(self, config: TrainConfig):
        check_config(config)  # types, ranges and combinations of every field (train/config.py)
        self.config = config
        self.device = resolve_device(config.device)
        if config.four_bit and self.device.type != "cuda":
            raise LongtrainError("--4bit trains on a GPU: bitsandbytes' CPU backend repacks a 4-bit layer for inference "
                                 "when an evaluation calls it, after which the layer passes no gradient back; train on "
                                 "--device cuda, or without --4bit")
        compute = self.compute_dtype = parse_dtype(config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        # The parameters' dtype: the compute dtype, or with --master-weights (FSDP2 mixed precision) their own.
        self.dtype = parse_dtype(config.master_weights) if config.master_weights else compute
        if config.optimizer == "adamw-16bit" and self.dtype.itemsize > 2:
            raise LongtrainError(f"--optimizer adamw-16bit steps AdamW on 16-bit weights, and these are "
                                 f"{str(self.dtype).replace('torch.', '')} (it would be plain AdamW): use --optimizer "
                                 f"adamw, or --dtype bfloat16")
        self.strategy = choose_strategy(config, compute, self.device)
        self.out = Path(config.out)
        self.checkpoints = checkpoints_dir(self.out)
        self._lock = RunLock(self.out)  # held from the first write to --out until the run ends
        if os.environ.get("RANK", "0") == "0":  # the process that will hold the lock (torchrun's others never take it)
            check_not_in_use(self.out)
        check_output_dir(self.out, config)  # before the model is built: a refusal costs nothing
        if config.tensorboard:
            check_tensorboard()
        self.ranks = Ranks.from_env(self.device, config.sp)
        check_distributed_engine(self.ranks, self.strategy.engine)
        if config.four_bit and self.ranks.distributed:
            raise LongtrainError(f"--4bit trains on one GPU; {self.ranks.world_size} processes were launched: run one "
                                 "(several GPUs: the Trainer's data parallel with a 4-bit base)")
        if config.optimizer_offload and self.ranks.distributed:  # its clipping norm is this process's alone
            raise LongtrainError(f"--optimizer-offload keeps AdamW's state in one process's host memory; {self.ranks.world_size} "
                                 "processes were launched: run one process, or drop --optimizer-offload (layer groups "
                                 "already split the optimizer state over the processes)")

        self.model, self.tokenizer = build_model(config, self.dtype, self.device)
        self.model.to(self.device).train()
        apply(self.model, self.strategy)  # under --sp this shards the parameters over the ranks (FSDP2)
        layer_groups = registry.engine(self.strategy.engine).layer_groups
        if self.ranks.distributed and layer_groups is not None:  # the engine splits the layers over the processes
            layer_groups(applied_context(self.model), self.ranks.rank, self.ranks.world_size)

        if config.data is None:
            if not isinstance(self.tokenizer, ByteTokenizer):
                raise LongtrainError("the built-in pass-key task needs the byte tokenizer (a preset model); pass --data for this model")
            self.task = PasskeyTask(self.tokenizer, config.seq_len, seed=config.seed, loss_on=config.task_loss)
            self.data = self.task
        else:
            self.task = None
            self.data = TokenWindows(config.data, self.tokenizer, config.seq_len, seed=config.seed, packing=config.packing,
                                     held_out=config.eval_samples, loss_on=config.loss_on or "assistant")
        note = self._check_loss_on()
        if config.packing == "auto":  # the packing the data settled on is what a resumed run must share
            self.config = config = dataclasses.replace(config, packing=self.data.packing if self.task is None else "concat")
        self.data_fingerprint = fingerprint(config.data) if config.data is not None else None

        # The checkpoint to continue from, checked (checksums, settings, model, data) before --out is touched.
        self._resume_from = resume.resume_point(self.out, config, self.ranks, say=False)
        self._resume_meta = None
        if self._resume_from is not None:
            self._resume_meta = resume.check_checkpoint(self._resume_from, config, self.ranks, model=self.model,
                                                        data=self.data_fingerprint)
        if note and self.ranks.main:
            print(f"longtrain train: {note}", flush=True)
        split = getattr(self.data, "records_split", 0)
        if split and self.ranks.main:
            print(f"longtrain train: {split} chat or prompt/completion record{'s' if split != 1 else ''} of {config.data} "
                  f"{'are' if split != 1 else 'is'} longer than --seq-len {config.seq_len:,}: split into windows whose "
                  "positions restart, a later piece without its record's start; a longer --seq-len keeps them whole",
                  flush=True)

        # Only now, with the model, data and checkpoint known to be good, touch the output directory.
        try:
            if self.ranks.main:
                prepare_output_dir(self.out, config, self._lock)
            self.ranks.barrier()
            optimizer = "adamw-offload" if config.optimizer_offload else config.optimizer
            self.optimizer = make_optimizer(optimizer, self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                            model=self.model)
        except BaseException:
            self._lock.release()
            raise
        self.scheduler = make_scheduler(self.optimizer, config)
        self.step_index = 0
        self.samples_seen = 0
        self.history: list[dict] = []

    def _check_loss_on(self) -> str | None:
        """Refuse --loss-on assistant where no record has assistant tokens (text trains on
        every token); a note, where text and chat or prompt/completion records are mixed,
        saying where each has its loss."""
        c = self.config
        if self.task is not None:
            return None
        structured, text = self.data.structured, self.data.documents - self.data.structured
        if c.loss_on == "assistant" and not structured:
            raise LongtrainError(f"--loss-on assistant puts the loss on chat records' assistant messages (or completions), "
                                 f"but {c.data} holds only text, which has its loss on every token; drop --loss-on, or "
                                 "give chat ('messages') or prompt/completion records")
        if (c.loss_on or "assistant") == "assistant" and structured and text:
            return (f"{c.data} mixes {text} text document{'s' if text != 1 else ''} (the loss on every token) with "
                    f"{structured} chat or prompt/completion record{'s' if structured != 1 else ''} (the loss on the "
                    "assistant's or completion's tokens); --loss-on all puts it on every token of both")
        return None

    # ---- checkpoints and divergence ------------------------------------------------------
    def save(self) -> Path:
        """Checkpoint this step (train/resume.py); weights left non-finite stop the run instead."""
        if any_rank(self.ranks, not resume.finite_weights(self.model)):
            raise self._diverged("the optimizer step left non-finite weights")
        return resume.save(self.checkpoints, self.config, self.ranks, model=self.model, optimizer=self.optimizer,
                           scheduler=self.scheduler, strategy=self.strategy, dtype=self.dtype, step=self.step_index,
                           samples_seen=self.samples_seen, data=self.data_fingerprint)

    def load(self, path: Path) -> None:
        """Continue from the checkpoint at ``path`` (train/resume.py), refusing one of another
        run (checked already where it is the one the constructor checked)."""
        meta = self._resume_meta if path == self._resume_from else None
        self.scheduler, self.step_index, self.samples_seen = resume.load(
            path, self.config, self.ranks, model=self.model, optimizer=self.optimizer, dtype=self.dtype,
            data=self.data_fingerprint, meta=meta)

    def _diverged(self, what: str, step: int | None = None) -> LongtrainError:
        return diverged(what, self.step_index if step is None else step, self.config, self.checkpoints, self.compute_dtype,
                        records=self._step_records())

    def _step_records(self) -> dict[int, dict]:
        """The run's step metrics by step: metrics.jsonl's (earlier runs of this --out too), this run's over them."""
        records = {}
        try:  # past this step: an earlier run's, not yet dropped from the log
            records = {r["step"]: r for r in read_metrics(self.out / "metrics.jsonl") if "loss" in r and r["step"] <= self.step_index}
        except (OSError, ValueError):  # no log here (another rank's disk), or none yet
            pass
        records.update({r["step"]: r for r in self.history})
        return records

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
        resume_from = resume.resume_point(self.out, c, self.ranks)  # again, now that --out is locked
        if resume_from is not None:
            self.load(resume_from)
        if self.step_index >= c.steps:  # resumed at its last step (load refuses a later one)
            return self._at_the_end(resume_from)
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
        trainable = list(resume.trainable_parameters(self.model).values())
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
                    what = not_finite(loss, grad_norm, self.ranks)  # before the optimizer step: a diverged step changes nothing
                    if what is not None:
                        raise self._diverged(what, step=self.step_index + 1)
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

    def _at_the_end(self, resume_from: Path | None) -> dict:
        """A run resumed at its last step: nothing to train. If it was stopped after its
        last checkpoint but before its final model and summary, those are written now;
        otherwise nothing is touched."""
        c = self.config
        finished = (self.out / "final").is_dir() and (self.out / "summary.json").is_file()
        if self.ranks.main:
            run = resume_from if c.resume_from else self.out
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
        if evaluation is not None:
            log_final_evaluation(self.out, self.step_index, evaluation)
        base_config = self.model.get_base_model().config if c.lora else self.model.config  # before LoRA is merged
        save_final(model, self.tokenizer, self.out, c)
        plot_run(self.out)
        summary = write_summary(self.out, c, strategy=self.strategy, model=self.model, device=self.device,
                                compute_dtype=self.compute_dtype, dtype=self.dtype, processes=self.ranks.world_size,
                                steps=self.step_index, has_task=self.task is not None, evaluation=evaluation,
                                peak_bytes=peak_bytes, reserved_bytes=reserved_bytes, step_times=step_times,
                                seconds=time.perf_counter() - start, base_config=base_config)
        self.ranks.close()
        return summary
