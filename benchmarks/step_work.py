"""The work one training step does under each strategy, counted on the CPU.

Matmul FLOPs (relative to plain backprop), attention kernel calls and aten operations
dispatched, for one step of a Llama shaped like Llama-3-8B at reduced width (I/d = 3.5,
V/d = 32, 4:1 grouped K/V). Counts do not depend on the device: they are what a GPU runs
too, so a strategy that recomputes more than its design says shows here first. Operations
per step stand for the host's launch work (each is a kernel launch or a view on CUDA).

Writes docs/results/step_work.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

import longtrain as lt
from longtrain.models.loading import build_from_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_report  # noqa: E402

_MATMULS = {"mm": -2, "addmm": -2, "addmm_": -2, "bmm": -2, "baddbmm": -2}  # the left operand's position from the end (addmm_: a sum formed in place)


class StepWork(TorchDispatchMode):
    """Counts matmul FLOPs, attention kernel calls and every aten operation."""

    def __init__(self):
        super().__init__()
        self.matmul_flops = 0
        self.attention = collections.Counter()
        self.operations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.operations += 1
        if name in _MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            left, right = tensors[-2], tensors[-1]
            self.matmul_flops += 2 * left.numel() * right.shape[-1]
        if "attention" in name:
            self.attention["backward" if "backward" in name else "forward"] += 1
        return func(*args, **(kwargs or {}))


def llama_config(layers: int = 4, width: int = 256) -> LlamaConfig:
    return LlamaConfig(hidden_size=width, intermediate_size=width * 7 // 2, num_attention_heads=8, num_key_value_heads=2,
                       num_hidden_layers=layers, vocab_size=width * 32, max_position_embeddings=1 << 20)


def count_step(config, strategy: lt.Strategy | None, tokens: int, seed: int = 0) -> StepWork:
    """What the second step of ``strategy`` on ``tokens`` random tokens dispatches (the
    first builds what a step builds once)."""
    torch.manual_seed(seed)
    model = build_from_config(config, torch.float32)
    if strategy is not None:
        lt.apply(model, strategy)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (1, tokens))}
    lt.step(model, batch)
    model.zero_grad(set_to_none=True)
    with StepWork() as work:
        lt.step(model, batch)
    return work


def strategies(chunk: int) -> dict[str, lt.Strategy]:
    fpdt = {"chunk": chunk}
    return {
        "backprop": lt.Strategy(),
        "mst": lt.Strategy(mst=True),
        "checkpoint (attention recomputed)": lt.Strategy(checkpoint={"keep_attention": False}),
        "checkpoint": lt.Strategy(checkpoint=True),
        "checkpoint,mst": lt.Strategy(checkpoint=True, mst=True),
        "checkpoint:offload_inputs,mst": lt.Strategy(checkpoint={"offload_inputs": True}, mst=True),
        "memo,mst (alpha 1)": lt.Strategy(memo=lt.MemoOptions(alpha=1.0), mst=True),
        "fpdt,mst": lt.Strategy(engine="fpdt", engine_options=fpdt, mst=True),
        "fpdt:recompute_kv=false,mst": lt.Strategy(engine="fpdt", engine_options={**fpdt, "recompute_kv": False}, mst=True),
        "fpdt:keep_output,mst": lt.Strategy(engine="fpdt", engine_options={**fpdt, "keep_output": True}, mst=True),
        "seco,mst": lt.Strategy(engine="seco", engine_options=fpdt, mst=True),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None, help="folder for the reports (default: docs/results/)")
    args = parser.parse_args(argv)
    config = llama_config(args.layers, args.width)
    base = count_step(config, None, args.tokens).matmul_flops
    rows = []
    for name, strategy in strategies(args.chunk).items():
        work = count_step(config, strategy, args.tokens)
        rows.append({"strategy": name, "matmul_vs_backprop": round(work.matmul_flops / base, 3),
                     "attention_forward_calls": work.attention["forward"],
                     "attention_backward_calls": work.attention["backward"], "aten_operations": work.operations})
        print(f"{name}: {rows[-1]['matmul_vs_backprop']}x", flush=True)
    command = "python benchmarks/step_work.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    notes = f"""One training step (forward + backward) of a {args.layers}-layer Llama with Llama-3-8B's
ratios at width {args.width} ({config.intermediate_size} intermediate, vocabulary {config.vocab_size},
8 query / 2 K/V heads), {args.tokens} tokens, float32 on the CPU; chunked engines at
{args.chunk}-token chunks. Matmul FLOPs are relative to plain backprop's (which recomputes
nothing): what each strategy's recomputation costs in matmuls, counted; MsT recomputes the
MLP in its tiled backward (its chunked head forms its gradients with its logits, once), SeCO
forms a chunk's logits twice. At this width the head is 38% of the matmul parameters (Llama-3-8B:
7%), so the head weighs five times more in each ratio than in Llama-3-8B. Attention kernel calls
count blocks (the chunked engines call one per block of the causal triangle); aten operations
are everything dispatched, views included — a proxy for host launch work, which grows with
the number of chunks."""
    write_report("step_work", "Work per training step, counted", [
        ("strategy", "strategy"), ("matmul_vs_backprop", "matmul FLOPs (× backprop)"),
        ("attention_forward_calls", "attention forward calls"), ("attention_backward_calls", "attention backward calls"),
        ("aten_operations", "aten operations")], rows, notes, command, out_dir=args.out)


if __name__ == "__main__":
    main()
