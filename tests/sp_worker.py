"""Run under ``torchrun --nproc-per-node R``: UlyssesOptions sequence parallelism (degree P) with
FSDP2 over R gloo processes against one process of stock Hugging Face autograd, in
float64. Every case builds the stock model and ours with the same weights on every rank;
the stock model steps on the whole batch (every data-parallel group's micro-batches
together) in this process; ours steps with the strategy, and its sharded gradients are
gathered whole. Rank 0 writes the largest relative errors per case as JSON. Used by
tests/test_sequence_parallel.py."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from conftest import computes_in_float64, packed_batch, padded_batch, randomize_lora, stock_and_ours, stock_loss
from transformers import AutoConfig

import longtrain as lt
from longtrain.families import float64_throughout


def config(kind: str):
    """Tiny configs that stress the head split: ``gqa2`` (4 heads, 2 K/V heads: with 4 ranks
    each K/V head goes to two ranks), ``uneven`` (10 heads in groups of 5 over 2 K/V heads:
    4 ranks hold 3, 3, 2, 2 heads, and rank 1's three read K/V heads 0, 0 and 1 — no even
    grouping, so its K/V heads are repeated per query head), ``mha3`` (3 heads: 2 ranks
    hold 2 and 1)."""
    base = dict(vocab_size=320, intermediate_size=176, num_hidden_layers=2, max_position_embeddings=4096,
                rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama-gqa2":
        return AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **base)
    if kind == "qwen2-uneven":
        return AutoConfig.for_model("qwen2", hidden_size=160, num_attention_heads=10, num_key_value_heads=2, **base)
    if kind == "mistral-mha3":
        return AutoConfig.for_model("mistral", hidden_size=48, num_attention_heads=3, num_key_value_heads=3,
                                    sliding_window=None, **base)
    if kind == "qwen3-moe":  # 4 experts, 2 per token, with the router's load-balancing loss
        moe = AutoConfig.for_model("qwen3_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                   output_router_logits=True, router_aux_loss_coef=0.02, **base)
        moe._experts_implementation = "eager"  # experts one by one: the grouped-matmul kernels take no float64
        return moe
    if kind in ("gemma2", "gpt-oss"):  # gpt-oss: a sink per head, each rank its heads'; its balancing loss on
        from longtrain.models.presets import preset_config

        tiny = preset_config(f"tiny-{kind}")
        if kind == "gpt-oss":
            tiny.output_router_logits, tiny.router_aux_loss_coef = True, 0.02
            tiny._experts_implementation = "eager"
        return tiny
    raise ValueError(kind)


def batches(kind: str, dp_rank: int, dp: int) -> list[dict]:
    """Two micro-batches per data-parallel group (accumulated), each different."""
    out = []
    for micro in range(2):
        seed = 10 * micro + dp_rank + 1
        if kind == "packed":
            out.append(packed_batch(320, documents=((40, 35, 26), (60, 41)), seed=seed))
        else:  # right padding, labels on the padding of one row; length 101 divides no degree
            batch = padded_batch(320, lengths=(101, 77), seed=seed, labels_on_pads=micro == 1)
            out.append(batch)
    return out


def strategy(name: str, degree: int) -> lt.Strategy:
    compute = None
    name = name.removesuffix("/bf16-params")  # (run_case puts the parameters in bf16)
    if name.endswith("/bf16"):  # FSDP2 mixed precision: the float64 parameters compute in bfloat16
        name, compute = name[:-len("/bf16")], "bfloat16"
    engines = {
        "backprop": ("backprop", None, {}),
        "checkpoint+mst": ("backprop", None, {"checkpoint": True, "mst": lt.MsTOptions(loss_chunks=3)}),
        "fpdt+offload+mst": ("fpdt", {"chunk": 16, "offload": True, "prefetch": 2}, {"mst": True}),
        "fpdt64+offload+mst": ("fpdt", {"chunk": 64, "offload": True, "prefetch": 2}, {"mst": True}),
        "seco+checkpoint": ("seco", {"chunk": 13}, {"checkpoint": True}),
    }
    engine, options, techniques = engines[name]
    return lt.Strategy(engine=engine, engine_options=options, sequence_parallel={"degree": degree, "compute_dtype": compute},
                       **techniques)


def run_case(model_kind: str, batch_kind: str, engine: str, degree: int, lora: bool) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, dp_rank = world // degree, rank // degree
    stock, ours = stock_and_ours(config(model_kind))
    if lora:
        from longtrain.models.loading import add_lora

        stock, ours = add_lora(stock, rank=4), add_lora(ours, rank=4)
        randomize_lora(stock)
        ours.load_state_dict(stock.state_dict())
    if engine.endswith("/bf16-params"):  # bf16 parameters, sharded as they are: FPDTOptions sums their chunk gradients in float32
        ours.to(torch.bfloat16)
    every = [b for g in range(dp) for b in batches(batch_kind, g, dp)]
    mine = batches(batch_kind, dp_rank, dp)
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in every)
    # A mixture of experts' balancing loss sums in float32 unless .float() keeps float64 too.
    precision = float64_throughout() if getattr(stock.config, "output_router_logits", False) else computes_in_float64()
    with precision:
        ref = sum(_stock_term(stock, b, total) for b in every)
        ref.backward()
        lt.apply(ours, strategy(engine, degree))
        loss = sum(lt.step(ours, b, num_label_tokens=total) for b in mine)
    ref = ref.detach()
    errors = {"loss": abs(float(loss) - float(ref)) / abs(float(ref))}
    reference = {n: p.grad for n, p in stock.named_parameters() if p.grad is not None}
    worst = 0.0
    for name, p in ours.named_parameters():
        grad = None if p.grad is None else p.grad.full_tensor()  # a collective: every rank, same order
        if name in reference:
            worst = max(worst, float((grad - reference[name]).norm() / reference[name].norm()))
        elif grad is not None and float(grad.abs().max()) > 0:
            worst = float("inf")  # a gradient the stock model does not have
    errors["grads"] = worst
    errors["every_rank_same_loss"] = _same_everywhere(float(loss))
    return errors


def _stock_term(stock, batch: dict, total: int) -> torch.Tensor:
    """One micro-batch's part of the accumulated stock loss: its token losses over the step's
    label count, plus the routers' load-balancing loss of the micro-batch where the model adds it."""
    term = stock_loss(stock, batch) * int((batch["labels"][:, 1:] != -100).sum()) / total
    if getattr(stock.config, "output_router_logits", False):
        out = stock(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    position_ids=batch.get("position_ids"), use_cache=False)
        term = term + stock.config.router_aux_loss_coef * out.aux_loss
    return term


