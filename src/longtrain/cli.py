"""Command line: ``longtrain train | simulate | plan | calibrate | presets | eval``.

User mistakes raise :class:`LongtrainError` and are printed as one line, exit code 2;
so are usage errors. Unexpected errors keep their traceback.

Nothing heavy is imported at module level: torch and transformers load inside the
command that needs them, so ``--help`` and ``presets`` start at once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings

from .errors import LongtrainError

__all__ = ["build_parser", "main"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, except where there is none to show: no
    value (None) or a switch."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors in one line (it prints the whole usage first), exit
    code 2, and defaults shown; subcommands inherit both."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class _Given(argparse.Action):
    """Store the value, and note in the namespace's ``given`` that the option was on the
    command line (a value equal to the default counts): ``--lora-rank 8`` without
    ``--lora`` is refused as ``--lora-rank 16`` is."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = set(getattr(namespace, "given", ())) | {self.dest}


class _Choices(list):
    """An option's choices, as listed in its help and errors, and ``earlier`` spellings it
    still accepts (not listed)."""

    def __init__(self, shown, earlier=()):
        super().__init__(shown)
        self.earlier = tuple(earlier)

    def __contains__(self, value) -> bool:
        return list.__contains__(self, value) or value in self.earlier


def _tokens(text: str) -> int:
    from .memory.units import parse_tokens

    try:
        return parse_tokens(text)
    except LongtrainError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_train(sub) -> None:
    from .train.config import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="fine-tune a causal LM (default: the built-in pass-key demo)",
                       description="Train a causal LM on long sequences. With no arguments, trains the embedded demo: "
                                   "a small Llama at 8K tokens on the built-in pass-key retrieval task.")
    p.add_argument("--model", default=d.model, help="preset name (see `longtrain presets`) or local Hugging Face model directory; "
                   "the demo preset starts from the small pretrained model longtrain ships (docs/demo.md)")
    p.add_argument("--from-scratch", action="store_true", help="start a preset from random weights, even the demo's")
    p.add_argument("--tokenizer", default=d.tokenizer, help="auto: a model directory's own tokenizer (presets: bytes); "
                   "bytes: the byte tokenizer; or a tokenizer directory")
    p.add_argument("--data", default=d.data, help="text, .jsonl, .json, .parquet, .arrow or .csv file, a directory of them or "
                   "a save_to_disk folder; records of text, chat messages or prompt/completion (docs/data.md); a tenth of its "
                   "windows, up to --eval-samples, is held out for the held-out loss (not given: the built-in pass-key task)")
    p.add_argument("--seq-len", type=_tokens, default=d.seq_len, help="tokens per sample, e.g. 8192, 64K")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per micro-batch")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps in all; resuming with more continues the run")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (linear warm-up, then cosine to 10%% at --steps)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="steps of linear warm-up, below --steps "
                   "(default: 20, or a tenth of --steps where --steps is 20 or fewer)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="decoupled weight decay (0 or more)")
    p.add_argument("--optimizer", default=d.optimizer, choices=["adamw", "adamw-16bit", "sgd"],
                   help="AdamW (betas 0.9, 0.95) with float32 master weights and moments for 16-bit parameters "
                   "(mixed precision), adamw-16bit (AdamW on the 16-bit weights themselves: small updates round "
                   "away) or SGD with momentum 0.9")
    p.add_argument("--strategy", default=d.strategy, help="techniques: none, checkpoint, mst, memo, a comma list with options (checkpoint,mst:loss_chunks=8), a strategy as "
                   "`longtrain plan` prints it (fpdt:chunk=8192:offload,mst: an item naming an engine selects it), a strategy "
                   ".yaml/.json, or auto (the planner picks the fastest that fits this machine)")
    p.add_argument("--engine", default=d.engine, help="gradient engine with options: backprop; fpdt:chunk=8192:offload=true "
                   "(chunked attention, host offload); seco:chunk=4096; spaco:chunk=128:budget=8:cap=2; "
                   "adjoint:truncate=64 (Mamba, Mamba-2, SSM-ResNet); booleans take true/false/yes/no/1/0")
    p.add_argument("--sp", type=int, default=d.sp, help="Ulysses sequence parallelism: processes that share each sequence "
                   "(under torchrun; a divisor of the process count, the rest is data parallel; parameters are sharded over all)")
    p.add_argument("--master-weights", default=d.master_weights, help="with --sp: keep parameters and optimizer state in this "
                   "dtype (e.g. float32) while layers compute in --dtype (FSDP2 mixed precision)")
    p.add_argument("--optimizer-offload", action="store_true", help="keep AdamW's state and fp32 master weights in host "
                   "memory, update them on the CPU, stream gradients there during backward (full fine-tuning of 8B on one GPU)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of all weights (needs peft); final/ holds "
                   "the merged model, final/adapter the adapter for peft")
    p.add_argument("--lora-rank", type=int, default=d.lora_rank, action=_Given, help="rank of the LoRA adapters (with --lora)")
    p.add_argument("--lora-dropout", type=float, default=d.lora_dropout, action=_Given, help="dropout on the LoRA adapters' "
                   "inputs (with --lora; e.g. 0.05; every recomputation replays its masks)")
    p.add_argument("--4bit", dest="four_bit", action="store_true", help="with --lora: load the base in 4 bits (QLoRA: "
                   "bitsandbytes NF4, computing in --dtype; a model directory; needs bitsandbytes)")
    p.add_argument("--dtype", default=d.dtype, help="float32, bfloat16, float16 (not given: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of a preset's weights, the data order and the task")
    p.add_argument("--out", default=d.out, help="run directory for checkpoints, metrics (metrics.jsonl, metrics.png) and the final model")
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="checkpoints kept (the newest; at least 1)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="evaluate (pass-key accuracy or held-out loss) every N steps; 0: only at the end")
    p.add_argument("--eval-samples", type=int, default=d.eval_samples, help="samples per evaluation (with --data: the most windows held out)")
    p.add_argument("--task-loss", default=d.task_loss, choices=["task", "all"], help="pass-key task: loss on needle+answer, or on all text")
    p.add_argument("--packing", default=d.packing, choices=["auto", "concat", "documents", "best-fit"],
                   help="--data: join documents with EOS and cut them into windows, attending across them (concat) or with "
                   "positions and attention restarting at each (documents); or best-fit whole documents into windows, restarting "
                   "at each (best-fit); auto: best-fit for chat and prompt/completion records, concat for text")
    p.add_argument("--loss-on", default=d.loss_on, choices=["assistant", "all"],
                   help="--data chat and prompt/completion records: the loss on the assistant messages' or completion's tokens "
                   "only (assistant, the default), or on every token (all); text records have it on every token, and "
                   "--loss-on assistant on data without chat or prompt/completion records is refused")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint (from step 0 "
                   "if it has none); a changed --steps, --lr, --warmup-steps or --weight-decay applies from there on")
    p.add_argument("--resume-from", default=None, help="continue from this checkpoint directory, or a run directory's latest")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out (its checkpoints, metrics and final model)")
    p.add_argument("--extend-context", action="store_true", help="allow --seq-len beyond a pretrained model's max_position_embeddings")
    p.add_argument("--tensorboard", action="store_true", help="also log to --out/tensorboard (needs tensorboard)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(run=_run_train)


def _prefer_expandable_segments() -> None:
    """Before the command allocates on a GPU: chunked steps fragment the default allocator's
    segments (docs/speed.md); a user's own PYTORCH_ALLOC_CONF wins."""
    from .memory.allocator import prefer_expandable_segments

    prefer_expandable_segments()


def _run_train(args) -> int:
    from .train.config import check_config, config_from_dict

    _prefer_expandable_segments()  # an environment variable: torch not loaded
    config = config_from_dict(vars(args))
    # Values, names and the model directory first: a mistake is refused before torch loads (seconds).
    check_config(config, given=getattr(args, "given", set()))
    from .train.trainer import Trainer, format_summary

    trainer = Trainer(config)
    summary = trainer.train()
    if summary:  # under torchrun, rank 0 reports
        print(f"longtrain train: finished, run in {config.out}")
        print(format_summary(summary))
    return 0


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="simulate the peak memory of a training step at full scale (no GPU needed)",
                       description="Run forward + backward + optimizer step on fake tensors and report the "
                                   "steady-state device and host peaks by category: simulated at a few layers (and, in "
                                   "chunked engines, a few chunks) and extrapolated along the model's repeating pattern, "
                                   "or with --exact the whole model at the whole length.")
    p.add_argument("--model", required=True, help="preset name or local model directory (only its config is read)")
    p.add_argument("--seq-len", type=_tokens, required=True, help="tokens per sample, e.g. 65536 or 64K")
    p.add_argument("--batch-size", type=int, default=1, help="samples per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (their gradients are alive in later forwards)")
    p.add_argument("--strategy", default="none", help="techniques: none, checkpoint, mst, a comma list with options, a strategy as "
                   "`longtrain plan` prints it (fpdt:chunk=8192:offload,mst), or a strategy .yaml/.json")
    p.add_argument("--engine", default=None, help="gradient engine with options: backprop, fpdt:chunk=8192:offload=true, seco:chunk=4096, spaco, adjoint:truncate=64")
    p.add_argument("--optimizer", default="adamw", choices=_Choices(["adamw", "adamw-16bit", "sgd", "none"],
                                                                    earlier=["adamw-offload"]),
                   help="the optimizer whose state the step holds (adamw: float32 masters and moments for 16-bit "
                   "weights, as train runs it; adamw-16bit: pure 16-bit; none: no optimizer step)")
    p.add_argument("--optimizer-offload", action="store_true", help="AdamW's state and fp32 master weights in host "
                   "memory, gradients streamed there during backward (as train --optimizer-offload)")
    p.add_argument("--sp", type=int, default=1, help="Ulysses sequence parallelism over P ranks: simulate one rank's share "
                   "(its tokens, its heads, 1/P of parameters, gradients and optimizer state)")
    p.add_argument("--gpus", type=int, default=None, help="processes in all (default: --sp): groups of --sp processes "
                   "share a sequence, the groups are data parallel, and FSDP2 shards parameters, gradients and "
                   "optimizer state over every process (--sp 1 --gpus N: FSDP2 data parallel, as the Trainer's)")
    p.add_argument("--layer-groups", type=int, default=1, help="the adjoint engine's layers split over R processes "
                   "(torchrun): simulate the busiest one (its layers, with the embedding and the head)")
    p.add_argument("--dtype", default="bfloat16", help="parameter and activation dtype (default %(default)s)")
    p.add_argument("--lora", action="store_true", help="simulate LoRA training (as train --lora: adapters on every linear "
                   "layer but the head; frozen base weights without gradients or optimizer state)")
    p.add_argument("--lora-rank", type=int, default=8, action=_Given, help="rank of the LoRA adapters with --lora")
    p.add_argument("--4bit", dest="four_bit", action="store_true", help="with --lora: the base held in 4 bits by "
                   "bitsandbytes (NF4, as train --4bit loads it): its linear weights at about half a byte each, each "
                   "dequantized whole for its call")
    p.add_argument("--device-memory", type=_bytes, default=None, help="say whether the step fits a device of this much "
                   "memory (80GiB, 80GB; exit code 1 when it does not)")
    p.add_argument("--host-memory", type=_bytes, default=None, help="host memory the run may use (120GiB): the default "
                   "budget of what the strategy parks in host memory, and whether its host peak fits (exit code 1 when "
                   "it does not); default: unbounded, the host peak reported")
    p.add_argument("--exact", action="store_true", help="simulate every layer at the whole length instead of extrapolating "
                   "from a few layers and chunks (equal figures; minutes to hours at long context instead of seconds)")
    p.add_argument("--fragmentation", action="store_true",
                   help="also plan the step's device memory offline (CP-SAT; needs ortools) and compare the "
                        "planned peak with the allocated one and with an allocator that cannot see the future (implies --exact)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress on stderr")
    p.set_defaults(run=_run_simulate)


