"""Step time, MFU and memory of longtrain's strategies beside the peers users would pick.

One GPU, bf16 weights and gradients, batch 1, random token ids, forward + backward per
step, no optimizer step (gradients freed between steps), as docs/speed.md describes.
Cases, side by side in one run:

- ``hf``: stock Hugging Face, SDPA attention, non-reentrant gradient checkpointing,
  the loss from ``labels``;
- ``hf+offload``: the same with the forward under ``torch.autograd.graph.save_on_cpu``
  (checkpointed layer inputs in pinned host memory);
- ``hf+liger`` / ``hf+liger+offload``: the same plus Liger's kernels (rope, swiglu,
  rms_norm, fused linear cross-entropy), where ``liger-kernel`` is installed (the
  optional ``liger`` extra); skipped with a note otherwise;
- the peers experts run, each with and without Liger: ``hf+sac`` (selective activation
  checkpointing keeping SDPA's outputs, torchtitan's default: attention is not
  recomputed), ``hf+top`` (the top layers ``--strategy auto`` leaves whole are not
  checkpointed: the same memory), ``hf+trl-offload`` (TRL's stream-overlapped activation
  offloading in place of ``save_on_cpu``; it needs an accelerator: refused on a CPU),
  ``hf+alst`` (DeepSpeed's ALST recipe, arXiv 2506.13996, on one GPU: every MLP through
  ``TiledMLP``, the LM head + loss through ``TiledFusedLogitsLoss`` — with Liger, Liger's
  fused linear cross-entropy, its SwiGLU off —, the checkpointed layer inputs offloaded to
  pinned host memory by DeepSpeed's offloader of them; it needs the optional
  ``pip install deepspeed``: refused without it);
- ``lt:...``: longtrain's strategies (backprop with checkpoint + MsT, attention kept
  — ``lt:recompute+mst`` reruns it as stock checkpointing does — and ``+liger`` with
  Liger's fused norm/activation/rotary kernels; ``lt:checkpoint+offload+mst+liger`` with
  the checkpointed inputs in host memory as well; FPDT with and without offload and kept
  attention outputs; Memo; SeCO; the offloading cases with three quarters of the host as
  their budget);
- ``lt:auto``: what ``longtrain train --strategy auto`` runs on this device — the
  planner's fastest fitting strategy for its memory (at short and medium lengths
  ``checkpoint:except_last=N,mst``, the top N layers left whole) plus Liger; the notes
  column names the choice.

Lengths run from short to long; a case that runs out of memory (or time) at one length
is not tried at the longer ones, so one sweep gives the longest length each case fits
(16K to 512K). Each case runs in its own process by default (``--isolate``): Liger
patches Hugging Face's Llama classes process-wide, the allocator's fragmentation and the
host's resident memory would otherwise carry over, and the allocator setting can differ
per case. ``--append`` merges with the JSON already in the output folder, so a sweep can
be split into several commands (one per length group, each within 10 minutes) that build
one report.

Per case: ``--warmup`` steps at the length (default 1; the last records the attention
operators it dispatched, with how often: a forward kernel run twice per layer is attention
recomputed — not Memo's first step, which it times to choose α), then ``--repeats`` timed steps (default 3; CUDA events), every one stored with the
SM clock and power after it; ``--rounds R`` runs every case R times per length, the order
reversed each round (interleaved: drift falls on every case alike), pooling their steps.
The median, its spread ((slowest − fastest) / median), tokens/s; MFU = (6·s·P + 6·n·h·s²)
/ time / peak (dense bf16: 989 TFLOP/s on H100/H200); the allocator's peak allocated and
reserved bytes of the timed steps and their ratio; the process's peak resident host memory
during the timed steps (sampled every 10 ms); longtrain's pinned pool; the allocator setting
(``--expandable-segments all``, the default: the same for every case); for longtrain, the
attention kernel of its blocks (``--attention-kernel`` forces one); cuDNN's and torch's
versions. ``--device-memory 79.1GiB`` caps every case's allocator (its per-process fraction of
the device): an H100 80 GB's memory (what CUDA reports of it) on an H200, said in every row
and the report; ``× best peer`` then compares rows under the same cap. Every row names its
device; ``--append`` refuses a folder whose rows another device measured. Writes
docs/results/gpu_peers.json, .md and a tokens/s-vs-length PNG on a zero-based axis.

    python benchmarks/gpu_peers.py                        # Llama-3-8B at 16K and 32K, every case
    python benchmarks/gpu_peers.py --lengths 128K --device-memory 79.1GiB --cases hf+liger+sac,lt:auto --append
    python benchmarks/gpu_peers.py --lengths 64K --append
    python benchmarks/gpu_peers.py --lengths 128K,256K,512K --append --cases hf+liger+offload,lt:fpdt+offload+keep+mst
    python benchmarks/gpu_peers.py --smoke                # tiny model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # the source tree, installed or not
from _report import DOCS, write_report  # noqa: E402

import longtrain as lt  # noqa: E402
from longtrain.memory.allocator import allocator_setting  # noqa: E402
from longtrain.memory.units import (
    parse_tokens,  # noqa: E402
    physical_memory,  # noqa: E402
)
from longtrain.models.flops import device_peak_flops, model_flops_per_sample  # noqa: E402
from longtrain.models.loading import build_from_config, default_dtype  # noqa: E402
from longtrain.models.presets import preset_config  # noqa: E402
from longtrain.strategy import applied_context, pinned_host_bytes  # noqa: E402

GIB = 2**30
ROW_TAG = "GPU_PEERS_ROW "  # how an isolated case hands its row to the parent
SHORT_WARMUP = 2048  # tokens of the short step that then takes the one-time costs
STARTED = time.perf_counter()  # the time budget counts from here (imports included)
COMMAND_LIMIT_S = 590  # no case may run past this many seconds of the whole command (10-minute calls)
ALST_LOGITS_SHARD = GIB  # hf+alst's loss shards: about this many bytes of fp32 logits each, as ALST sizes them


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "peer", "longtrain" or "auto" (longtrain, as --strategy auto plans it on this device)
    make: Callable | None  # peer: (config, device, dtype) -> (model, step); longtrain: (length) -> Strategy


_LIGER_PROBLEM: list[str] = []  # why liger-kernel cannot be used here, once known


def _liger():
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401

        return apply_liger_kernel_to_llama
    except Exception as error:  # noqa: BLE001 - not installed, or it does not import with this transformers
        if not _LIGER_PROBLEM:
            _LIGER_PROBLEM.append("not installed: pip install liger-kernel" if isinstance(error, ModuleNotFoundError)
                                  else f"it does not import here: {type(error).__name__}: {str(error)[:120]}")
        return None


# SDPA's fused kernels: what selective activation checkpointing keeps (their outputs), as
# torchtitan's default policy does, so that backward recomputes the layer but not attention.
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def _keep_attention_policy():
    """A ``context_fn`` for torch.utils.checkpoint: save SDPA's outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = {getattr(torch.ops.aten, name).default for name in _ATTENTION_OPS if hasattr(torch.ops.aten, name)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