def _same_everywhere(value: float) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return len(set(values)) == 1


def failures(mode: str) -> None:
    """``die``: rank 1 exits before the step, rank 0 waits in its collectives until the
    timeout. ``mismatch``: the ranks read different batches."""
    _, ours = stock_and_ours(config("llama-gqa2"))
    lt.apply(ours, strategy("backprop", dist.get_world_size()))
    batch = padded_batch(320, lengths=(101, 77))
    if mode == "die" and dist.get_rank() == 1:
        sys.exit(3)
    if mode == "mismatch" and dist.get_rank() == 1:
        batch = padded_batch(320, lengths=(90, 77))
    lt.step(ours, batch)


def measure(length: int, engine: str) -> dict:
    """This rank's exact CPU peak of a training step (AdamW) after the first, as the simulator
    counts it: the lowest of three steps' peaks; and the worker threads of the two gloo
    groups the step communicates over (FSDP2's mesh, the Ulysses group). A gloo worker
    thread drops the collective it ran (its input and output tensors) a moment after
    ``wait()`` returns, so a peak may count finished collectives' buffers: at most one per
    worker thread (the test bounds them with these counts)."""
    from longtrain.memory import MemoryTracker
    from longtrain.models.loading import build_from_config
    from longtrain.models.presets import preset_config
    from longtrain.optimizers import make_optimizer

    torch.manual_seed(0)
    model = lt.apply(build_from_config(preset_config("tiny-llama"), torch.float32), strategy(engine, dist.get_world_size()))
    optimizer = make_optimizer("adamw", model.parameters(), lr=1e-4)
    ids = torch.randint(0, 320, (1, length), generator=torch.Generator().manual_seed(0))
    steady = []
    with MemoryTracker(model, optimizer) as tracker:
        for it in range(4):
            if it >= 1:
                tracker.reset_peak()
            lt.step(model, {"input_ids": ids}, num_label_tokens=length - 1)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if it >= 1:
                steady.append(tracker.report().peak_device_bytes)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, min(steady))
    from longtrain.parallel.fsdp import world_mesh
    from longtrain.strategy import applied_context

    groups = {"fsdp2": world_mesh("cpu").get_group(), "ulysses": applied_context(model).sequence_parallel.comm.group}
    return {"peaks": peaks, "gloo_threads": {name: _gloo_threads(group) for name, group in groups.items()}}


def _gloo_threads(group) -> int:
    """The worker threads of a gloo process group (``ProcessGroupGloo::runLoop``: each runs
    one collective at a time and releases it, inputs and outputs, only after marking it done)."""
    return group._get_backend(torch.device("cpu")).options._threads


def main(out: str, cases: str) -> None:
    from longtrain.parallel.distributed import init_from_env

    init_from_env()  # gloo, with the collective timeout of LONGTRAIN_COLLECTIVE_TIMEOUT
    if cases.startswith("measure:"):  # measure:LENGTH:ENGINE;...: each rank's peaks by "LENGTH:ENGINE"
        result = {}
        for spec in cases.split(";"):
            _, length, engine = spec.split(":")
            result[f"{length}:{engine}"] = measure(int(length), engine)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        _leave()
    if cases in ("die", "mismatch"):
        try:
            failures(cases)
        except lt.LongtrainError as error:  # as the command line ends
            from longtrain.parallel.distributed import exit_process

            print(f"longtrain: error: {error}", file=sys.stderr)
            exit_process(2)
        return
    results = {}
    for case in cases.split(";"):
        model_kind, batch_kind, engine, degree, lora = case.split(",")
        results[case] = run_case(model_kind, batch_kind, engine, int(degree), lora == "lora")
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    _leave()


def _leave() -> None:
    """Tear down, then skip interpreter finalization as the command line does: once in CI
    a rank aborted at exit ("terminate called without an active exception") after its work
    was done (gloo's threads can hold a collective's work object, pytorch/pytorch#179291)."""
    from longtrain.parallel.distributed import exit_process

    dist.barrier()  # nobody tears down a connection a peer still uses
    dist.destroy_process_group()
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