def _run_simulate(args) -> int:
    # Values first: a mistake is refused before torch loads.
    if args.seq_len < 2:
        raise LongtrainError(f"--seq-len must be at least 2, got {args.seq_len}")
    if args.batch_size <= 0:
        raise LongtrainError(f"--batch-size must be positive, got {args.batch_size}")
    if args.sp <= 0:
        raise LongtrainError(f"--sp must be a positive integer, got {args.sp}")
    if args.gpus is not None and (args.gpus <= 0 or args.gpus % args.sp):
        raise LongtrainError(f"--gpus must be a positive multiple of --sp ({args.sp}), got {args.gpus}")
    if args.layer_groups <= 0:
        raise LongtrainError(f"--layer-groups must be a positive integer, got {args.layer_groups}")
    if args.grad_accum <= 0:
        raise LongtrainError(f"--grad-accum must be positive, got {args.grad_accum}")
    if args.lora_rank <= 0:
        raise LongtrainError(f"--lora-rank must be positive, got {args.lora_rank}")
    _refuse_rank_without_lora(args)
    if args.four_bit and not args.lora:
        raise LongtrainError("--4bit holds the base in 4 bits, which trains LoRA adapters only: add --lora")
    if args.optimizer == "adamw-offload":  # the earlier spelling of --optimizer-offload, read as it
        print("longtrain simulate: note: --optimizer adamw-offload is now --optimizer-offload", file=sys.stderr)
    elif args.optimizer_offload and args.optimizer != "adamw":
        raise LongtrainError(f"--optimizer-offload keeps AdamW's state in host memory; it needs --optimizer adamw, "
                             f"got --optimizer {args.optimizer}")
    from .plan.progress import SimulationProgress
    from .plan.simulate import simulate
    from .strategy import Strategy

    sharded = args.sp > 1 or (args.gpus or 1) > 1
    strategy = Strategy.parse(args.strategy, engine=args.engine,
                              sequence_parallel={"degree": args.sp, "processes": args.gpus} if sharded else None)
    with SimulationProgress(args.progress) as progress:
        report = simulate(args.model, args.seq_len, batch_size=args.batch_size, strategy=strategy,
                          optimizer="adamw-offload" if args.optimizer_offload else args.optimizer, dtype=args.dtype,
                          grad_accum=args.grad_accum, lora_rank=args.lora_rank if args.lora else None,
                          fragmentation=args.fragmentation, exact=args.exact, progress=progress, device_memory=args.device_memory,
                          host_memory=args.host_memory, layer_groups=args.layer_groups if args.layer_groups > 1 else None,
                          four_bit=args.four_bit)
    fits = None
    if args.device_memory is not None or args.host_memory is not None:
        fits, verdict = report.verdict(args.device_memory, args.host_memory)
    if args.json:
        data = report.to_dict()
        if fits is not None:
            data["verdict"] = {"fits": fits, "line": verdict, "device_memory": args.device_memory,
                               "host_memory": args.host_memory}
        print(json.dumps(data, indent=2))
    else:
        print(report.table())
        if fits is not None:
            print(verdict + " (allocated peaks; the allocator's fragmentation comes on top: longtrain plan adds it)")
    return 0 if fits is not False else 1