def _top_layers_whole(config, length: int, device, dtype, layers: int) -> int:
    """How many top layers ``longtrain train --strategy auto`` leaves unchecked on this device
    at this length: N of ``checkpoint:except_last=N``, every layer where it checkpoints none
    (plain backprop fits), none where it runs another engine."""
    from longtrain.plan.auto import auto_strategy

    strategy = auto_strategy(config, length, device, dtype=str(dtype).replace("torch.", ""), optimizer="none",
                             say=lambda line: None)
    options = strategy.techniques.get("checkpoint")
    if options is None:
        return layers if strategy.engine == "backprop" else 0
    return int(getattr(options, "except_last", 0) or 0)


def _hf_peer(liger: bool, offload: str | None = None, keep_attention: bool = False, top_whole: bool = False):
    """Stock Hugging Face with non-reentrant checkpointing: ``offload`` ``"save_on_cpu"``
    (synchronous, pinned) or ``"trl"`` (TRL's stream-overlapped activation offloading);
    ``keep_attention``: selective checkpointing keeping SDPA's outputs; ``top_whole``: the
    top layers auto leaves whole are not checkpointed."""
    def make(config, device, dtype, length):
        from transformers import AutoModelForCausalLM

        if liger:
            _liger()(rope=True, swiglu=True, rms_norm=True, fused_linear_cross_entropy=True, cross_entropy=False)
        with torch.device(device), default_dtype(dtype):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        kwargs = {"use_reentrant": False, **({"context_fn": _keep_attention_policy()} if keep_attention else {})}
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        notes = []
        if top_whole:
            layers = model.model.layers
            whole = _top_layers_whole(config, length, device, dtype, len(layers))
            for layer in layers[len(layers) - whole:] if whole else []:
                layer.gradient_checkpointing = False
            notes.append(f"top {whole} of {len(layers)} layers unchecked (auto's except_last)")
        model.config.use_cache = False
        model.train()
        saving = None
        if offload == "trl":
            if device.type == "cpu":  # reported as refused, as a limit is
                raise lt.LongtrainError("TRL's activation offloading moves activations from an accelerator to host "
                                        "memory; this device is the host")
            from trl.models.activation_offloading import get_act_offloading_ctx_manager

            saving = get_act_offloading_ctx_manager(model, use_pin_memory=device.type == "cuda",
                                                    use_streams=device.type == "cuda", warn_if_no_head=False)

        def step(ids):
            if offload == "save_on_cpu":
                context = torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
            else:
                context = saving if saving is not None else contextlib.nullcontext()
            with context:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()

        step.notes = "; ".join(notes) or None
        return model, step

    return make


def _deepspeed_alst():
    """DeepSpeed's ALST pieces (its version, ``TiledMLP``, ``TiledFusedLogitsLoss``, the
    offloader of checkpointed layer inputs). deepspeed is optional: without them the case
    is refused, in one line that says what to install."""
    try:
        import deepspeed
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            get_checkpoint_hidden_states_offloading_ctx_manager as offloading,
        )
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    except ModuleNotFoundError as error:
        if error.name == "deepspeed":
            raise lt.LongtrainError("DeepSpeed is not installed (ALST's tiled MLP, loss and checkpoint offload): "
                                    "pip install deepspeed") from None
        raise lt.LongtrainError(f"this deepspeed lacks ALST's pieces ({error}): pip install -U deepspeed") from None
    except Exception as error:  # noqa: BLE001 - an older deepspeed (no TiledFusedLogitsLoss), or one that does not import here
        raise lt.LongtrainError(f"deepspeed does not serve ALST here ({type(error).__name__}: {str(error)[:80]}): "
                                "pip install -U deepspeed") from None
    return deepspeed.__version__, TiledMLP, TiledFusedLogitsLoss, offloading


def _tile_mlps(model, tiled_mlp) -> None:
    """Each decoder layer's MLP through DeepSpeed's ``TiledMLP``: its own forward on shards of
    the sequence, ALST's count ``ceil(s / hidden_size)``, recomputed shard by shard in
    backward, so one shard's intermediate activations are live at a time, not the sequence's."""
    for layer in model.model.layers:
        mlp = layer.mlp
        params = list(mlp.parameters())  # what ZeRO would reduce once per step; plain parameters here

        def forward(x, mlp=mlp, params=params, run=type(mlp).forward):
            return tiled_mlp.apply(run, mlp, x, max(1, math.ceil(x.shape[-2] / x.shape[-1])), params)

        mlp.forward = forward


