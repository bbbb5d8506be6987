"""Run under ``torchrun --nproc-per-node N`` or ``accelerate launch --num_processes N`` (or as
one process): two optimizer steps of a float64 tiny-llama through the Hugging Face Trainer —
stock (``stock``) or :class:`~longtrain.hf.LongtrainTrainer` with each strategy named — on
eight micro-batches of packed and padded rows (the order fixed: micro-batch k goes to
process k mod N). Rank 0 writes ``{kind}-{name}.pt``: the trained parameters, the logged losses
and (stock, and under sequence parallelism) an evaluation loss.

    worker.py OUT ACCUMULATION KIND/NAME[@STEPS]=STRATEGY ...   (STRATEGY "stock": the stock Trainer)

KIND: ``full`` or ``lora`` fine-tuning, or ``unlabelled``: full fine-tuning with micro-batch
3 — under two processes the second one's last of the first step — without a label token.
``@STEPS``: stop after that many steps, saving a checkpoint at each; ``RESUME`` in the
environment (a checkpoint folder): go on from it to the second step. ``SP=P``: sequence
parallelism over groups of P processes (``parallelism_config``, :func:`sp_on_cpu`). ``FSDP=1`` in the
environment: the Trainer shards the model with FSDP2 (``fsdp`` and ``fsdp_config`` in the
training arguments, each decoder layer a unit) — on the CPU too (:func:`fsdp_on_cpu`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from conftest import packed_batch, padded_batch, stock_and_ours, stock_lora_and_ours
from test_hf import Batches, completion_only, in_float64, training_args
from transformers import Trainer

from longtrain.hf import LongtrainTrainer

VOCAB = 320
MICRO_BATCHES = [
    completion_only(packed_batch(VOCAB, documents=((20, 13, 15), (30, 18)), seed=k)) if k % 2 else
    completion_only(padded_batch(VOCAB, lengths=(37 - k, 26 + k), seed=k))
    for k in range(8)
]


def in_order(cls):
    """``cls`` sampling its micro-batches in order (the Trainer shuffles them with a seeded sampler)."""

    class InOrder(cls):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def fsdp_on_cpu(cls):
    """``cls`` with FSDP on the CPU as the Trainer runs it on GPUs: Accelerate turns a
    Trainer's FSDP plugin on only for GPU-like devices (``AcceleratorState``), so the plugin
    the training arguments describe is set here, as Accelerate sets it there."""

    class OnCpu(cls):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            if self.args.fsdp_plugin_args is not None:
                state = self.accelerator.state
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                state.distributed_type = DistributedType.FSDP
                self.is_fsdp_enabled = True

    return OnCpu


def sp_on_cpu(cls):
    """``cls`` with ``parallelism_config`` on the CPU as on GPUs: Accelerate accepts a
    ParallelismConfig only for GPU-like devices, so the Accelerator is built without it and
    given it after, as Accelerate keeps it there."""

    class OnCpu(cls):
        def create_accelerator_and_postprocess(self):
            config, self.args.parallelism_config = self.args.parallelism_config, None
            try:
                super().create_accelerator_and_postprocess()
            finally:
                self.args.parallelism_config = config
            self.accelerator.state.parallelism_config = config

    return OnCpu


FSDP_ARGS = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                         "reshard_after_forward": True})


class WithTokenMetrics(LongtrainTrainer):
    """A LongtrainTrainer that logs TRL's token metrics (as wrap(SFTTrainer) does): its step
    gathers them over the processes, labels or none."""

    def __init__(self, *args, **kwargs):
        import collections

        self._metrics = collections.defaultdict(lambda: collections.defaultdict(list))
        self._total_train_tokens = 0
        super().__init__(*args, **kwargs)


def train(out: Path, accumulation: int, kind: str, name: str, strategy: str, stop: int | None = None) -> None:
    stock, ours = stock_lora_and_ours("tiny-llama") if kind == "lora" else stock_and_ours("tiny-llama")
    model = in_float64(stock) if strategy == "stock" else ours
    batches = [dict(b) for b in MICRO_BATCHES]
    if kind == "unlabelled":
        batches[3]["labels"] = torch.full_like(batches[3]["labels"], -100)
    data = Batches(batches)
    saving = dict(save_strategy="steps", save_steps=1) if stop else {}
    sharded = os.environ.get("FSDP") == "1"
    if os.environ.get("SP"):
        from accelerate import ParallelismConfig

        saving["parallelism_config"] = ParallelismConfig(sp_size=int(os.environ["SP"]))
    args = training_args(out / f"{kind}-{name}", gradient_accumulation_steps=accumulation, max_steps=2, optim="adamw_torch",
                         learning_rate=1e-2, weight_decay=0.1, lr_scheduler_type="linear", **saving,
                         **(FSDP_ARGS if sharded else {}))
    extra = {} if strategy == "stock" else {"strategy": None if strategy == "backprop" else strategy}
    cls = Trainer if strategy == "stock" else WithTokenMetrics if name == "metrics" else LongtrainTrainer
    on_cpu = fsdp_on_cpu if sharded else sp_on_cpu if os.environ.get("SP") else (lambda c: c)
    trainer = on_cpu(in_order(cls))(
        model=model, args=args, train_dataset=data, data_collator=data.collate, **extra)
    if stop:  # interrupted after these steps (the schedule still planned for two)
        from transformers import TrainerCallback

        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                control.should_training_stop = state.global_step >= stop

        trainer.add_callback(Stop())
    trainer.train(resume_from_checkpoint=os.environ.get("RESUME"))
    # (micro-batches in equal pairs: the Trainer weighs each process's evaluation loss by the tokens
    # of the batches evaluated alongside it, so one process and two give the same figure)
    held_out = [0, 0, 2, 2]  # (indices the collator reads micro-batches by)
    evaluated = trainer.evaluate(held_out)["eval_loss"] if strategy == "stock" or os.environ.get("SP") else None
    # (FSDP2's shards gathered whole: a collective every process joins)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in trainer.model.named_parameters() if p.requires_grad}
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        metrics = {k: list(v) for k, v in getattr(trainer, "_metrics", {}).get("train", {}).items()}
        torch.save({"params": params, "losses": losses, "metrics": metrics, "eval_loss": evaluated},
                   out / f"{kind}-{name}.pt")


def main() -> None:
    out, accumulation, *runs = sys.argv[1:]
    for run in runs:
        kind_and_name, strategy = run.split("=", 1)
        kind, name = kind_and_name.split("/")
        name, _, stop = name.partition("@")
        train(Path(out), int(accumulation), kind, name, strategy, int(stop) if stop else None)


if __name__ == "__main__":
    main()