def _bytes(text: str) -> int:
    from .memory.units import parse_bytes

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a memory size must be positive, like 80GiB, got {text!r}")
    try:
        value = parse_bytes(text)
    except LongtrainError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a memory size must be positive, got {text!r}")
    return value


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="which exact strategy trains a model at a length on a machine, fastest (no GPU needed)",
                       description="Simulate each candidate strategy that serves the model (checkpointing + MsT, Memo, FPDT "
                                   "with offload at a few chunk sizes; for state-space models the adjoint engine) on fake "
                                   "tensors, add the allocator's measured fragmentation margin, predict step time from the "
                                   "time model at the rates of --rates, and rank what fits.")
    p.add_argument("--model", required=True, help="preset name or local model directory (only its config is read)")
    p.add_argument("--seq-len", type=_tokens, required=True, help="tokens per sample: 300000, 512K, 1M")
    p.add_argument("--device-memory", type=_bytes, required=True, help="memory of one GPU: 80GiB, 141GB")
    p.add_argument("--host-memory", type=_bytes, required=True, help="host memory the run may use: 120GiB")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw-16bit", "sgd", "none"],
                   help="the optimizer whose state the plan counts (adamw: float32 masters and moments for 16-bit "
                   "weights, 12 bytes per parameter, as train runs it; adamw-16bit: pure 16-bit)")
    p.add_argument("--dtype", default="bfloat16", help="parameter and activation dtype (default %(default)s)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs in all, parameters, gradients and optimizer state sharded "
                   "over them (FSDP2); each sequence split over them (Ulysses) unless --sp says fewer (default %(default)s)")
    p.add_argument("--sp", type=int, default=None, help="GPUs that share each sequence (Ulysses; default: --gpus): "
                   "the --gpus / --sp groups are data parallel")
    p.add_argument("--lora", action="store_true", help="plan LoRA training (adapters on every linear layer but the head, as train --lora)")
    p.add_argument("--lora-rank", type=int, default=16, action=_Given, help="LoRA rank with --lora (default %(default)s)")
    p.add_argument("--4bit", dest="four_bit", action="store_true", help="with --lora: plan over a base held in 4 bits "
                   "(bitsandbytes NF4, as train --4bit loads it)")
    p.add_argument("--longest", action="store_true", help="also find the longest context each simulated strategy "
                   "reaches (a search: FPDTOptions over one set of small simulations, the others a few whole-length ones)")
    p.add_argument("--optimizer-offload", action=argparse.BooleanOptionalAction, default=None,
                   help="AdamW's state and fp32 master weights in host memory (--optimizer-offload), on the device "
                   "(--no-optimizer-offload); default: both weighed")
    p.add_argument("--exhaustive", action="store_true", help="simulate every candidate, not only those predicted faster "
                   "than the fastest that fits")
    p.add_argument("--engine", default=None, help="weigh only this engine's variants (e.g. adjoint, fpdt); default: every engine's")
    p.add_argument("--with", dest="carried", default="", metavar="TECHNIQUES", help="techniques every candidate "
                   "carries where its engine takes them, comma-separated (e.g. liger, as --strategy auto plans on a "
                   "GPU with liger-kernel: its fused kernels cost no memory and save time)")
    p.add_argument("--rates", default="h100", help="the time model's rates: h100 (default) or h200, built in and fitted "
                   "to the steps measured on each card, or a device name or JSON file written by `longtrain calibrate`")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="candidates simulated at once, a process each (default: one per core, at most 4: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run_plan)