def _shard_loss(tokens: int):
    """One shard's share of the mean cross-entropy over ``tokens`` predicted tokens.
    ``TiledFusedLogitsLoss`` runs the LM head and this per shard, backward included, so one
    shard's logits exist at a time; it gives the head's weight the gradient of its own output,
    so the mean is taken here, not after it (there the head's gradient would be ``tokens``×)."""
    def loss(model, x, y):
        logits = model.lm_head(x).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-100,
                                                 reduction="sum") / tokens

    return loss


def _alst_peer(liger: bool):
    """DeepSpeed's ALST recipe on one GPU (arXiv 2506.13996, less its sequence parallelism):
    Hugging Face with non-reentrant checkpointing, every MLP tiled (``_tile_mlps``), the
    checkpointed layer inputs in pinned host memory (DeepSpeed's offloader of exactly those,
    on a side stream), the LM head + loss through ``TiledFusedLogitsLoss`` in shards of about
    1 GiB of fp32 logits (ALST's size); with ``liger``, Liger's kernels and its fused linear
    cross-entropy as the loss, its SwiGLU off (the tiled MLP takes that forward), as
    ArcticTraining does."""
    def make(config, device, dtype, length):
        version, tiled_mlp, tiled_loss, offloading = _deepspeed_alst()  # refused before anything is built
        if liger:
            _liger()(rope=True, swiglu=False, rms_norm=True, fused_linear_cross_entropy=True, cross_entropy=False)
        model, _ = _hf_peer(liger=False)(config, device, dtype, length)
        _tile_mlps(model, tiled_mlp)
        offload = offloading()  # one manager for every step, as DeepSpeed asks (it pools its host buffers)

        def step(ids):
            with offload:  # forward and backward inside: backward brings the inputs back
                if liger:
                    loss, head = model(input_ids=ids, labels=ids, use_cache=False).loss, "Liger's fused linear cross-entropy"
                else:
                    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
                    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)  # shifted, as HF's loss shifts
                    shards = max(1, math.ceil(ids.numel() * config.vocab_size * 4 / ALST_LOGITS_SHARD))
                    loss = tiled_loss.apply(_shard_loss(ids.shape[1] - 1), model, hidden, labels, None, shards,
                                            [model.lm_head.weight], "sum")
                    head = f"TiledFusedLogitsLoss in {shards} shard(s)"
                loss.backward()
            moved = offload.stats
            where = (f"{moved.offloaded_bytes / GIB:.2f} GiB of {moved.marked_tensors} checkpointed layer inputs "
                     f"to host memory ({moved.offloaded_tensors} offloaded)" if device.type != "cpu"
                     else "checkpointed layer inputs not offloaded (on a CPU they are in host memory)")
            step.notes = (f"deepspeed {version}; TiledMLP in {math.ceil(ids.shape[1] / config.hidden_size)} shards; "
                          f"loss: {head}; {where}")

        step.notes = None
        return model, step

    return make


