"""The bridge to Hugging Face's ``Trainer`` and TRL: a Trainer whose training step is :func:`longtrain.step`.

    from longtrain.hf import LongtrainTrainer, wrap
    trainer = LongtrainTrainer(model=model, args=args, train_dataset=data, strategy="checkpoint,mst")
    trainer = wrap(trl.SFTTrainer)(model=model, args=SFTConfig(...), train_dataset=data,
                                   strategy="fpdt:chunk=8192:offload=true,mst")

Everything but the micro-batch's forward and backward stays the Trainer's own: data
loading and collation, gradient accumulation, clipping, the optimizer and scheduler,
logging, evaluation (Hugging Face's forward, through longtrain's attention), checkpoints
and resumption. Several processes (``torchrun``, ``accelerate launch``) train data
parallel: the step runs backward past DDP's wrapper, so on each accumulation step's last
micro-batch the gradients are summed over the processes here (what DDP's reduction gives,
with stock's loss scaling). The step divides the summed token loss by exactly what the stock step
divides it by — the Trainer's ``num_items_in_batch`` (the label tokens of the whole
accumulation step) when it counts one, else this micro-batch's label tokens times the
accumulation steps (a mean per micro-batch, divided as stock divides it) — so the
gradients, the returned and logged loss and every later step equal stock's.

The strategy is applied once, when the trainer is built: the Trainer has placed the model
on its device by then. The training arguments are checked before the Trainer is built
(before TRL prepares its datasets), the built Trainer right after; what cannot run exactly
is refused in one line. A model that ``model_init`` builds again inside ``train()`` gets
the same strategy at its first step. Hugging Face's activation checkpointing
(``gradient_checkpointing=True``, TRL's default) is taken over by the strategy: it adds
longtrain's ``checkpoint`` where the strategy composes with it, and is switched off
otherwise (the chunked engines and Memo recompute on their own schedule).

Only ``transformers`` (and, for the Trainer, ``accelerate``) are imported here; TRL is
needed only by the caller that passes ``trl.SFTTrainer`` to :func:`wrap`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch
from transformers import Trainer

from . import registry
from .engines.batch import count_label_tokens
from .errors import LongtrainError
from .hf_sequence_parallel import SequenceParallelCheckpoints, degree_of, group_loss_normaliser, install
from .models.adapters import describe_model
from .models.layers import unwrap
from .ops.token_stats import TokenStats, counting
from .parallel.distributed import sum_gradients
from .parallel.fsdp import padded_to_longest
from .strategy import BATCH_KEYS, Strategy, applied_context, applied_strategy, apply, router_aux_loss, step

__all__ = ["LongtrainTrainer", "wrap"]

logger = logging.getLogger(__name__)

# What lt.step reads from a batch, and the keys a padding-free collator (TRL's) derives
# from position_ids for varlen kernels: they say nothing lt.step does not already read.
_DERIVED_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "use_cache"})

_SP_HINT = ("to split sequences over P processes, set parallelism_config=ParallelismConfig(sp_size=P) (longtrain's "
            "Ulysses, FSDP2 sharding the rest)")
_FP16 = ("fp16 scales the loss with a GradScaler inside backward, which longtrain's step runs itself; load the model in "
         "bfloat16 and set bf16=True, or train in float32")


class _LongtrainTraining(SequenceParallelCheckpoints):
    """The part of :class:`LongtrainTrainer` that any ``transformers.Trainer`` subclass takes
    on through :func:`wrap`: the strategy, the refusals, and the training step."""

    def __init__(self, *args, strategy: "Strategy | str | None" = None, long_context_eval: Mapping | None = None,
                 **kwargs):
        planned = _parse_strategy(strategy)  # a typo fails before the datasets are prepared
        self.long_context_eval = _check_long_context_eval(long_context_eval)
        given_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given_args is not None:
            _check_arguments(given_args)
        super().__init__(*args, **kwargs)
        _check_arguments(self.args)  # the defaults the Trainer filled in (TRL's SFTConfig())
        _check_trainer(self)
        _check_long_context_lengths(self.long_context_eval, self.model)
        degree = degree_of(getattr(self.accelerator, "parallelism_config", None))
        if degree and planned == "auto":
            raise LongtrainError("strategy='auto' plans one process; under parallelism_config sp_size pick a strategy "
                                 "with `longtrain plan --gpus N --sp P` and pass it as strategy=")
        strategy = _auto_strategy(self) if planned == "auto" else planned
        strategy = _take_over_checkpointing(self, strategy, planned == "auto")
        self.strategy = strategy if not degree else Strategy(strategy.engine, strategy.engine_options, degree,
                                                             **strategy.techniques)
        apply(self.model, self.strategy)
        if degree:
            if _adds_balancing_loss(self.model):
                raise LongtrainError("a mixture of experts' load-balancing loss is not weighed under sequence "
                                     "parallelism inside the Trainer yet; set the config's output_router_logits=False, "
                                     "or train it with `longtrain train --sp P`")
            install(self, degree)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch: forward and backward by :func:`longtrain.step` with the applied
        strategy (gradients accumulate on the parameters; nothing is left for
        ``accelerator.backward``). Returns the detached loss the stock step returns."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()  # schedule-free optimizers, as the stock step does
        target = self.accelerator.unwrap_model(model)
        if applied_strategy(target) is None:  # a model model_init built inside train()
            apply(target, self.strategy)
        inputs = self._prepare_inputs(inputs)
        batch = _longtrain_batch(inputs)
        processes, scale = self._processes_and_loss_scale(num_items_in_batch)
        degree = self.strategy.sequence_parallel.degree if self.strategy.sequence_parallel else None
        if degree:  # every process of a group steps on its micro-batch; FSDP2 sums the gradients over all
            count = group_loss_normaliser(self._loss_normaliser, batch["labels"], num_items_in_batch, scale > 1,
                                          degree, processes // degree)
            scale = 1  # (the step returns the loss summed over every process)
        else:
            count = self._loss_normaliser(batch["labels"], num_items_in_batch)
        fsdp2 = _fsdp2(self.accelerator)
        sharded = fsdp2 or degree is not None
        if fsdp2:
            _settle_sharding(target, summed=scale > 1)
            if registry.engine(self.strategy.engine).costs.chunk(self.strategy.engine_options) is not None:
                batch = padded_to_longest(batch)  # as many chunks, so as many unit calls, in every process
        stats, aux = (TokenStats() if _logs_token_metrics(self) else None), None
        # (FSDP2's units gather and reduce in every process's forward and backward: none skips its step)
        if count == 0 and not _adds_balancing_loss(target) and not sharded:
            # No label token in this micro-batch: its loss and gradients are 0, as TRL reports
            # them (stock Transformers divides 0 by 0 where the whole step has none).
            loss = torch.zeros((), device=self.args.device)
        else:
            # The autocast Accelerate wraps the model's forward in (bf16=True), around longtrain's step.
            # Without a label token a mixture of experts still trains its routers' balancing loss
            # (the language-model part is 0 whatever it is divided by).
            with self.compute_loss_context_manager(), self.accelerator.autocast(), counting(stats):
                loss = step(target, batch, num_label_tokens=max(count, 1),
                            aux_loss_weight=self._aux_loss_weight(num_items_in_batch, scale))
            aux = router_aux_loss(target)
        if stats is not None:  # TRL's metrics, counted by the step's LM head only where they are logged
            self._log_token_metrics(stats, inputs, aux)
        if processes > 1 and not sharded and self.accelerator.sync_gradients:  # every process, labels or none
            sum_gradients(target.parameters(), scale / processes)
        self._maybe_empty_cache()
        return loss * scale

    def _log_token_metrics(self, stats: TokenStats, inputs: Mapping, aux: torch.Tensor | None) -> None:
        """TRL's training metrics of this micro-batch, as SFTTrainer's ``compute_loss`` logs
        them: ``entropy`` and ``mean_token_accuracy`` over the label tokens of every process
        (from the step's LM head, :mod:`longtrain.ops.token_stats`), the running
        ``num_tokens`` (attention-mask tokens, or the padding-free row's length) and, where
        TRL logs it, the MoE balancing loss ``aux_loss`` averaged over the processes that ran
        a step. Every process gathers the same float64 scalars, labels or none."""
        device = self.args.device

        def gathered(value) -> torch.Tensor:
            value = (value.to(device=device, dtype=torch.float64) if isinstance(value, torch.Tensor)
                     else torch.tensor(float(value), dtype=torch.float64, device=device))
            return self.accelerator.gather_for_metrics(value.reshape(1))

        valid, entropy, correct = (gathered(v).sum() for v in (stats.tokens, stats.entropy, stats.correct))
        metrics = self._metrics["train"]
        metrics["entropy"].append((entropy / valid).item() if valid > 0 else 0.0)
        metrics["mean_token_accuracy"].append((correct / valid).item() if valid > 0 else 0.0)
        if "attention_mask" in inputs:
            tokens = gathered(inputs["attention_mask"].sum()).sum().item()
        else:
            tokens = gathered(inputs["position_ids"].size(1)).sum().item()
        parallel = self.strategy.sequence_parallel  # (a group's processes each hold its whole micro-batch)
        self._total_train_tokens += int(tokens) // getattr(self, "_tp_size", 1) // (parallel.degree if parallel else 1)
        metrics["num_tokens"] = [self._total_train_tokens]
        if getattr(self, "aux_loss_enabled", False):
            ran = gathered(aux is not None)
            values = gathered(0.0 if aux is None else float(aux))
            if ran.sum() > 0:
                metrics["aux_loss"].append(float((values * ran).sum() / ran.sum()))

    def _processes_and_loss_scale(self, num_items_in_batch) -> tuple[int, int]:
        """(data-parallel processes, what the stock step multiplies its loss by). Stock DDP
        averages the gradients over the processes, and where the label tokens are counted
        over all of them (``average_tokens_across_devices``) its loss is multiplied by their
        number first; longtrain's step, which backward past DDP, sums the gradients and
        multiplies them by ``scale / processes`` (1 or 1/N): the same update, the same logged loss.
        Under FSDP2 its reduce-scatter averages, as stock's; it sums where ``scale`` is N."""
        parallel = _data_parallel(self.accelerator) or _fsdp2(self.accelerator)
        processes = self.accelerator.num_processes if parallel else 1
        counted_over_all = (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs
                            and num_items_in_batch is not None)
        return processes, processes if counted_over_all and processes > 1 else 1

    def _aux_loss_weight(self, num_items_in_batch, scale: int = 1) -> float:
        """The weight of a mixture of experts' ``coef · aux`` in this micro-batch's loss, as the
        stock step weighs it: TRL's SFTTrainer averages it over the accumulation steps (and,
        added after its loss is multiplied by ``scale`` processes, over the processes); the
        Trainer adds the model's own loss (``LM + coef · aux``), divided by the accumulation
        steps only where that loss is not yet scaled for accumulation."""
        steps = self.current_gradient_accumulation_steps
        if hasattr(self, "aux_loss_enabled"):  # TRL
            return 1.0 / (steps * scale)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = bool(self.model_accepts_loss_kwargs) and num_items_in_batch is not None
        return 1.0 if scaled else 1.0 / steps

    def _loss_normaliser(self, labels: torch.Tensor, num_items_in_batch) -> int:
        """What this micro-batch's summed token loss is divided by, as stock divides it: the
        Trainer's ``num_items_in_batch`` where it counts one, else this micro-batch's own
        label tokens (a mean); times the accumulation steps where the stock step counts the
        loss as not yet scaled for accumulation. 0 when the micro-batch has no label token."""
        own = count_label_tokens(labels)
        if own == 0:
            return 0
        count = own if num_items_in_batch is None else _as_count(num_items_in_batch)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:  # Trainer.training_step's rule (compute_loss_func is refused)
            scaled = bool(self.model_accepts_loss_kwargs) and num_items_in_batch is not None
        return count if scaled else count * self.current_gradient_accumulation_steps

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """The Trainer's evaluation, and with ``long_context_eval`` the pass-key and
        needle-in-a-haystack accuracies (:func:`longtrain.train.evaluate.evaluate_long_context`)
        logged beside it as ``{prefix}_passkey_{length}`` and ``{prefix}_needle_{length}_d{depth}``.
        Without an evaluation dataset only the long-context part runs."""
        metrics = {}
        if eval_dataset is not None or self.eval_dataset is not None:
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        if self.long_context_eval is not None:
            from .train.evaluate import evaluate_long_context, flat_metrics

            settings = {k: v for k, v in self.long_context_eval.items() if k != "extend_context"}
            cells = evaluate_long_context(self.accelerator.unwrap_model(self.model), self.processing_class, **settings)
            found = flat_metrics(cells, prefix=f"{metric_key_prefix}_")
            self.log(found)
            metrics = {**metrics, **found}
        return metrics

    def _maybe_empty_cache(self) -> None:
        """``torch_empty_cache_steps``, as the stock step honours it."""
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0:
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache()


class LongtrainTrainer(_LongtrainTraining, Trainer):
    """A ``transformers.Trainer`` whose training step is :func:`longtrain.step` with ``strategy``.

    ``strategy`` is a :class:`~longtrain.Strategy`, a strategy string as ``longtrain plan``
    prints it or ``--strategy`` takes it (``"checkpoint,mst"``,
    ``"fpdt:chunk=8192:offload=true,mst"``, ``"memo:alpha=0.3,mst"``), ``"auto"`` (the
    planner's fastest strategy that fits this device at the run's length), or None (plain
    autograd through longtrain's engine). Every other argument is the Trainer's. What
    cannot run exactly (DeepSpeed, FSDP1, several GPUs in one process, fp16's GradScaler, a
    custom loss, ...) is refused here in one line. Under ``torchrun`` or ``accelerate launch``
    with several processes it trains data parallel: each process runs the step on its own
    micro-batches, and their gradients are summed before clipping and the optimizer step, as
    DDP's are; or sharded by the Trainer's FSDP2; or, with ``parallelism_config``'s
    ``sp_size``, sequence parallel (:mod:`longtrain.hf_sequence_parallel`).
    ``trainer.strategy`` is the strategy applied.
    """


def _check_long_context_eval(settings: Mapping | None) -> dict | None:
    """``long_context_eval``: keyword arguments of ``evaluate_long_context`` (``lengths``
    required; ``depths``, ``samples``, ``task``, ``seed``), checked by name now."""
    if settings is None:
        return None
    allowed = {"lengths", "depths", "samples", "task", "seed", "extend_context"}
    if not isinstance(settings, Mapping) or "lengths" not in settings or set(settings) - allowed:
        unknown = sorted(set(settings) - allowed) if isinstance(settings, Mapping) else []
        raise LongtrainError(f"long_context_eval takes a mapping with 'lengths' and optionally depths, samples, task and "
                             f"seed (and extend_context){f'; unknown: {unknown[0]!r}' if unknown else ''}, e.g. "
                             "{'lengths': [2048, 8192], 'depths': [0, 0.5, 1], 'samples': 8}")
    return dict(settings)


def _check_long_context_lengths(settings: dict | None, model) -> None:
    """``long_context_eval``'s lengths within the model's ``max_position_embeddings`` (as
    ``longtrain eval`` has them) unless ``extend_context=True``; and what each evaluation will
    cost, said once."""
    if settings is None:
        return
    from .train.eval_config import DEFAULT_DEPTHS

    lengths = [n for n in settings["lengths"] if isinstance(n, int) and not isinstance(n, bool)]
    if not lengths:  # refused by the evaluation, in its words
        return
    longest = describe_model(unwrap(model).config).max_positions
    beyond = [n for n in lengths if longest and n > longest]
    if beyond and not settings.get("extend_context", False):
        raise LongtrainError(f"long_context_eval lengths {', '.join(f'{n:,}' for n in beyond)} exceed the model's "
                             f"max_position_embeddings ({longest:,}); pass extend_context=True to evaluate at positions "
                             f"it was not configured for, or lengths up to {longest:,}")
    task = settings.get("task", "both")
    depths = len(settings.get("depths", DEFAULT_DEPTHS)) if task != "passkey" else 0
    cells = len(lengths) * ((task != "needle") + depths)
    samples = settings.get("samples", 16)
    logger.info("longtrain: each evaluation adds %d long-context cells of %d samples: %d forward passes of up to "
                "%s tokens", cells, samples, cells * samples, f"{max(lengths):,}")


def wrap(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` (``trl.SFTTrainer``, or any ``transformers.Trainer``
    subclass) that takes ``strategy=`` and trains with :func:`longtrain.step`, as
    :class:`LongtrainTrainer` does. Training never calls ``compute_loss``: a class whose
    loss is not next-token cross-entropy (one overriding ``compute_loss``, other than
    TRL's SFTTrainer) is refused; SFTTrainer's training metrics (``entropy``,
    ``mean_token_accuracy``, ``num_tokens``) are computed by the step as TRL computes them,
    chunk by chunk of the LM head; evaluation runs as the class has it."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise LongtrainError(f"wrap takes a transformers.Trainer subclass such as trl.SFTTrainer, got {trainer_cls!r}")
    return _wrapped(trainer_cls)


@functools.cache
def _wrapped(trainer_cls: type) -> type:
    """One subclass per Trainer class: ``wrap(SFTTrainer) is wrap(SFTTrainer)``."""
    if trainer_cls is Trainer:
        return LongtrainTrainer
    if issubclass(trainer_cls, _LongtrainTraining):
        return trainer_cls
    _check_loss_is_cross_entropy(trainer_cls)
    _check_no_own_training_step(trainer_cls)
    name = f"Longtrain{trainer_cls.__name__}"
    doc = f"``{trainer_cls.__module__}.{trainer_cls.__qualname__}`` whose training step is :func:`longtrain.step`."
    return type(name, (_LongtrainTraining, trainer_cls), {"__module__": __name__, "__qualname__": name, "__doc__": doc})


# The Trainers longtrain's step stands in for exactly: their compute_loss is next-token
# cross-entropy (for SFTTrainer, with loss_type="nll", no label smoothing and no
# compute_loss_func, which the checks below insist on), and their training_step adds nothing
# the step loses (SFTTrainer's only opens its activation offloading, which strategies replace).
_STOOD_IN_FOR = {("transformers.trainer", "Trainer"), ("trl.trainer.sft_trainer", "SFTTrainer")}


def _check_loss_is_cross_entropy(trainer_cls: type) -> None:
    """Refuse a Trainer subclass whose own ``compute_loss`` training would silently skip."""
    owner = next(c for c in trainer_cls.__mro__ if "compute_loss" in vars(c))
    if (owner.__module__, owner.__qualname__) not in _STOOD_IN_FOR:
        raise LongtrainError(f"{trainer_cls.__name__} computes its loss in {owner.__name__}.compute_loss, which "
                             "longtrain's step replaces with next-token cross-entropy; wrap a trainer whose loss is "
                             "that (transformers.Trainer, trl.SFTTrainer)")


def _check_no_own_training_step(trainer_cls: type) -> None:
    """Refuse a Trainer subclass whose own ``training_step`` longtrain's step would replace
    unseen (TRL's SFTTrainer only wraps the stock step in its activation offloading, which
    longtrain's strategies replace)."""
    owner = next(c for c in trainer_cls.__mro__ if "training_step" in vars(c))
    if (owner.__module__, owner.__qualname__) not in _STOOD_IN_FOR:
        raise LongtrainError(f"{trainer_cls.__name__} overrides training_step in {owner.__name__}, which longtrain's "
                             "step replaces; move that work to a TrainerCallback, or wrap the class it extends")


# ---- the strategy -----------------------------------------------------------------------


def _parse_strategy(strategy) -> "Strategy | str":
    """``strategy`` as a :class:`Strategy`, or ``"auto"`` (planned once the model is placed)."""
    if isinstance(strategy, str) and strategy.strip() == "auto":
        return "auto"
    parsed = Strategy.parse(strategy)
    if parsed.sequence_parallel is not None:
        degree = parsed.sequence_parallel.degree
        raise LongtrainError(f"inside a Trainer, sequence parallelism is set in the training arguments: drop +sp{degree} "
                             f"and set parallelism_config=ParallelismConfig(sp_size={degree})")
    return parsed


def _auto_strategy(trainer) -> Strategy:
    """``strategy="auto"``: the planner's fastest strategy fitting this device, for the run's
    longest row (TRL's ``max_length``, times the batch for padding-free rows, else the
    model's ``max_position_embeddings``) and its optimizer; full fine-tuning only, as
    ``longtrain train --strategy auto`` plans it."""
    from .plan.auto import auto_strategy

    model = trainer.model
    if unwrap(model) is not model:
        raise LongtrainError("strategy='auto' plans full fine-tuning, not a PEFT model's; pick a strategy with "
                             "`longtrain plan --lora` and pass it as strategy=")
    config = model.config
    length = getattr(trainer.args, "max_length", None) or describe_model(config).max_positions
    if not length:
        raise LongtrainError("strategy='auto' needs the run's longest sequence: set max_length (TRL's SFTConfig) "
                             "or the model config's max_position_embeddings, or name a strategy")
    rows = trainer.args.per_device_train_batch_size
    if getattr(trainer, "padding_free", False):  # TRL joins a batch's rows into one
        rows, length = 1, length * rows
    args = trainer.args
    dtype = "bfloat16" if args.bf16 else str(next(model.parameters()).dtype).replace("torch.", "")
    # Others are planned with AdamW's state, the larger: the Trainer's AdamW keeps its moments in
    # the weights' dtype (no float32 masters beside 16-bit weights).
    sixteen = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    optimizer = "sgd" if str(getattr(args.optim, "value", args.optim)) == "sgd" else ("adamw-16bit" if sixteen else "adamw")
    return auto_strategy(config, int(length), args.device, dtype=dtype, batch=rows, optimizer=optimizer,
                         say=logger.info)


def _take_over_checkpointing(trainer, strategy: Strategy, planned: bool) -> Strategy:
    """Hugging Face's activation checkpointing, asked in the arguments (TRL's default) or
    already on the model, becomes the strategy's: longtrain's ``checkpoint`` is added where
    the engine and techniques compose with it, and Hugging Face's is switched off — it would
    checkpoint inside longtrain's schedule. A planned strategy is kept as planned."""
    args, base = trainer.args, unwrap(trainer.model)
    asked = bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))
    on_model = any(getattr(m, "gradient_checkpointing", False) is True for m in base.modules())
    if not (asked or on_model):
        return strategy
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(args, name, None):
            setattr(args, name, False)
    if on_model:
        disable = getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable
        disable()
    if planned or strategy.uses("checkpoint") or not _composes_with_checkpoint(strategy):
        logger.info("longtrain: Hugging Face's activation checkpointing is off; strategy %r keeps activations its "
                    "own way", strategy.spec)
        return strategy
    taken = Strategy(strategy.engine, strategy.engine_options, **strategy.techniques, checkpoint=True)
    logger.warning("longtrain: the Trainer asks for activation checkpointing (TRL's default): training with "
                   "strategy %r", taken.spec)
    return taken


def _composes_with_checkpoint(strategy: Strategy) -> bool:
    """Whether ``checkpoint`` can join ``strategy`` (its engine accepts it, no technique excludes it)."""
    return ("checkpoint" in registry.engine(strategy.engine).accepts
            and not any("checkpoint" in registry.technique(name).excludes for name in strategy.techniques))


# ---- what cannot run ------------------------------------------------------------------


def _check_arguments(args) -> None:
    """Refuse, in one line, the training arguments longtrain's step cannot honour exactly."""
    optim = str(getattr(args.optim, "value", args.optim))
    refusals = [
        (args.deepspeed, "DeepSpeed runs its own forward, backward and sharding, which longtrain's step replaces; drop "
                         f"deepspeed= ({_SP_HINT})"),
        (args.fsdp and int((args.fsdp_config or {}).get("version", 2)) != 2,
         "FSDP1 wraps the model's forward, which longtrain's step does not call; set fsdp_config={'version': 2} "
         f"(FSDP2 shards each unit longtrain calls), or drop fsdp= ({_SP_HINT})"),
        (degree_of(getattr(args, "parallelism_config", None)) and args.fsdp,
         "sequence parallelism (parallelism_config sp_size) shards the model with FSDP2 itself; drop fsdp="),
        (args.n_gpu > 1, f"{args.n_gpu} GPUs visible to one process make the Trainer use torch DataParallel, which "
                         f"longtrain's step bypasses; make one visible (CUDA_VISIBLE_DEVICES=0), or {_SP_HINT}"),
        (args.fp16, _FP16),
        (args.torch_compile, "torch_compile compiles the model's forward, which longtrain's step does not call; set "
                             "torch_compile=False"),
        (optim in ("lomo", "adalomo"), f"optim={optim!r} fuses the update into the Trainer's backward, which "
                                       "longtrain's step runs itself; pick another optimizer (adamw_torch, sgd)"),
        (args.use_liger_kernel, "use_liger_kernel patches the model behind longtrain's engines; drop it and add liger "
                                "to the strategy (e.g. 'checkpoint,mst,liger')"),
        (args.label_smoothing_factor > 0, "label smoothing is not longtrain's loss (next-token cross-entropy over "
                                          "chunks, no full logits); set label_smoothing_factor=0"),
        (getattr(args, "loss_type", "nll") not in ("nll", None),
         f"loss_type={getattr(args, 'loss_type', None)!r} is not longtrain's loss (next-token cross-entropy); "
         "set loss_type='nll'"),
        (getattr(args, "activation_offloading", False),
         "activation_offloading moves saved tensors behind longtrain's engines; drop it and let the strategy "
         "park activations (e.g. 'checkpoint:offload_inputs', 'fpdt:offload=true', 'memo')"),
    ]
    _refuse_first(refusals)


def _check_trainer(trainer) -> None:
    """Refuse, in one line, what the built Trainer (its accelerator, loss and model
    placement) would do that longtrain's step cannot honour exactly."""
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    kind = accelerator.distributed_type
    refusals = [
        (kind == DistributedType.DEEPSPEED,
         f"the Accelerate config enables DeepSpeed, which longtrain's step replaces; disable it ({_SP_HINT})"),
        ((kind == DistributedType.FSDP or _fsdp(accelerator)) and not _fsdp2(accelerator),
         "the Accelerate config enables FSDP1, which wraps the model's forward that longtrain's step does not call; "
         f"set fsdp_version: 2 (FSDP2 shards each unit longtrain calls), or disable FSDP ({_SP_HINT})"),
        (accelerator.num_processes > 1 and not (_data_parallel(accelerator) or _fsdp2(accelerator)),
         f"{accelerator.num_processes} processes under {kind} are not supported; run them as plain data parallel "
         f"(torchrun or accelerate launch without DeepSpeed) or FSDP2, or {_SP_HINT}"),
        (degree_of(getattr(accelerator, "parallelism_config", None)) and _fsdp(accelerator),
         "sequence parallelism (parallelism_config sp_size) shards the model with FSDP2 itself; disable FSDP in the "
         "Accelerate config"),
        (accelerator.scaler is not None, _FP16),
        (trainer.compute_loss_func is not None, "compute_loss_func replaces the loss, and longtrain's step computes "
                                                "next-token cross-entropy; drop it, or train with the stock Trainer"),
        (trainer.is_model_parallel,
         f"a model spread over several devices (device_map) is not supported; load it on one device (device_map=None), "
         f"or {_SP_HINT}"),
    ]
    _refuse_first(refusals)


def _adds_balancing_loss(model) -> bool:
    """Whether ``model``'s step adds its routers' load-balancing loss (a mixture of experts
    whose config sets ``output_router_logits`` and a coefficient)."""
    balance = getattr(applied_context(model), "router_balance", None)
    return balance is not None and balance.coef > 0


def _logs_token_metrics(trainer) -> bool:
    """Whether ``trainer`` logs TRL's token metrics from its ``compute_loss`` (SFTTrainer), which
    training never calls: the step computes them instead."""
    return hasattr(trainer, "_metrics") and hasattr(trainer, "_total_train_tokens")


def _data_parallel(accelerator) -> bool:
    """Whether the Trainer's processes are plain data parallel (DDP): each trains the whole
    model on its own micro-batches and the gradients are summed over them."""
    from accelerate.utils import DistributedType

    kinds = {getattr(DistributedType, name, None) for name in ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU",
                                                               "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU")}
    return accelerator.num_processes > 1 and accelerator.distributed_type in kinds


def _fsdp(accelerator) -> int | None:
    """The FSDP version Accelerate shards the model with (its FSDP plugin, as the Trainer
    reads it), or None."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return None if plugin is None else getattr(plugin, "fsdp_version", 1)


def _fsdp2(accelerator) -> bool:
    """Whether Accelerate shards the model with FSDP2 (``fsdp_version: 2``)."""
    return _fsdp(accelerator) == 2


def _settle_sharding(model, summed: bool) -> None:
    """Before each step under FSDP2: once, the model made its units' root (its forward never
    runs, :func:`~longtrain.parallel.fsdp.settle_root`) and, where the stock step multiplies
    its loss by the processes (``summed``), each unit's reduce-scatter summing instead of
    averaging — the same update; then the units whose forward the step does not call (the
    root, where it holds parameters, and the LM head's, which the fused loss reads)
    gathered, to be reduced and resharded at the end of the backward pass, as FSDP2 ends
    every unit's."""
    from torch.distributed.fsdp import FSDPModule

    from .parallel.fsdp import settle_root, sum_gradients_of, unit_holding

    bypassed = getattr(model, "_longtrain_bypassed_units", None)
    if bypassed is None:
        settle_root(model)
        if summed:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    sum_gradients_of(module)
        head = unit_holding(model, applied_context(model).adapter.head().module)
        bypassed = model._longtrain_bypassed_units = [model] + ([head] if head is not None else [])
    for unit in bypassed:
        unit.unshard()


def _refuse_first(refusals) -> None:
    """Raise the message of the first (condition, message) pair whose condition holds."""
    for refused, message in refusals:
        if refused:
            raise LongtrainError(message)


# ---- the batch --------------------------------------------------------------------------


def _longtrain_batch(inputs: Mapping) -> dict:
    """The collated batch as :func:`longtrain.step` reads it (Hugging Face's conventions:
    unshifted labels, -100 ignored, position ids restarting at packed documents); keys that
    would change the loss unseen are refused."""
    if "shift_labels" in inputs:
        raise LongtrainError("batches with pre-shifted 'shift_labels' are not supported; collate unshifted 'labels' "
                             "(position t predicts labels[t + 1])")
    if inputs.get("labels") is None:
        raise LongtrainError("the batch has no 'labels'; use a collator that sets them (TRL's SFTTrainer does, or "
                             "transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False))")
    unknown = sorted(set(inputs) - set(BATCH_KEYS) - _DERIVED_KEYS)
    if unknown:
        raise LongtrainError(f"batch key {unknown[0]!r} is not read by longtrain's step (it reads "
                             f"{', '.join(BATCH_KEYS)}); drop it from the dataset or collator")
    return {key: inputs[key] for key in BATCH_KEYS if inputs.get(key) is not None}


def _as_count(num_items_in_batch) -> int:
    """The Trainer's ``num_items_in_batch`` (a tensor, after its divisions a float one) as an int."""
    value = float(num_items_in_batch.item() if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch)
    if value != int(value) or value < 0:
        raise LongtrainError(f"num_items_in_batch={value} is not a count of label tokens; a Trainer subclass that "
                             "counts them itself (get_batch_samples) must return a whole number")
    return int(value)