def _refuse_rank_without_lora(args) -> None:
    """``--lora-rank`` without ``--lora`` would simulate or plan full fine-tuning without a word."""
    if "lora_rank" in getattr(args, "given", ()) and not args.lora:
        raise LongtrainError("--lora-rank has no effect without --lora; add --lora (or drop --lora-rank)")


def _run_plan(args) -> int:
    # Options that are no part of the request, first: a mistake is refused before torch loads.
    # (PlanRequest checks the rest, each field in one line.)
    progress = None if args.json else (lambda line: print(f"  {line} ...", file=sys.stderr, flush=True))
    from .train.config import DTYPES, ENGINES, known_names

    for flag, value in (("--lora-rank", args.lora_rank), ("--jobs", args.jobs), ("--gpus", args.gpus), ("--sp", 1 if args.sp is None else args.sp)):
        if value < 1:
            raise LongtrainError(f"{flag} must be a positive count, got {value}")
    if args.dtype.lower() not in DTYPES:
        raise LongtrainError(f"unknown dtype {args.dtype!r}; choose one of {', '.join(DTYPES)}")
    if args.engine is not None and args.engine.split(":")[0] not in known_names("engines", ENGINES):
        raise LongtrainError(f"unknown engine {args.engine!r}; choose one of {', '.join(sorted(known_names('engines', ENGINES)))}")
    _refuse_rank_without_lora(args)
    from .plan import workers

    workers.start_early(args.jobs)  # their imports overlap this process's
    try:
        return _plan_with(args, progress)
    finally:
        workers.discard()


