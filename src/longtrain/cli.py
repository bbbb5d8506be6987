"""Command line: ``longtrain train | simulate | plan | presets``.

User mistakes raise :class:`LongtrainError` and are printed as one line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import LongtrainError
from .memory.units import parse_tokens


def _tokens(text: str) -> int:
    try:
        return parse_tokens(text)
    except LongtrainError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_train(sub) -> None:
    from .train.trainer import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="fine-tune a causal LM (default: the built-in pass-key demo)",
                       description="Train a causal LM on long sequences. With no arguments, trains the embedded demo: "
                                   "a small Llama at 8K tokens on the built-in pass-key retrieval task.")
    p.add_argument("--model", default=d.model, help="preset name (see `longtrain presets`) or local Hugging Face model directory")
    p.add_argument("--data", default=d.data, help="text/.jsonl file or directory (default: built-in pass-key task)")
    p.add_argument("--seq-len", type=_tokens, default=d.seq_len, help="tokens per sample, e.g. 8192, 64K (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--optimizer", default=d.optimizer, choices=["adamw", "sgd"])
    p.add_argument("--strategy", default=d.strategy, help="techniques: none, checkpoint, mst, memo, a comma list with options (checkpoint,mst:loss_chunks=8), a strategy .yaml/.json, or auto (the planner picks the fastest that fits this machine)")
    p.add_argument("--engine", default=d.engine, help="gradient engine with options: backprop; fpdt:chunk=8192:offload=true "
                   "(chunked attention, host offload); seco:chunk=4096; spaco:chunk=128:budget=8:cap=2; "
                   "adjoint:truncate=64 (SSM-ResNet models)")
    p.add_argument("--sp", type=int, default=d.sp, help="Ulysses sequence parallelism: processes that share each sequence "
                   "(under torchrun; a divisor of the process count, the rest is data parallel; parameters are sharded over all)")
    p.add_argument("--master-weights", default=d.master_weights, help="with --sp: keep parameters and optimizer state in this "
                   "dtype (e.g. float32) while layers compute in --dtype (FSDP2 mixed precision)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of all weights (needs peft)")
    p.add_argument("--lora-rank", type=int, default=d.lora_rank)
    p.add_argument("--dtype", default=d.dtype, help="float32, bfloat16, ... (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out, help="run directory for checkpoints, metrics and the final model (default %(default)s)")
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="evaluate the task every N steps (0: only at the end)")
    p.add_argument("--eval-samples", type=int, default=d.eval_samples)
    p.add_argument("--task-loss", default=d.task_loss, choices=["task", "all"], help="pass-key task: loss on needle+answer, or on all text")
    p.add_argument("--packing", default=d.packing, choices=["concat", "documents"],
                   help="--data: join documents with EOS and attend across them (concat), or restart positions and attention at each document (documents)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--resume-from", default=None, help="continue from this checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    p.add_argument("--extend-context", action="store_true", help="allow --seq-len beyond a pretrained model's max_position_embeddings")
    p.add_argument("--tensorboard", action="store_true", help="also log to --out/tensorboard")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(run=_run_train)


def _run_train(args) -> int:
    from transformers.utils import logging as hf_logging

    from .train.trainer import Trainer, config_from_dict, format_summary

    hf_logging.disable_progress_bar()  # transformers' own bars ("Writing model shards") would interleave with ours

    config = config_from_dict(vars(args))
    trainer = Trainer(config)
    summary = trainer.train()
    if summary:  # under torchrun, rank 0 reports
        print(f"longtrain train: finished, run in {config.out}")
        print(format_summary(summary))
    return 0


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="simulate the peak memory of a training step at full scale (no GPU needed)",
                       description="Run forward + backward + optimizer step twice on fake tensors and report the "
                                   "steady-state device and host peaks by category.")
    p.add_argument("--model", required=True, help="preset name or local model directory (only its config is read)")
    p.add_argument("--seq-len", type=_tokens, required=True, help="tokens per sample, e.g. 65536 or 64K")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (their gradients are alive in later forwards)")
    p.add_argument("--strategy", default="none", help="techniques: none, checkpoint, mst, a comma list with options, or a strategy .yaml/.json")
    p.add_argument("--engine", default=None, help="gradient engine with options: backprop, fpdt:chunk=8192:offload=true, seco:chunk=4096, spaco, adjoint:truncate=64")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"])
    p.add_argument("--sp", type=int, default=1, help="Ulysses sequence parallelism over P ranks: simulate one rank's share "
                   "(its tokens, its heads, 1/P of parameters, gradients and optimizer state)")
    p.add_argument("--dtype", default="bfloat16", help="parameter and activation dtype (default %(default)s)")
    p.add_argument("--fragmentation", action="store_true",
                   help="also plan the step's device memory offline (CP-SAT; needs longtrain[plan]) and compare the "
                        "planned peak with the allocated one and with an allocator that cannot see the future")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_run_simulate)


def _run_simulate(args) -> int:
    from .plan.simulate import simulate

    if args.seq_len < 2:
        raise LongtrainError(f"--seq-len must be at least 2, got {args.seq_len}")
    if args.batch_size <= 0:
        raise LongtrainError(f"--batch-size must be positive, got {args.batch_size}")
    from .strategy import Strategy

    if args.sp <= 0:
        raise LongtrainError(f"--sp must be a positive integer, got {args.sp}")
    strategy = Strategy.parse(args.strategy, engine=args.engine, sequence_parallel=args.sp if args.sp > 1 else None)
    if args.grad_accum <= 0:
        raise LongtrainError(f"--grad-accum must be positive, got {args.grad_accum}")
    report = simulate(args.model, args.seq_len, batch_size=args.batch_size, strategy=strategy,
                      optimizer=args.optimizer, dtype=args.dtype, grad_accum=args.grad_accum,
                      fragmentation=args.fragmentation)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return 0


def _bytes(text: str) -> int:
    from .memory.units import parse_bytes

    try:
        value = parse_bytes(text)
    except LongtrainError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a memory size must be positive, got {text!r}")
    return value


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="which exact strategy trains a model at a length on a machine, fastest (no GPU needed)",
                       description="Simulate each candidate strategy (checkpointing + MsT, Memo, FPDT with offload at a few "
                                   "chunk sizes) on fake tensors, add the allocator's measured fragmentation margin, "
                                   "predict step time from the H100 time model, and rank what fits.")
    p.add_argument("--model", required=True, help="preset name or local model directory (only its config is read)")
    p.add_argument("--seq-len", type=_tokens, required=True, help="tokens per sample: 300000, 512K, 1M")
    p.add_argument("--device-memory", type=_bytes, required=True, help="memory of one GPU: 80GiB, 141GB")
    p.add_argument("--host-memory", type=_bytes, required=True, help="host memory the run may use: 120GiB")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"])
    p.add_argument("--dtype", default="bfloat16", help="parameter and activation dtype (default %(default)s)")
    p.add_argument("--longest", action="store_true", help="also find the longest context each strategy reaches "
                   "(a second simulation per strategy)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run_plan)


def _run_plan(args) -> int:
    from .plan.planner import plan

    if args.seq_len < 2:
        raise LongtrainError(f"--seq-len must be at least 2, got {args.seq_len}")
    progress = None if args.json else (lambda line: print(f"  {line} ...", file=sys.stderr, flush=True))
    result = plan(args.model, args.seq_len, device_memory=args.device_memory, host_memory=args.host_memory,
                  optimizer=args.optimizer, dtype=args.dtype, longest=args.longest, progress=progress)
    print(result.to_json() if args.json else result.table())
    return 0 if result.best is not None else 1


def _add_presets(sub) -> None:
    p = sub.add_parser("presets", help="list model presets")
    p.set_defaults(run=_run_presets)


def _run_presets(args) -> int:
    from .models.presets import preset_config, preset_names

    for name in preset_names():
        c = preset_config(name)
        print(f"{name:<14} {c.model_type:<10} layers {c.num_hidden_layers:>3}  hidden {c.hidden_size:>5}  vocab {c.vocab_size:>6}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longtrain", description="Long-context training with bounded memory and exact gradients.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_simulate(sub)
    _add_plan(sub)
    _add_presets(sub)
    return parser


def _leave_process_group(code: int) -> None:
    """Under torchrun a failed rank leaves at once (see parallel.distributed.exit_process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .parallel.distributed import exit_process

        exit_process(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except LongtrainError as exc:
        print(f"longtrain: error: {exc}", file=sys.stderr)
        _leave_process_group(2)
        return 2
    except KeyboardInterrupt:
        print("longtrain: interrupted; the last complete checkpoint is kept (continue with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
