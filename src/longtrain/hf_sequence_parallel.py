"""Ulysses sequence parallelism inside Hugging Face's Trainer, configured as Hugging Face configures it.

    args = TrainingArguments(..., parallelism_config=ParallelismConfig(sp_size=2))
    trainer = LongtrainTrainer(model=model, args=args, train_dataset=data, strategy="fpdt:chunk=8192,mst")
    # torchrun --nproc-per-node 4 train.py: 2 data-parallel groups of 2 processes sharing each sequence

``sp_size`` (``ParallelismConfig``, or Accelerate's ``parallelism_config_sp_size``) is the
degree of longtrain's Ulysses sequence parallelism, which runs in place of DeepSpeed's:
each group of ``sp_size`` consecutive processes steps on one sequence, the model's
parameters, gradients and optimizer state are sharded over every process by FSDP2
(:func:`longtrain.engines.sequence_parallel.distribute`), and the rest of the world is
data parallel.

The data side is the Trainer's as it runs DeepSpeed's ALST: Accelerate gives every
process its own micro-batches; :class:`GroupBatches` gathers a group's micro-batches and
yields them one after another to every process of the group (the Trainer counts
``sp_size`` times as many micro-batches per epoch, and a global batch of
``per_device × accumulation × processes / sp_size`` micro-batch rows). Each micro-batch
arrives whole on every process of its group; the engine splits its sequence, with its
documents, padding and position ids.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from .errors import LongtrainError

__all__ = ["GroupBatches", "SequenceParallelCheckpoints", "degree_of", "group_loss_normaliser", "install",
           "load_whole_optimizer_state", "whole_optimizer_state", "whole_state_dict"]

logger = logging.getLogger(__name__)


def degree_of(parallelism_config) -> int | None:
    """The sequence-parallel degree ``parallelism_config`` asks for (None: none), refusing in
    one line what longtrain does not run inside the Trainer (context and tensor parallelism,
    and FSDP's own sharding dimension, which sequence parallelism takes over)."""
    if parallelism_config is None:
        return None
    others = [(name, size) for name in ("tp_size", "cp_size", "dp_shard_size")
              if (size := getattr(parallelism_config, name, None) or 1) > 1]
    if others:
        name, size = others[0]
        raise LongtrainError(f"parallelism_config {name}={size} is not supported inside the Trainer: longtrain runs "
                             "sequence parallelism (sp_size) and data parallelism; set "
                             "ParallelismConfig(sp_size=P) alone")
    degree = getattr(parallelism_config, "sp_size", None) or 1
    return degree if degree > 1 else None


def install(trainer, degree: int) -> None:
    """After the strategy with sequence parallelism is applied (the model sharded with
    FSDP2): the Trainer told that the model owns its placement and gradient reduction (it
    must not wrap it in DDP), whole tensors loaded into the model's shards, its token count
    kept for the loss, and the Trainer's ALST data hook given :class:`GroupBatches`."""
    from .strategy import applied_context

    if trainer.args.save_on_each_node and trainer.args.save_strategy != "no":
        raise LongtrainError("under sequence parallelism the first process writes every checkpoint (the shards "
                             "gathered whole); set save_on_each_node=False and save to storage every node reads")
    sp = applied_context(trainer.model).sequence_parallel
    trainer.is_distributed_loading_by_transformers = True
    trainer.model.register_load_state_dict_pre_hook(_shard_whole_tensors)
    # (the Trainer turns the count off for DeepSpeed's loss, which this step replaces: the model's own rule)
    trainer.model_accepts_loss_kwargs = _accepts_loss_kwargs(trainer.model)
    trainer.accelerator.deepspeed_ulysses_dl_adapter = lambda loader, model: GroupBatches(
        loader, sp.comm.group, degree, sp.rank)
    logger.info("longtrain: parallelism_config sp_size=%d runs longtrain's Ulysses sequence parallelism over groups "
                "of %d processes (%d data-parallel groups); its DeepSpeed options are not read", degree, degree,
                trainer.accelerator.num_processes // degree)


def _accepts_loss_kwargs(model) -> bool:
    """Whether ``model``'s forward takes the Trainer's ``num_items_in_batch`` (the Trainer's rule)."""
    import inspect

    from .models.layers import unwrap

    base = unwrap(model)
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(base.forward).parameters.values())


def group_loss_normaliser(one_process_rule, labels, num_items_in_batch, counted_over_all: bool, degree: int,
                          groups: int) -> int:
    """What a process divides its share of the micro-batch's token loss by, so that the
    gradients summed over every process are the stock data-parallel Trainer's on the same
    global batch, each group standing for one stock process. ``one_process_rule`` (the
    step's ``_loss_normaliser``) reads the Trainer's ``num_items_in_batch``, which the
    Trainer divides by ``degree`` (the processes holding each micro-batch): counted over all
    processes, that is the whole step's count; counted per process, it is multiplied back,
    and the groups' means are averaged as stock data parallelism averages its processes'."""
    if counted_over_all:
        return one_process_rule(labels, num_items_in_batch)
    if num_items_in_batch is not None:
        num_items_in_batch = num_items_in_batch * degree
    return one_process_rule(labels, num_items_in_batch) * groups


class SequenceParallelCheckpoints:
    """The Trainer's checkpoints under sequence parallelism, in stock Transformers' formats,
    so that a run saved under N processes goes on under M (one included) and its weights
    load in stock Transformers: the model's and the optimizer's shards are gathered whole
    (every process joins) and written by the writing process; on resumption each process
    takes its shards of the whole tensors it reads. Without sequence parallelism, the
    Trainer's own."""

    def _save(self, output_dir=None, state_dict=None):
        if self.strategy.sequence_parallel is None or state_dict is not None:
            return super()._save(output_dir, state_dict=state_dict)
        state_dict = whole_state_dict(self.model, frozen=not _trains_adapters(self.model))
        return super()._save(output_dir, state_dict=state_dict) if self.args.process_index == 0 else None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.strategy.sequence_parallel is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        writer = self.args.process_index == 0
        state = whole_optimizer_state(self.optimizer, keep=writer)
        if writer:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        saved = None if checkpoint is None else os.path.join(checkpoint, OPTIMIZER_NAME)
        if self.strategy.sequence_parallel is None or saved is None or not os.path.isfile(saved):
            return super()._load_optimizer_and_scheduler(checkpoint)  # (a model-only checkpoint: as the Trainer)
        load_whole_optimizer_state(self.optimizer, torch.load(saved, map_location="cpu", weights_only=True, mmap=True))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        return None

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """The Trainer defers the reduction of a model sharded at load time to the last
        micro-batch by its Transformers sharding config; longtrain's units reduce-scatter
        after every micro-batch instead (the same sum, without holding every process's
        gradients unreduced)."""
        if self.strategy.sequence_parallel is None:
            with super()._defer_fsdp_gradient_reduction():
                yield
        else:
            yield

    def _track_num_input_tokens(self, inputs) -> None:
        """The Trainer's count of tokens seen, each group's micro-batch counted once (every
        process of the group holds it whole)."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        if self.strategy.sequence_parallel is not None:
            added = self.state.num_input_tokens_seen - before
            self.state.num_input_tokens_seen = before + added // self.strategy.sequence_parallel.degree

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's FLOPs of a micro-batch, this process's share of its group's."""
        flops = super().floating_point_ops(inputs)
        parallel = self.strategy.sequence_parallel
        return flops if parallel is None else flops // parallel.degree

    def _run_epoch(self, *args, **kwargs):
        """The Trainer's epoch; on resumption its skip of the micro-batches already trained
        taken by :class:`GroupBatches` (a group's, counted as the Trainer counts them)."""
        if self.strategy.sequence_parallel is None:
            return super()._run_epoch(*args, **kwargs)
        import transformers.trainer as module

        stock = module.skip_first_batches
        module.skip_first_batches = lambda loader, n: loader.skip(n) if isinstance(loader, GroupBatches) else stock(
            loader, n)
        try:
            return super()._run_epoch(*args, **kwargs)
        finally:
            module.skip_first_batches = stock

    def prediction_step(self, *args, **kwargs):
        """Evaluation: each process evaluates its own batches whole (the Trainer's forward),
        so the Trainer's token count, which it divides by the processes it takes to share
        each batch, is multiplied back."""
        self._longtrain_predicting = True
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self._longtrain_predicting = False

    def _get_num_items_in_batch(self, batch_samples, device):
        count = super()._get_num_items_in_batch(batch_samples, device)
        if count is None or self.strategy.sequence_parallel is None or not getattr(self, "_longtrain_predicting", False):
            return count
        return count * self.strategy.sequence_parallel.degree


def _trains_adapters(model) -> bool:
    """Whether ``model`` is a PEFT model (its checkpoints hold the adapters alone)."""
    return hasattr(model, "peft_config")


def whole_optimizer_state(optimizer, keep: bool = True) -> dict:
    """``optimizer``'s state dict in the stock format, each sharded state tensor gathered
    whole (a collective every process joins, in the same order) and, where ``keep``, kept
    in host memory (elsewhere dropped as soon as gathered)."""
    state = optimizer.state_dict()
    for values in state["state"].values():
        for key, value in values.items():
            if hasattr(value, "full_tensor"):
                whole = value.full_tensor()
                values[key] = whole.cpu() if keep else None
    return state


def load_whole_optimizer_state(optimizer, state: dict) -> None:
    """Load a stock-format optimizer state of whole tensors, each process taking its shards."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, values in state["state"].items():
        for key, value in values.items():
            param = params[index]
            if isinstance(value, torch.Tensor) and hasattr(param, "device_mesh") and value.shape == param.shape:
                values[key] = _shard_like(value, param)
    optimizer.load_state_dict(state)


def _shard_like(whole: torch.Tensor, like) -> torch.Tensor:
    """This process's shard of ``whole``, sharded as the DTensor ``like`` (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def _shard_whole_tensors(module, state_dict, prefix, *args) -> None:
    """A load-state-dict hook: whole tensors (a checkpoint's) made this process's shards of
    the parameters they load into."""
    own = module.state_dict(keep_vars=True) if not prefix else {}
    for key, value in list(state_dict.items()):
        target = own.get(key)
        if hasattr(target, "device_mesh") and isinstance(value, torch.Tensor) and not hasattr(value, "device_mesh"):
            state_dict[key] = _shard_like(value, target)


def whole_state_dict(model, frozen: bool = True) -> dict:
    """``model``'s state dict (without its frozen parameters unless ``frozen``) with every
    FSDP2 shard gathered, on the host: whole on rank 0, empty elsewhere (a collective every
    process joins)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=not frozen)
    return get_model_state_dict(model, options=options)


class GroupBatches:
    """The micro-batches of a sequence-parallel group's processes, in rank order, each
    yielded to every process of the group (``degree`` times as many as ``loader`` yields)."""

    def __init__(self, loader, group, degree: int, rank: int, skipped: int = 0):
        self.loader, self.group, self.degree, self.rank = loader, group, degree, rank
        self.skipped = skipped  # of the first gathered micro-batches

    def skip(self, n: int) -> "GroupBatches":
        """These micro-batches without their first ``n`` (resumption)."""
        from accelerate import skip_first_batches

        rounds, rest = divmod(n, self.degree)
        return GroupBatches(skip_first_batches(self.loader, rounds), self.group, self.degree, self.rank, rest)

    def __len__(self) -> int:
        return len(self.loader) * self.degree

    def __getattr__(self, name):  # set_epoch, batch_size, dataset, ... of the Trainer's loader
        return getattr(self.loader, name)

    def __iter__(self):
        self._check_equal_lengths()
        skip = self.skipped
        for batch in self.loader:
            on_host = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            every = [None] * self.degree
            dist.all_gather_object(every, on_host, group=self.group)
            every, skip = every[skip:], 0
            device = _device_of(batch)
            for other in every:
                yield {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in other.items()}

    def _check_equal_lengths(self) -> None:
        """Every process of the group must read as many micro-batches (Accelerate's
        ``even_batches``, its default, makes them so); otherwise one line, not a group
        waiting in a gather a finished process never joins."""
        try:
            mine = len(self.loader)
        except TypeError:  # an iterable dataset: its length is not known ahead
            return
        every = [None] * self.degree
        dist.all_gather_object(every, mine, group=self.group)
        if len(set(every)) > 1:
            raise LongtrainError(f"the processes of a sequence-parallel group read {every} micro-batches per epoch; "
                                 "every process of a group must read as many (keep the data loader's even_batches "
                                 "on, Accelerate's default)")


def _device_of(batch) -> torch.device:
    return next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