def _plan_with(args, progress) -> int:
    from .plan.calibrate import load
    from .plan.planner import PlanRequest, plan

    request = PlanRequest(args.model, args.seq_len, device_memory=args.device_memory, host_memory=args.host_memory,
                          optimizer=args.optimizer, dtype=args.dtype, rates=load(args.rates), rates_name=args.rates,
                          gpus=args.gpus, sp=args.sp, lora_rank=args.lora_rank if args.lora else None,
                          four_bit=args.four_bit,
                          optimizer_offload=args.optimizer_offload, engine=args.engine, longest=args.longest,
                          exhaustive=args.exhaustive,
                          carried=tuple(name.strip() for name in args.carried.split(",") if name.strip()))
    result = plan(request, workers=args.jobs, progress=progress)
    print(result.to_json() if args.json else result.table())
    return 0 if result.best is not None else 1


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure the planner's rates (matmul, attention, copies, CPU AdamW) on this machine",
                       description="Time a GEMM, causal attention, pinned host copies and the CPU's fused AdamW (seconds), "
                                   "and store the rates under the device's name for `longtrain plan --rates NAME`.")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--quick", action="store_true", help="smaller shapes (a smoke test; rates less exact)")
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args) -> int:
    _prefer_expandable_segments()  # its rates are the ones train then runs with
    import torch

    from .plan.calibrate import device_name, measure, save

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cuda", "cpu") or (name == "cuda" and not torch.cuda.is_available()):
        raise LongtrainError(f"--device must be cuda (on a machine with a GPU) or cpu, got {args.device!r}")
    device = torch.device(name)
    rates, kept = measure(device, quick=args.quick, say=lambda line: print(f"  timing {line} ...", file=sys.stderr, flush=True))
    path = save(rates, device_name(device), unmeasured=kept)
    for field, value in rates.__dict__.items():
        print(f"{field:<22} {value:.3g}" + ("   (the card's built-in table: not measured here)" if field in kept else ""))
    print(f"stored in {path}; plan with it: longtrain plan ... --rates {device_name(device)}")
    return 0


