"""How long one training step takes, predicted from FLOPs, bytes and a few machine rates.

A step is counted per kind of work, each at the rate it runs at on the machine:

- **matmuls** (projections, MLP, head) at ``matmul`` FLOP/s — with what each strategy
  recomputes: checkpointing a layer forward (none in the layers ``except_last`` leaves
  whole), MsT's tiled MLP its forward once more in backward (and the MLP forward a third
  time under checkpointing), SeCO/SpaCO a chunk's logits (its no-grad pass and its
  recomputation; the chunked head forms its gradients with its logits, so no engine's
  backward forms them again), Memo the (1 − α) share of the token-wise forward;
- **attention** at ``fused_attention`` FLOP/s over the whole sequence (one fused kernel)
  or ``block_attention`` FLOP/s in chunks (FPDT's block kernels; ``chunkwise_attention`` for
  SeCO/SpaCO, whose blocks each merge and accumulate a K/V gradient), with its forward once
  more where a strategy recomputes it (checkpointing with ``keep_attention=false`` or in the
  layers whose outputs pass the host budget, FPDT in the layers ``keep_output`` does not keep);
- **elementwise kernels** (norms, rotary, the gated activation, residual adds) at
  ``elementwise`` bytes/s, the bytes counted per token by the model's description
  (:meth:`~longtrain.models.description.ModelDescription.elementwise_bytes`) for every
  forward a layer or an MLP runs, a backward as two; Liger's fused kernels move fewer;
- known slow spots: MsT's tiled MLP backward runs at ``tiled_mlp_efficiency`` of the matmul
  rate and the chunked head's weight gradient at ``head_weight_grad`` FLOP/s; each (chunk,
  layer) pair of a chunked engine costs ``per_chunk_layer`` seconds;
- host copies a layer's compute cannot hide (Memo), at ``host_bandwidth`` bytes/s; of
  FPDT's and checkpointing's, counted from their schedules
  (:func:`~longtrain.engines.fpdt.host_traffic`), the share ``offload_exposed``;
- with the optimizer in host memory (``--optimizer-offload``), the CPU's AdamW step at
  ``cpu_adam`` parameters/s and the updated weights' copy back to the device (the
  gradients' copies to the host overlap backward);
- under sequence parallelism over P GPUs, each rank's 1/P of the work plus Ulysses'
  all-to-alls (q, k, v and the output, forward and backward) at ``interconnect`` bytes/s.

FLOPs follow the model-FLOPs convention (forward 2, backward 4 per matmul parameter and
token; causal attention 2·w·s² forward, 4·w·s² backward per layer), so MFU = model FLOPs /
predicted time / peak. The built-in tables :data:`H100` and :data:`H200` are fitted to
every step measured on those cards (Llama-3-8B, bf16, 16K-128K:
``benchmarks/time_model_fit.py``); ``longtrain calibrate`` (:mod:`.calibrate`) measures
the rates kernel by kernel on the machine at hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import registry
from ..costs import StepWork
from ..models.adapters import adapter_class, describe_model

__all__ = ["BUILT_IN", "H100", "H200", "MachineRates", "StepTime", "built_in_for", "step_time"]


@dataclass(frozen=True)
class MachineRates:
    """The rates a step's work runs at on one machine. The defaults are :data:`H100`'s."""

    # Fitted to every H100 80 GB step stored in docs/results (Llama-3-8B bf16, 16K-128K, peers
    # included: benchmarks/time_model_fit.py, docs/results/time_model_fit.md); the host,
    # interconnect and CPU rates are not part of the fit (single measurements or estimates).
    matmul: float = 7.81e14  # FLOP/s of bf16 GEMMs at long-context shapes
    fused_attention: float = 4.89e14  # FLOP/s of cuDNN's fused causal attention over the whole sequence, forward + backward
    block_attention: float = 4.35e14  # FLOP/s of cuDNN's block kernels in FPDT's layer-major schedule (FA2's: 3.0e14)
    chunkwise_attention: float = 1.89e14  # FLOP/s of SeCO's chunk-major attention (a merge and a K/V gradient per block)
    tiled_mlp_efficiency: float = 0.837  # share of the matmul rate MsT's tiled MLP backward reaches
    head_weight_grad: float = 5.01e14  # FLOP/s of the chunked head's weight gradient (one bf16 GEMM per chunk, fp32 out)
    per_chunk_layer: float = 6.91e-3  # seconds per (chunk, layer) of a chunked engine (fitted with offload_exposed)
    offload_exposed: float = 0.0685  # share of host copies (bytes / host_bandwidth) the compute does not hide
    elementwise: float = 2.45e12  # bytes/s the elementwise kernels move (ModelDescription.elementwise_bytes)
    # FlashAttention-2's attention rate as a share of cuDNN's, for head dimensions cuDNN does not
    # take (ops.attention_blocks.cudnn_takes: e.g. Gemma-2's 256); blocks measured on one H100,
    # 2026-11-23: 3.0e14 against 4.3e14 FLOP/s; the whole-sequence kernels assumed alike
    flash_attention_share: float = 0.70
    host_bandwidth: float = 2.5e10  # bytes/s, device <-> pinned host
    cpu_adam: float = 1.5e9  # parameters/s of fused CPU AdamW with fp32 masters (16 cores; an estimate, not measured on the GPU host)
    interconnect: float = 3.0e11  # bytes/s per GPU of all-to-all (NVLink; not yet measured)
    # seconds per token and layer of a scan the model runs as a Python step per token (Mamba's
    # stock PyTorch path: ~10 small kernels; an estimate, not measured on a GPU), per pass
    token_step: float = 1.0e-4
    peak: float = 9.89e14  # dense bf16 peak, for MFU


H100 = MachineRates()
# Fitted to every H200 step stored in docs/results (as H100's); SeCO's chunk-major attention,
# never measured on an H200, stays at the H100's rate.
H200 = dataclasses.replace(H100, matmul=7.55e14, fused_attention=4.80e14, block_attention=4.45e14, tiled_mlp_efficiency=0.93,
                           head_weight_grad=4.98e14, per_chunk_layer=6.31e-3, offload_exposed=0.0664, elementwise=3.09e12)
BUILT_IN = {"h100": H100, "h200": H200}  # the tables by name (``--rates``), each fitted to its card's rows


def built_in_for(device_name: str) -> tuple[str, MachineRates]:
    """The built-in table of the card ``device_name`` names (e.g. ``nvidia-h200``: the H200's),
    else the H100's: (its name, the rates)."""
    lowered = device_name.lower()
    return next(((name, rates) for name, rates in BUILT_IN.items() if name in lowered), ("h100", H100))


@dataclass
class StepTime:
    seconds: float
    model_flops: float
    parts: dict  # seconds by kind of work

    def mfu(self, peak: float) -> float:
        return self.model_flops / (self.seconds * peak)


def step_time(config, tokens: int, strategy, rates: MachineRates = H100, notes: dict | None = None,
              batch: int = 1, optimizer_offload: bool = False, trainable: int | None = None) -> StepTime:
    """Predicted seconds of one forward + backward of ``batch`` sequences of ``tokens``
    under ``strategy`` (a :class:`~longtrain.strategy.Strategy`); ``notes``: what the
    simulator reported for it (Memo's α and sizes). With ``optimizer_offload``, the CPU
    step of ``trainable`` parameters is added. Under sequence parallelism, one rank's.

    The engine's and the techniques' costs (:mod:`longtrain.costs`) first say what the
    step recomputes and how, then add their own work; the recomputation of whole layers
    is charged here once for whichever part asked for it."""
    sp = strategy.sequence_parallel.degree if strategy.sequence_parallel is not None else 1
    work = StepWork.of(config, tokens, batch, rates, notes, sp)
    engine = registry.engine(strategy.engine).costs
    techniques = [(registry.technique(name).costs, options) for name, options in strategy.techniques.items()]
    engine.describe(work, strategy.engine_options)
    for costs, options in techniques:
        costs.describe(work, options)
    if work.recomputes_layers:
        work.add_layer_forwards(work.recomputed)
        work.attention_passes += work.recomputed * (1 - work.kept_attention)  # kept outputs skip attention
        if work.tiled_mlp and work.recompute_reads_mlp:
            # The MLP forward a third time (fitted: checkpointing's replay stops before the MLP,
            # but the measured steps carry this much more; SeCO's recomputed chunk is read by the next layer).
            work.add_mlp_forwards(work.recomputed)
    engine.add_work(work, strategy.engine_options)
    for costs, options in techniques:
        costs.add_work(work, options)

    n, mlp_fwd, head_fwd = work.layers, work.mlp_fwd, work.head_fwd
    parts = {"matmul": work.matmul / rates.matmul}
    if work.tiled_mlp:  # the tiled MLP's backward (2 forward units of work) at its measured efficiency
        parts["tiled_mlp_slowdown"] = work.recomputed * 2 * mlp_fwd / rates.matmul * (1 / rates.tiled_mlp_efficiency - 1)
    if work.chunked_head:
        parts["head_weight_grad"] = head_fwd * (1 / rates.head_weight_grad - 1 / rates.matmul)
    parts["attention"] = work.attention_passes * work.attention_fwd / (work.attention_rate * work.attention_kernel_share)
    layer_bytes, mlp_bytes = describe_model(config).elementwise_bytes(2, work.fused)  # bf16 activations
    parts["elementwise"] = (tokens * work.batch * n * (work.layer_passes * layer_bytes + work.mlp_passes * mlp_bytes)
                            / rates.elementwise)
    if work.chunk:
        parts["chunk_overhead"] = (1 + work.inner) * rates.per_chunk_layer * n * -(-tokens // work.chunk)
    if work.exposed:
        parts["exposed_copies"] = work.exposed
    if engine.extends_along_tokens and adapter_class(config.model_type).scan_per_token(config):
        # The stock scan, token by token: forward, backward (two passes) and each recomputation.
        passes = 3 + (work.recomputed if work.recomputes_layers else 0)
        parts["token_steps"] = passes * tokens * n * rates.token_step
    model_flops = work.model_flops
    if sp > 1:
        parts = {k: v / sp for k, v in parts.items()}
        model_flops /= sp
        item = 2  # bf16 activations
        shape = describe_model(config)
        moved = tokens * batch * 2 * (shape.attention_width + shape.kv_width) * item * n / sp  # q, k, v, o per layer and rank
        parts["all_to_all"] = 2 * moved / rates.interconnect  # forward and backward
    if optimizer_offload and trainable:
        per_rank = trainable / sp
        parts["cpu_optimizer_step"] = per_rank / rates.cpu_adam + 2 * per_rank / rates.host_bandwidth  # + weights back
    return StepTime(sum(parts.values()), model_flops, parts)