def _fpdt_chunk(length: int) -> int:
    return max(1, min(16384 if length > 32768 else 8192, length // 4))


def _fpdt(length: int, liger: bool = False, **options):
    if options.get("offload") or options.get("offload_inputs"):
        # The library's default budget (half the host) refuses 256K without keep_output by a few
        # GiB (66 GiB of layer inputs and K/V); the first GPU run pinned that much, unbounded, and
        # lived. Three quarters keeps those rows comparable and still leaves the OS a quarter.
        options.setdefault("host_memory", physical_memory() * 3 // 4)
    return lt.Strategy(engine="fpdt", engine_options={"chunk": _fpdt_chunk(length), **options}, mst=True,
                       **({"liger": True} if liger else {}))


CASES = [
    Case("hf", "peer", _hf_peer(liger=False)),
    Case("hf+offload", "peer", _hf_peer(liger=False, offload="save_on_cpu")),
    Case("hf+liger", "peer", _hf_peer(liger=True)),
    Case("hf+liger+offload", "peer", _hf_peer(liger=True, offload="save_on_cpu")),
    # What experts run: selective checkpointing keeping attention's outputs (torchtitan's
    # default), the top layers unchecked where memory allows, TRL's overlapped offloading.
    Case("hf+sac", "peer", _hf_peer(liger=False, keep_attention=True)),
    Case("hf+liger+sac", "peer", _hf_peer(liger=True, keep_attention=True)),
    Case("hf+top", "peer", _hf_peer(liger=False, top_whole=True)),
    Case("hf+liger+top", "peer", _hf_peer(liger=True, top_whole=True)),
    Case("hf+trl-offload", "peer", _hf_peer(liger=False, offload="trl")),
    Case("hf+liger+trl-offload", "peer", _hf_peer(liger=True, offload="trl")),
    # DeepSpeed's ALST on one GPU: tiled MLPs, tiled LM head + loss, checkpointed inputs offloaded.
    Case("hf+alst", "peer", _alst_peer(liger=False)),
    Case("hf+liger+alst", "peer", _alst_peer(liger=True)),
    # Layer checkpointing keeps attention's output (host memory) instead of rerunning it.
    Case("lt:checkpoint+mst", "longtrain", lambda n: lt.Strategy(checkpoint=True, mst=True)),
    Case("lt:checkpoint+mst+liger", "longtrain", lambda n: lt.Strategy(checkpoint=True, mst=True, liger=True)),
    # ... with the kept attention outputs on the device (checkpoint:offload=false), as the
    # expert peer hf+liger+sac keeps them: no host copies, their bytes on the device instead.
    Case("lt:checkpoint+ondevice+mst+liger", "longtrain",
         lambda n: lt.Strategy(checkpoint={"offload": False}, mst=True, liger=True)),
    # ... with the checkpointed inputs in host memory too (what hf+liger+offload does with
    # save_on_cpu): whole-sequence layers at 256K on 80 GB. Three quarters of the host, as
    # the FPDT offload cases: the inputs first, kept attention outputs in what remains.
    Case("lt:checkpoint+offload+mst+liger", "longtrain",
         lambda n: lt.Strategy(checkpoint={"offload_inputs": True, "host_memory": physical_memory() * 3 // 4}, mst=True,
                               liger=True)),
    # What `longtrain train --strategy auto` runs here: the planner's pick for this device's
    # memory (e.g. checkpoint:except_last=N,mst: the top N layers left whole), plus liger.
    Case("lt:auto", "auto", None),
    Case("lt:recompute+mst", "longtrain", lambda n: lt.Strategy(checkpoint={"keep_attention": False}, mst=True)),
    Case("lt:fpdt+mst", "longtrain", lambda n: _fpdt(n)),
    Case("lt:fpdt+keep+mst", "longtrain", lambda n: _fpdt(n, keep_output=True)),
    Case("lt:fpdt+offload+mst", "longtrain", lambda n: _fpdt(n, offload=True)),
    Case("lt:fpdt+offload+keep+mst", "longtrain", lambda n: _fpdt(n, offload=True, keep_output=True)),
    Case("lt:fpdt+offload+mst+liger", "longtrain", lambda n: _fpdt(n, liger=True, offload=True)),
    Case("lt:fpdt+offload+keep+mst+liger", "longtrain", lambda n: _fpdt(n, liger=True, offload=True, keep_output=True)),
    # As many layers keep their attention output as the host budget holds beside the parked
    # inputs (every layer's at 128K in three quarters of the host, about 14 of 32 at 256K).
    Case("lt:fpdt+offload+fit+mst", "longtrain", lambda n: _fpdt(n, offload=True, keep_output="fit")),
    Case("lt:fpdt+offload+fit+mst+liger", "longtrain", lambda n: _fpdt(n, liger=True, offload=True, keep_output="fit")),
    # The inputs (and kept outputs) in host memory, one layer's K/V and their gradient sums on
    # the device: none of the copies per pair of chunks (engines.fpdt.host_traffic: at 256K a
    # quarter of the bytes), 1.2 GiB more of the device peak at 256K (simulated).
    Case("lt:fpdt+inputs+mst", "longtrain", lambda n: _fpdt(n, offload_inputs=True)),
    Case("lt:fpdt+inputs+fit+mst+liger", "longtrain", lambda n: _fpdt(n, liger=True, offload_inputs=True, keep_output="fit")),
    # Memo: attention once, other activations swapped to host memory by token (alpha measured
    # in the warm-up step), no layer recomputed where the host link hides the copies.
    Case("lt:memo+mst", "longtrain", lambda n: lt.Strategy(memo=lt.MemoOptions(), mst=True)),
    Case("lt:seco+checkpoint+mst", "longtrain",
         lambda n: lt.Strategy(engine="seco", engine_options={"chunk": _fpdt_chunk(n) // 2, "offload": True},
                               checkpoint=True, mst=True)),
]
BY_NAME = {case.name: case for case in CASES}
EXPERT_PEERS = ("hf+sac", "hf+liger+sac", "hf+top", "hf+liger+top", "hf+trl-offload", "hf+liger+trl-offload", "hf+alst",
                "hf+liger+alst")


def _build_longtrain(config, device, dtype, strategy):
    with torch.device(device):
        model = build_from_config(config, dtype)
    lt.apply(model.train(), strategy)
    return model, lambda ids: lt.step(model, {"input_ids": ids})


class _Timer:
    """CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


class _HostPeak:
    """Peak resident memory of this process while the block runs, sampled every 10 ms
    from /proc (where there is no /proc: the process's lifetime peak from getrusage)."""

    def __enter__(self):
        self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _empty_row(case: Case, length: int) -> dict:
    return {"tokens": length, "case": case.name, "status": "ok", "step_s": None, "tokens_per_s": None, "mfu_pct": None,
            "alloc_gib": None, "reserved_gib": None, "reserved_over_alloc": None, "host_peak_gib": None,
            "host_pinned_gib": None, "alloc_conf": allocator_setting(),
            "attention_kernel": None, "attention_ops": None, "step_times": None, "spread_pct": None,
            "sm_clock_mhz": None, "power_w": None, "device_cap_gib": None, "device": None, "rounds": 1, "notes": None}


def _kernel_of(config, device, dtype) -> str:
    from longtrain.ops.attention_blocks import attention_kernel

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return attention_kernel(device, dtype, head_dim)


def _strategy_of(case: Case, config, length: int, device: torch.device, dtype) -> "lt.Strategy":
    if case.kind == "auto":
        from longtrain.plan.auto import auto_strategy

        return auto_strategy(config, length, device, dtype=str(dtype).replace("torch.", ""), optimizer="none",
                             say=lambda line: print(f"{case.name}: {line}", flush=True))
    return case.make(length)


def _spec(strategy) -> str:
    """``strategy`` as --strategy reads it, options that differ from their defaults only."""
    items = []
    for name, options in ([(strategy.engine, strategy.engine_options)] if strategy.engine != "backprop" else []) + list(
            strategy.techniques.items()):
        changed = [f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options)
                   if getattr(options, f.name) != f.default]
        items.append(":".join([name, *changed]))
    return ",".join(items)


def _strategy_notes(model) -> str | None:
    """What a technique chose on this machine (Memo's alpha and the rates it measured)."""
    context = applied_context(model)
    notes = dict(context.notes) if context is not None else {}
    if "memo_alpha" not in notes:
        return None
    text = f"memo alpha {notes['memo_alpha']:.2f}"
    if notes.get("memo_measured"):
        text += f" (layer {notes['memo_layer_seconds'] * 1e3:.0f} ms, host link {notes['memo_host_bandwidth'] / 1e9:.1f} GB/s)"
    return text


def _profile_step(one_step, device: torch.device, path: Path) -> None:
    """One more step under torch.profiler: its operators by self device time and by self
    host time (where a step's time goes — the first GPU run found the host busier than
    the GPU in chunked attention)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        one_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    table = prof.key_averages()
    sections = [("self CPU", "self_cpu_time_total")] + ([("self device", "self_device_time_total")] if device.type == "cuda" else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(f"# by {title}\n" + table.table(sort_by=key, row_limit=40) for title, key in sections) + "\n")


class _AttentionOps:
    """The attention operators a step dispatches (SDPA's fused kernels, longtrain's blocks
    call them too): which kernel each case ran, recorded from its warm-up step."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = collections.Counter()

        class Recording(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if "attention" in func.__name__ or "attn" in func.__name__:
                    seen[func.__name__.split(".")[0]] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Recording()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)

    @property
    def names(self) -> str | None:
        """Each operator with how often the step ran it (a forward kernel run twice per
        layer: attention recomputed in backward)."""
        return ", ".join(f"{name} ×{count}" for name, count in sorted(self.seen.items())) or None


def _clock_and_power(device: torch.device) -> tuple[float | None, float | None]:
    """The GPU's SM clock (MHz) and power draw (W) now, where NVML answers (None elsewhere)."""
    if device.type != "cuda":
        return None, None
    try:
        return float(torch.cuda.clock_rate(device)), torch.cuda.power_draw(device) / 1000
    except Exception:  # noqa: BLE001 - no pynvml, or NVML refuses: not recorded
        return None, None


def cap_device_memory(device: torch.device, cap: int | None) -> float | None:
    """``--device-memory``: the allocator may not pass ``cap`` bytes in this process (its
    per-process fraction of the device), so a smaller card's case runs on a larger one.
    The cap in GiB, or None where none is asked; on a CPU it is recorded, not enforced."""
    if cap is None:
        return None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    return cap / GIB


def run_case(case: Case, config, length: int, device: torch.device, dtype, repeats: int, warmup: int,
             profile_dir: Path | None = None, device_cap: int | None = None) -> dict:
    row = _empty_row(case, length)
    model = None
    try:
        row["device_cap_gib"] = cap_device_memory(device, device_cap)
        strategy = None
        if case.kind == "peer":
            model, step = case.make(config, device, dtype, length)
        else:
            strategy = _strategy_of(case, config, length, device, dtype)
            model, step = _build_longtrain(config, device, dtype, strategy)
        ids = torch.randint(0, config.vocab_size, (1, length), device=device)
        timer = _Timer(device)

        def one_step():
            step(ids)
            model.zero_grad(set_to_none=True)

        if not warmup and not (strategy is not None and "memo" in strategy.techniques):
            # Without a warm-up at the length (--warmup 0), a short step takes the one-time
            # costs that do not depend on it (Triton's compiles for Liger, cuBLAS and cuDNN
            # start-up). Not Memo: it fixes α in its first step, for that length.
            step(ids[:, :min(length, SHORT_WARMUP)])
            model.zero_grad(set_to_none=True)
        memo = strategy is not None and "memo" in strategy.techniques
        for i in range(warmup):  # kernels and their plans, the pinned pool, the allocator's segments
            # The last warm-up step records the attention operators (not Memo's first: it times
            # that step to choose its α, and the recording slows it).
            recording = i == warmup - 1 and not (memo and i == 0)
            with _AttentionOps() if recording else contextlib.nullcontext() as seen:
                timer.time(one_step)
            if recording:
                row["attention_ops"] = seen.names
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, clocks, power = [], [], []
        with _HostPeak() as host:
            for _ in range(repeats):
                times.append(timer.time(one_step))
                clock, watts = _clock_and_power(device)
                clocks.append(clock)
                power.append(watts)
        seconds = statistics.median(times)
        row.update(step_s=seconds, tokens_per_s=length / seconds, host_peak_gib=host.peak / GIB, step_times=times,
                   spread_pct=100 * (max(times) - min(times)) / seconds,
                   sm_clock_mhz=[c for c in clocks if c is not None] or None,
                   power_w=[w for w in power if w is not None] or None)
        peak = device_peak_flops(device)
        if peak:
            row["mfu_pct"] = 100 * model_flops_per_sample(model, length) / seconds / peak
        if device.type == "cuda":
            row["alloc_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            row["reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
            row["reserved_over_alloc"] = row["reserved_gib"] / row["alloc_gib"]
        if strategy is not None:
            row["host_pinned_gib"] = pinned_host_bytes(model) / GIB
            choice = f"auto chose {_spec(strategy)}" if case.kind == "auto" else None
            row["notes"] = "; ".join(filter(None, [choice, _strategy_notes(model)])) or None
            # After the steps, on this device's index: a kernel that failed at run time was dropped there.
            here = torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device
            row["attention_kernel"] = _kernel_of(config, here, dtype)
        else:
            row["notes"] = getattr(step, "notes", None)
        if profile_dir is not None:
            _profile_step(one_step, device, Path(profile_dir) / f"{case.name.replace(':', '_')}_{length}.txt")
    except torch.OutOfMemoryError:
        row["status"] = "out of memory"
    except lt.LongtrainError as error:  # e.g. Memo: what it keeps in host memory exceeds the host
        row["status"] = "refused: " + str(error)[:160]
    finally:
        model = step = None  # drop the model before the next case builds its own
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _case_env(case: Case, args) -> dict:
    """Environment of an isolated case: the allocator setting and the attention kernel."""
    env = dict(os.environ)
    expandable = args.expandable_segments == "all" or (args.expandable_segments == "longtrain" and case.kind != "peer")
    if expandable:  # in the variable this PyTorch reads (the newer name wins where both are set)
        name = "PYTORCH_ALLOC_CONF" if os.environ.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"
        env[name] = ",".join(filter(None, [os.environ.get(name), "expandable_segments:True"]))
    if args.attention_kernel and case.kind != "peer":
        env["LONGTRAIN_ATTENTION_KERNEL"] = args.attention_kernel
    return env


def run_isolated(case: Case, length: int, args, timeout: float) -> dict:
    """The case in a fresh process (see the module docstring); its row, or one that says why not."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case-only", case.name, "--lengths", str(length),
           "--model", args.model, "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    if args.smoke:
        cmd.append("--smoke")
    if getattr(args, "device_memory", None):
        cmd += ["--device-memory", args.device_memory]
    if args.profile:
        cmd += ["--profile", str(args.profile)]
    row = _empty_row(case, length)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), env=_case_env(case, args))
    except subprocess.TimeoutExpired:
        row["status"] = f"timed out ({timeout:.0f} s)"
        return row
    for line in proc.stdout.splitlines():
        if line.startswith(ROW_TAG):
            return json.loads(line[len(ROW_TAG):])
    if proc.returncode == -signal.SIGKILL:  # nothing of ours sends it: the kernel's out-of-memory killer
        row["status"] = "out of host memory (killed by SIGKILL)"
        return row
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    row["status"] = "failed: " + (tail[-1][:160] if tail else f"exit code {proc.returncode}")
    return row


def _add_ratios(rows: list[dict]) -> None:
    """tokens/s of each case over the best peer that ran at the same length under the same
    memory cap (a capped row stands for a smaller card: it is compared with that card's peers)."""
    def group(r):
        return r["tokens"], r.get("device_cap_gib")

    for key in {group(r) for r in rows}:
        peers = [r["tokens_per_s"] for r in rows if group(r) == key and not r["case"].startswith("lt:") and r["tokens_per_s"]]
        best = max(peers) if peers else None
        for r in rows:
            if group(r) == key:
                r["vs_best_peer"] = r["tokens_per_s"] / best if best and r["tokens_per_s"] else None


def longest_fit(rows: list[dict]) -> dict[str, dict]:
    """Per case (and memory cap): the longest length that ran, and the shortest that did not
    (None: none failed)."""
    summary: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: r["tokens"]):
        key = r["case"] + (f" (cap {r['device_cap_gib']:.1f} GiB)" if r.get("device_cap_gib") else "")
        entry = summary.setdefault(key, {"longest_ok": None, "first_failure": None})
        if r["status"] == "ok":
            entry["longest_ok"] = r["tokens"]
        elif entry["first_failure"] is None:
            entry["first_failure"] = r["tokens"]
    return summary


def _settings(args):
    if args.smoke:
        lengths = [parse_tokens(x) for x in args.lengths.split(",")] if args.lengths else [128, 256]
        return torch.device("cpu"), torch.float32, "tiny-llama", lengths
    return torch.device("cuda"), torch.bfloat16, args.model, [parse_tokens(x) for x in (args.lengths or "16K,32K").split(",")]


def _config(model_name: str, lengths: list[int]):
    config = preset_config(model_name)
    config.max_position_embeddings = max(config.max_position_embeddings, max(lengths))
    config.use_cache = False
    return config


def _cap(args) -> int | None:
    from longtrain.memory.units import parse_bytes

    return parse_bytes(args.device_memory) if args.device_memory else None


def _pooled(earlier: dict | None, row: dict) -> dict:
    """A case's row of this round with its earlier rounds' timed steps (--rounds): the median
    and spread of all of them."""
    if earlier is None or not earlier.get("step_times"):
        return row
    if not row.get("step_times"):  # this round failed (out of memory, timed out): say so, keep the steps
        return dict(earlier, notes="; ".join(filter(None, [earlier.get("notes"), f"a later round: {row['status']}"])))
    times = earlier["step_times"] + row["step_times"]
    median = statistics.median(times)
    pooled = dict(row, step_times=times, step_s=median, tokens_per_s=row["tokens"] / median,
                  spread_pct=100 * (max(times) - min(times)) / median, rounds=earlier.get("rounds", 1) + 1)
    if row.get("mfu_pct"):
        pooled["mfu_pct"] = row["mfu_pct"] * row["step_s"] / median
    for key in ("sm_clock_mhz", "power_w"):
        pooled[key] = (earlier.get(key) or []) + (row.get(key) or []) or None
    for key in ("alloc_gib", "reserved_gib", "host_peak_gib", "host_pinned_gib"):  # the peaks of every round
        values = [r[key] for r in (earlier, row) if r.get(key) is not None]
        pooled[key] = max(values) if values else None
    if pooled.get("alloc_gib"):
        pooled["reserved_over_alloc"] = pooled["reserved_gib"] / pooled["alloc_gib"]
    return pooled


def _one_case(args) -> int:
    """``--case-only``: run one case at one length in this process and print its row."""
    device, dtype, model_name, lengths = _settings(args)
    row = run_case(BY_NAME[args.case_only], _config(model_name, lengths), lengths[0], device, dtype, args.repeats,
                   args.warmup, args.profile, _cap(args))
    print(ROW_TAG + json.dumps(row), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", help="preset (default %(default)s)")
    parser.add_argument("--lengths", default=None, help="comma list of sequence lengths, short to long (default 16K,32K)")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma list of cases (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per case and round (default 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps at the length first (default 1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every case this many times per length, the order reversed each round, pooling "
                             "their timed steps (default %(default)s)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="cap each case's allocator at SIZE (its per-process fraction of the device), e.g. 79.1GiB: "
                             "an H100 80 GB's memory on an H200; rows say so")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="start no new case after this many seconds (default %(default)s)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each case in its own process (default: on a GPU yes, with --smoke no)")
    parser.add_argument("--expandable-segments", choices=("off", "longtrain", "all"), default="all",
                        help="cases run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, with --isolate "
                             "(default %(default)s)")
    parser.add_argument("--attention-kernel", choices=("cudnn", "flash", "math"), default=None,
                        help="force longtrain's attention kernel (default: the fastest the device has)")
    parser.add_argument("--append", action="store_true",
                        help="merge with the gpu_peers.json already in the output folder; cases that failed at a "
                             "shorter length there are not tried again")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile one more step per case: operator tables by self host and device time in DIR")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny-llama at 128/256 tokens on the CPU, one step per case, written to a temporary folder")
    parser.add_argument("--out", default=None, help="folder for the JSON/markdown/PNG (default docs/results/, or a temporary one with --smoke)")
    parser.add_argument("--case-only", default=None, help=argparse.SUPPRESS)  # internal: one case, one length, one process
    args = parser.parse_args(argv)

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_peers: no CUDA device here; run it on a GPU machine, or pass --smoke to exercise the script on the CPU")
        return 0
    if args.smoke and args.model != parser.get_default("model"):
        print(f"gpu_peers: --smoke runs tiny-llama, not --model {args.model}; drop one of them", file=sys.stderr)
        return 2
    try:
        device, dtype, model_name, lengths = _settings(args)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"{args.lengths!r} holds no positive length")
    except (ValueError, lt.LongtrainError) as error:
        print(f"gpu_peers: --lengths: {error}; e.g. --lengths 16K,32K", file=sys.stderr)
        return 2
    args.repeats = args.repeats if args.repeats is not None else (2 if args.smoke else 3)
    args.warmup = args.warmup if args.warmup is not None else 1
    if args.rounds < 1 or args.repeats < 1 or args.warmup < 0:
        print("gpu_peers: --rounds and --repeats must be at least 1, --warmup at least 0", file=sys.stderr)
        return 2
    if args.case_only:
        return _one_case(args)
    isolate = args.isolate if args.isolate is not None else not args.smoke
    if args.out:
        out = Path(args.out)
    else:
        out = Path(__import__("tempfile").mkdtemp(prefix="gpu_peers_smoke_")) if args.smoke else DOCS
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"gpu_peers: unknown case {unknown[0]!r}; cases: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    config = _config(model_name, lengths)
    rows, skipped = [], []
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cap_gib = _cap(args) / GIB if _cap(args) else None
    if args.append and (out / "gpu_peers.json").exists():
        previous = json.loads((out / "gpu_peers.json").read_text())
        earlier_device = previous["meta"].get("device")
        if earlier_device != device_name:
            print(f"gpu_peers: --append: {out / 'gpu_peers.json'} holds rows measured on {earlier_device}, this is "
                  f"{device_name}; pass --out with a folder of this device's rows", file=sys.stderr)
            return 2
        rows = [r for r in previous["rows"]  # this run's (length, case, cap) replace the stored ones
                if r["tokens"] not in lengths or r["case"] not in names or r.get("device_cap_gib") != cap_gib]
        skipped = [s for s in previous["meta"].get("skipped", []) if not any(f" at {n:,} tokens" in s for n in lengths)]
    if _liger() is None and any("liger" in n for n in names):
        note = f"hf+liger cases (liger-kernel {_LIGER_PROBLEM[0]})"
        skipped += [note] if note not in skipped else []
        print(f"gpu_peers: not run: the Liger cases (liger-kernel {_LIGER_PROBLEM[0]})", file=sys.stderr)
    start = STARTED
    this_run: dict[tuple, dict] = {}
    for length, round_index in ((n, r) for n in lengths for r in range(args.rounds)):
        for name in (names if round_index % 2 == 0 else names[::-1]):  # interleaved: drift falls on every case
            case = BY_NAME[name]
            if "liger" in name and _liger() is None:
                continue
            failed_before = [r for r in rows if r["case"] == name and r["status"] != "ok"
                             and r.get("device_cap_gib") == cap_gib
                             and (r["tokens"] < length or (r["tokens"] == length and round_index))]
            if failed_before:
                skipped.append(f"{name} at {length:,} tokens ({failed_before[0]['status']} at {failed_before[0]['tokens']:,})")
                continue
            left = args.budget_s - (time.perf_counter() - start)
            if left <= 0:
                skipped.append(f"{name} at {length:,} tokens (time budget of {args.budget_s:.0f} s spent)")
                continue
            if isolate:
                # A case started near the end of the budget may overrun it by a minute, never the command's limit.
                hard = min(args.budget_s + 50, COMMAND_LIMIT_S) - (time.perf_counter() - start)
                row = run_isolated(case, length, args, timeout=max(1.0, min(left + 60, hard)))
            else:
                row = run_case(case, config, length, device, dtype, args.repeats, args.warmup, args.profile, _cap(args))
            row["device"], row["device_cap_gib"] = device_name, cap_gib  # also where the case's process failed
            row = this_run[(length, name)] = _pooled(this_run.get((length, name)), row)
            rows = [r for r in rows if (r["tokens"], r["case"], r.get("device_cap_gib")) != (length, name, cap_gib)] + [row]
            print(f"  {length:>8,} {name:<26} {row['status']:<14} "
                  + (f"{row['step_s']:.3f} s  {row['tokens_per_s']:,.0f} tok/s" if row["step_s"] else ""), flush=True)
            # Written after every case, so a run stopped at its time limit keeps what it measured.
            _report(rows, skipped, out, model_name, dtype, device_name, args, argv)
    _report(rows, skipped, out, model_name, dtype, device_name, args, argv)
    _plot(rows, out / "gpu_peers.png")
    print(f"gpu_peers: wrote {out}/gpu_peers.json, .md, .png")
    broken = [f"{r['case']} at {r['tokens']:,}" for r in rows
              if r["tokens"] in lengths and r["case"] in names and r.get("device_cap_gib") == cap_gib
              and r["status"].startswith("failed")]
    if broken:  # a crash, not a measured limit (out of memory, refused, timed out): the suite must say so
        print(f"gpu_peers: FAILED: {'; '.join(broken)}", file=sys.stderr)
        return 1
    return 0


def _report(rows, skipped, out, model_name, dtype, device_name, args, argv) -> None:
    rows.sort(key=lambda r: (r["tokens"], r.get("device_cap_gib") or 0,
                             list(BY_NAME).index(r["case"]) if r["case"] in BY_NAME else 99))
    _add_ratios(rows)
    fits = longest_fit(rows)
    caps = sorted({f"{r['device_cap_gib']:.1f}" for r in rows if r.get("device_cap_gib")})
    enforced = ("ran with the allocator capped there (--device-memory; its per-process fraction): a smaller card's "
                "figures on this one" if device_name != "cpu" else "name the cap they were asked for (on the CPU it is "
                "recorded, not enforced)")
    cap_line = f" Rows with a `cap GiB` ({', '.join(caps)}) {enforced}, compared with peers under the same cap." if caps else ""
    fit_lines = "; ".join(f"{case} {_tokens(entry['longest_ok'])}"
                          + (f" (not {_tokens(entry['first_failure'])})" if entry["first_failure"] else "")
                          for case, entry in fits.items())
    notes = f"""
{model_name}, {str(dtype).replace('torch.', '')}, batch 1, forward + backward, no optimizer step, on {device_name}.
Median of every timed step of a case ({args.repeats} per round; `rounds`: a case's rounds at its length — from 2 on,
the cases of a length interleaved, the order reversed each round; 1: the cases of a length ran one after another once)
({'CUDA events' if device_name != 'cpu' else 'wall clock'}) after {args.warmup} warm-up step(s) at the length; spread:
(slowest − fastest) / median, every step's time in the JSON with the SM clock and power after it; MFU against dense
bf16 peak; allocator peaks of the timed steps and their ratio (OOM follows *reserved*); host peak: the case process's
resident memory during the timed steps. `× best peer`: tokens/s over the fastest peer at that length (the expert
peers — selective checkpointing keeping attention, top layers unchecked, TRL's offloading, DeepSpeed's ALST —
included). alloc conf: the allocator setting of the case (the same for all by default). kernel: longtrain's
attention-block kernel; attention ops: the attention operators the warm-up step dispatched. cuDNN
{torch.backends.cudnn.version()}, torch {torch.__version__}.{cap_line}

Longest length each case ran: {fit_lines or 'nothing ran'}.

Not run: {'; '.join(skipped) or 'nothing'}."""
    columns = [("tokens", "tokens"), ("case", "case"), ("status", "status"), ("step_s", "step s"),
               ("spread_pct", "spread %"), ("rounds", "rounds"), ("tokens_per_s", "tokens/s"), ("vs_best_peer", "× best peer"), ("mfu_pct", "MFU %"),
               ("alloc_gib", "alloc GiB"), ("reserved_gib", "reserved GiB"), ("reserved_over_alloc", "reserved/alloc"),
               ("host_peak_gib", "host peak GiB"), ("host_pinned_gib", "pinned GiB"), ("alloc_conf", "alloc conf"),
               ("attention_kernel", "kernel"), ("attention_ops", "attention ops"), ("device_cap_gib", "cap GiB"),
               ("notes", "notes")]
    for r in rows:  # rows appended from an earlier version of this script may lack a column
        for key, _ in columns:
            r.setdefault(key, None)
    command = "python benchmarks/gpu_peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report("gpu_peers", "longtrain vs Hugging Face (+ Liger, + offload) on one GPU", columns, rows, notes, command.strip(),
                 out_dir=out, meta={"device": device_name, "skipped": skipped, "longest_fit": fits,
                                    "cudnn": torch.backends.cudnn.version(), "torch": torch.__version__,
                                    "device_cap_gib": _cap(args) / GIB if _cap(args) else None, "rounds": args.rounds,
                                    "repeats": args.repeats, "warmup": args.warmup}, quiet=True)


def _tokens(n: int | None) -> str:
    return "none" if n is None else f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from _report import plot_series

    fig, ax = plt.subplots(figsize=(7, 4))
    plot_series(ax, [r for r in rows if r["tokens_per_s"]], "case", "tokens", "tokens_per_s")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)  # a zero-based axis: heights compare as ratios
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