def _add_presets(sub) -> None:
    p = sub.add_parser("presets", help="list model presets")
    p.set_defaults(run=_run_presets)


def _run_presets(args) -> int:
    from .models.presets import preset_fields, preset_names

    for name in preset_names():
        model_type, f = preset_fields(name)  # the table itself: no config objects, no transformers
        print(f"{name:<16} {model_type:<12} layers {f['num_hidden_layers']:>3}  hidden {f['hidden_size']:>5}  vocab {f['vocab_size']:>6}")
    return 0


def _add_families(sub) -> None:
    p = sub.add_parser("families", help="check which model families train exactly on the installed transformers",
                       description="Build every decoder-only causal-LM family of the installed transformers tiny (float64) "
                                   "and compare one step of every engine and technique with stock autograd; write the "
                                   "table (markdown and JSON). One family at a time, each in a child process of its own "
                                   "whose memory --memory-limit bounds: a family that needs more is reported as not built "
                                   "(exceeded the memory limit), and the next one runs.")
    p.add_argument("families", nargs="*", help="model types to check (default: every decoder-only causal-LM family)")
    p.add_argument("--out", default="families.md", help="the markdown table, its .json beside it (default: %(default)s "
                   "in the current directory; the project's own table: --out docs/results/families.md)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one family's check may take (default: %(default)g)")
    p.add_argument("--memory-limit", type=_bytes, default=4 * 2**30, metavar="SIZE",
                   help="the memory one family's check may use: its child process's address space (RLIMIT_AS), so "
                   "its resident memory too: 4GiB (default), 8GiB")
    p.add_argument("--update", action="store_true", help="re-check the named families and keep the table's other rows")
    p.set_defaults(run=_run_families)


def _run_families(args) -> int:
    from .families.command import run

    return run(args)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="long-context accuracy of a trained model: pass key by length, needle by length x depth",
                       description="Evaluate a causal LM on the built-in pass-key task at several lengths and on a "
                                   "needle-in-a-haystack variant (one needle at each relative depth), on held-out samples; "
                                   "write eval.json (every cell) and eval.png (a heat map) and print a table (docs/eval.md).")
    p.add_argument("--model", required=True, help="a model directory (a run's final/) or a preset (random weights; demo: "
                   "the small pretrained model longtrain ships)")
    p.add_argument("--lengths", default=None, help="context lengths in tokens, e.g. 2K,4K,8K (default: those of 2K,4K,8K "
                   "within the model's max_position_embeddings)")
    p.add_argument("--depths", default=None, help="needle depths in [0, 1]: 0 the start of the context, "
                   "1 just before the question (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--samples", type=int, default=16, help="held-out samples per cell")
    p.add_argument("--task", default="both", choices=["passkey", "needle", "both"], help="passkey: needles at random points "
                   "(as train evaluates); needle: one needle at each depth; both")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples (and of a preset's random weights)")
    p.add_argument("--out", default=None, help="directory for eval.json and eval.png, never one holding an earlier evaluation "
                   "(default: a new eval-DATE-TIME in the run directory of a run's final/, else under runs/)")
    p.add_argument("--tokenizer", default="auto", help="auto: the model directory's own (presets: bytes); bytes: the byte "
                   "tokenizer; or a tokenizer directory")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (not given: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--extend-context", action="store_true", help="allow lengths beyond the model's max_position_embeddings")
    p.add_argument("--json", action="store_true", help="print the evaluation as JSON instead of the table")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no line per finished cell on stderr")
    p.set_defaults(run=_run_eval)


def _run_eval(args) -> int:
    from .train.eval_config import EvalConfig, check_eval_config, parse_depths, parse_lengths

    # Values, the model directory and --out first: a mistake is refused before torch loads.
    config = EvalConfig(model=args.model, lengths=None if args.lengths is None else parse_lengths(args.lengths),
                        depths=parse_depths(args.depths, args.task), samples=args.samples, task=args.task, seed=args.seed,
                        out=args.out, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                        extend_context=args.extend_context, progress=args.progress)
    check_eval_config(config)
    _prefer_expandable_segments()
    from .train.evaluate import format_table, run_eval

    document = run_eval(config)
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(format_table(document["cells"]))
        written = [name for name in ("eval.json", "eval.png") if os.path.exists(os.path.join(document["out"], name))]
        print(f"longtrain eval: {', '.join(written)} in {document['out']}")
    return 0


class _TopParser(_Parser):
    """The ``longtrain`` parser: a command line that starts with an option (a forgotten
    command) or holds none is told which commands there are; an option's value that
    starts with '-' (``--device-memory -5GiB``, ``--lr -1e-3``) is read as its value,
    as ``--device-memory=-5GiB`` is, and checked as one."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        commands = ", ".join(self._commands())
        if not args:
            self.error(f"a command is missing; write longtrain COMMAND [options], COMMAND one of: {commands}")
        if args[0].startswith("-") and args[0] not in ("-h", "--help"):
            self.error(f"a command is missing before {args[0]!r}; write longtrain COMMAND {args[0]} ..., "
                       f"COMMAND one of: {commands}")
        return super().parse_known_args(_joined_values(self, args), namespace)

    def _commands(self) -> list[str]:
        return [name for action in self._actions if isinstance(action, argparse._SubParsersAction)
                for name in action.choices]


_DASH_VALUE = re.compile(r"-\.?[0-9]")  # "-5GiB", "-1e-3", "-.5": a value, not an option


def _joined_values(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` with each option that takes one value and is followed by a value starting
    with '-' and a digit written as ``--option=value`` (argparse would take that value for
    an option and report "expected one argument")."""
    takes_value = set()
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.nargs is None:
                takes_value.update(s for s in action.option_strings if s.startswith("--"))
    out, i = [], 0
    while i < len(args):
        if args[i] in takes_value and i + 1 < len(args) and _DASH_VALUE.match(args[i + 1]):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(prog="longtrain", description="Long-context training with bounded memory and exact gradients.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train(sub)
    _add_simulate(sub)
    _add_plan(sub)
    _add_calibrate(sub)
    _add_presets(sub)
    _add_families(sub)
    _add_eval(sub)
    return parser


def _quiet_third_party() -> None:
    """Keep the command's output longtrain's own: transformers' and the Hub's progress
    bars ("Loading checkpoint shards", "Writing model shards") and their advisory log
    lines and warnings would interleave with the progress bar and the summary. Set
    through the environment, read when they are imported; a user's own settings win."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # its fork warning
    warnings.filterwarnings("ignore", module=r"(transformers|peft|huggingface_hub|accelerate)(\.|$)")
    if "transformers" in sys.modules:  # imported already (main() called in-process): the environment is read
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def _leave_process_group(code: int) -> None:
    """Under torchrun a rank leaves at once, failed or done (see parallel.distributed.exit_process)."""
    if "longtrain.parallel.distributed" not in sys.modules:  # no process group was joined: nothing to leave
        return
    from .parallel.distributed import exit_process, joined

    if joined():
        exit_process(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_third_party()
    try:
        code = args.run(args)
        _leave_process_group(code)
        return code
    except LongtrainError as exc:
        print(f"longtrain: error: {exc}", file=sys.stderr)
        _leave_process_group(2)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: its reader is gone, nothing to report
        sys.stdout = open(os.devnull, "w")
        return 0
    except KeyboardInterrupt:
        print("longtrain: interrupted; to continue, run the same command with --resume (from the last checkpoint, "
              "or from step 0 if none was written)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
