"""How long one training step takes, predicted from FLOPs and a few machine rates.

A step is counted per kind of work, each at the rate it runs at on the machine:

- **matmuls** (projections, MLP, head) at ``matmul`` FLOP/s — with what each strategy
  recomputes: checkpointing a layer forward (none in the layers ``except_last`` leaves whole), MsT's tiled MLP its forward once more in
  backward (and the MLP forward a third time under checkpointing), SeCO/SpaCO a chunk's
  logits (its no-grad pass and its recomputation; the chunked head forms its gradients
  with its logits, so no engine's backward forms them again), Memo the (1 − α) share of
  the token-wise forward;
- **attention** at ``fused_attention`` FLOP/s over the whole sequence (one fused kernel)
  or ``block_attention`` FLOP/s in chunks (FPDT's block kernels; ``chunkwise_attention`` for
  SeCO/SpaCO, whose blocks each merge and accumulate a K/V gradient), with
  its forward once more where a strategy recomputes it (checkpointing with
  ``keep_attention=false`` or in the layers whose outputs pass the host budget, FPDT
  in the layers ``keep_output`` does not keep);
- known slow spots, as measured on the H100 (docs/gpu_peers.md, 2026-11-23): MsT's tiled
  MLP backward runs at ``tiled_mlp_efficiency`` of the matmul rate and the chunked head's
  weight gradient at ``head_weight_grad`` FLOP/s; each (chunk, layer) pair of a chunked
  engine costs ``per_chunk_layer`` seconds (host work, or small kernels: a profile will say);
- host copies a layer's compute cannot hide (Memo), at ``host_bandwidth`` bytes/s; of
  FPDT's, counted from its schedule (:func:`~longtrain.engines.fpdt.host_traffic`), the
  share ``offload_exposed`` (fitted with ``per_chunk_layer`` on the lease's six FPDT rows);
- with the optimizer in host memory (``--optimizer-offload``), the CPU's AdamW step at
  ``cpu_adam`` parameters/s and the updated weights' copy back to the device (the
  gradients' copies to the host overlap backward);
- under sequence parallelism over P GPUs, each rank's 1/P of the work plus Ulysses'
  all-to-alls (q, k, v and the output, forward and backward) at ``interconnect`` bytes/s.

FLOPs follow the model-FLOPs convention (forward 2, backward 4 per matmul parameter and
token; causal attention 2·w·s² forward, 4·w·s² backward per layer), so MFU = model FLOPs /
predicted time / peak. :data:`H100` holds the rates measured on one H100 80 GB with bf16
Llama-3-8B; ``longtrain calibrate`` (later) will measure them on the machine at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engines.chunked import planned_kept_outputs
from ..engines.fpdt import host_traffic
from ..memory.flops import attention_width
from ..models.adapters import adapter_class


@dataclass(frozen=True)
class MachineRates:
    # Fitted to one H100 80 GB on 2026-11-23 (docs/gpu_peers.md, Llama-3-8B bf16, 16K-128K:
    # every measured backprop and FPDT step predicted within -3%..+5%); host and interconnect rates
    # are from the first run or not yet measured.
    matmul: float = 6.5e14  # FLOP/s of bf16 GEMMs at long-context shapes
    fused_attention: float = 4.6e14  # FLOP/s of cuDNN's fused causal attention, whole sequence (forward 6.1e14, backward 3.9e14)
    block_attention: float = 4.3e14  # FLOP/s of cuDNN's block kernels in FPDT's layer-major schedule (FA2's were 3.0e14)
    chunkwise_attention: float = 1.9e14  # FLOP/s of SeCO's chunk-major attention (a merge and a K/V gradient per block)
    tiled_mlp_efficiency: float = 0.68  # share of the matmul rate MsT's tiled MLP backward reaches (78.8 ms/layer at 32K)
    head_weight_grad: float = 5.0e14  # FLOP/s of the chunked head's weight gradient (one bf16 GEMM per chunk, fp32 out)
    per_chunk_layer: float = 6.8e-3  # seconds per (chunk, layer) of a chunked engine (fitted at 16K-128K with offload_exposed)
    offload_exposed: float = 0.068  # share of FPDT's host copies (bytes / host_bandwidth) its compute does not hide
    host_bandwidth: float = 2.5e10  # bytes/s, device <-> pinned host
    cpu_adam: float = 1.5e9  # parameters/s of fused CPU AdamW with fp32 masters (16 cores; not yet measured on the GPU host)
    interconnect: float = 3.0e11  # bytes/s per GPU of all-to-all (NVLink; not yet measured)
    peak: float = 9.89e14  # dense bf16 peak, for MFU


H100 = MachineRates()


@dataclass
class StepTime:
    seconds: float
    model_flops: float
    parts: dict  # seconds by kind of work

    def mfu(self, peak: float) -> float:
        return self.model_flops / (self.seconds * peak)


def _shapes(config):
    n, d = config.num_hidden_layers, config.hidden_size
    width = attention_width(config)
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    attn = 2 * d * width + 2 * d * kv  # q, o and k, v projections
    mlp = 3 * d * config.intermediate_size
    return n, width, attn, mlp, config.vocab_size * d


def kept_output_share(config, tokens: int, checkpoint) -> float:
    """The share of checkpointed layers whose attention output is kept (their recomputation
    skips attention's forward): all of them on the device; in host memory, as many as
    ``host_memory`` holds beside the parked inputs (``offload_inputs``), which come first —
    a budget not given is not this machine's default but unknown, taken as enough (the
    planner always gives one). ``tokens``: of the whole batch; activations in bf16."""
    if checkpoint is None or not checkpoint.keep_attention:
        return 0.0
    if not checkpoint.offload or checkpoint.host_memory is None:
        return 1.0
    layers = config.num_hidden_layers - min(checkpoint.except_last, config.num_hidden_layers)
    if layers <= 0:
        return 1.0
    item = 2
    output = tokens * (attention_width(config) * item + config.num_attention_heads * 4)  # and its float32 LSE
    inputs = layers * tokens * config.hidden_size * item if checkpoint.offload_inputs else 0
    return min(layers, max(0, (checkpoint.host_memory - inputs) // output)) / layers


def step_time(config, tokens: int, strategy, rates: MachineRates = H100, notes: dict | None = None,
              batch: int = 1, optimizer_offload: bool = False, trainable: int | None = None) -> StepTime:
    """Predicted seconds of one forward + backward of ``batch`` sequences of ``tokens``
    under ``strategy`` (a :class:`~longtrain.strategy.Strategy`); ``notes``: what the
    simulator reported for it (Memo's α and sizes). With ``optimizer_offload``, the CPU
    step of ``trainable`` parameters is added. Under sequence parallelism, one rank's."""
    n, width, attn_params, mlp_params, head_params = _shapes(config)
    s = tokens * batch
    layer_fwd = 2.0 * s * (attn_params + mlp_params) * n
    mlp_fwd = 2.0 * s * mlp_params * n
    head_fwd = 2.0 * s * head_params
    attention_fwd = 2.0 * width * tokens * tokens * n * batch
    model_flops = 3 * (layer_fwd + head_fwd) + 3 * attention_fwd
    engine = strategy.engine
    techniques = strategy.techniques
    mst = techniques.get("mst")
    tiled, chunked_head = mst is not None and mst.mlp, mst is not None and mst.head
    chunk = getattr(strategy.engine_options, "chunk", None)
    chunked = engine in ("fpdt", "seco", "spaco")

    matmul = 3 * (layer_fwd + head_fwd)
    attention_passes = 3.0  # forward + backward, in forward units
    checkpoint = techniques.get("checkpoint")
    # Layers checkpointing leaves whole (except_last) recompute nothing, their MLP untiled.
    recomputed = 1.0 - (min(checkpoint.except_last, n) / n if checkpoint is not None and n else 0.0)
    if checkpoint is not None or chunked:
        matmul += recomputed * layer_fwd
        kept = 0.0 if chunked else kept_output_share(config, s, checkpoint)
        attention_passes += recomputed * (1 - kept)  # the recomputation runs attention again (kept outputs skip it)
        if tiled and not (engine == "fpdt" and not adapter_class(config.model_type).mlp_output_saved):
            # The MLP forward a third time: checkpointing's (fitted: its replay stops before the
            # MLP, but the measured steps carry this much more), SeCO's recomputed chunk, which
            # the next layer reads; FPDT's recomputed layer is only backpropagated through and
            # skips it (ops.tiled_mlp.outputs_unread) unless a later op saves the MLP output.
            matmul += recomputed * mlp_fwd
    if engine == "fpdt" and getattr(strategy.engine_options, "recompute_kv", False):
        matmul += 2.0 * s * attn_params * n / 2  # q/k/v projections once more (o_proj is skipped: about half the block)
    kept = 0
    if engine == "fpdt" and getattr(strategy.engine_options, "keep_output", False):
        # The recomputation hands a kept output to attention's backward (bf16 bytes for "fit").
        kept = planned_kept_outputs(config, tokens, strategy.engine_options.settings(), 2, batch)
        attention_passes -= kept / n
    segment = getattr(strategy.engine_options, "segment", 1) if engine == "fpdt" else 1
    inner = (segment - 1) / segment  # share of layers whose input backward recomputes (segment > 1)
    matmul += inner * layer_fwd
    attention_passes += inner
    memo = techniques.get("memo")
    exposed = 0.0
    if memo is not None:
        alpha = (notes or {}).get("memo_alpha", memo.alpha if memo.alpha != "auto" else 0.0)
        matmul += (1 - alpha) * (layer_fwd - (mlp_fwd if tiled else 0))
        if tiled:
            # The tiled backward's forward, and the (1 − α) share of checkpointing's fitted third
            # MLP forward (the elementwise work a token-wise recomputation repeats): at α = 0 Memo
            # is checkpointing with attention kept, and is predicted as such.
            matmul += mlp_fwd + (1 - alpha) * mlp_fwd
        if notes and "memo_input_bytes" in notes:
            moved = notes["memo_input_bytes"] + notes["memo_attention_bytes"] + alpha * notes["memo_other_bytes"]
            layer_seconds = (layer_fwd / n + attention_fwd / n) / rates.matmul
            exposed = n * max(0.0, moved / rates.host_bandwidth - layer_seconds)
    elif tiled and "checkpoint" not in techniques and not chunked:
        matmul += mlp_fwd
    if engine in ("seco", "spaco"):
        matmul += head_fwd  # a chunk's logits in its no-grad forward and again in its recomputation
    parts = {"matmul": matmul / rates.matmul}
    if tiled:  # the tiled MLP's backward (2 forward units of work) at its measured efficiency
        parts["tiled_mlp_slowdown"] = recomputed * 2 * mlp_fwd / rates.matmul * (1 / rates.tiled_mlp_efficiency - 1)
    if chunked_head:
        parts["head_weight_grad"] = head_fwd * (1 / rates.head_weight_grad - 1 / rates.matmul)
    rate = {"fpdt": rates.block_attention, "seco": rates.chunkwise_attention,
            "spaco": rates.chunkwise_attention}.get(engine, rates.fused_attention)
    parts["attention"] = attention_passes * attention_fwd / rate
    if chunked and chunk:
        parts["chunk_overhead"] = (1 + inner) * rates.per_chunk_layer * n * -(-tokens // chunk)
    sp = strategy.sequence_parallel.degree if strategy.sequence_parallel is not None else 1
    if engine == "fpdt":
        # Under sequence parallelism a rank copies what one device would for its N/P tokens
        # (a gathered chunk's K/V are P chunks' tokens of 1/P of the heads): times P here, as
        # every part is divided by P below. Sliding windows are charged every pair (an upper bound).
        traffic = host_traffic(config, batch, -(-tokens // sp), 2, strategy.engine_options.settings(), kept)
        exposed += sp * rates.offload_exposed * traffic.total / rates.host_bandwidth
    if exposed:
        parts["exposed_copies"] = exposed
    if sp > 1:
        parts = {k: v / sp for k, v in parts.items()}
        model_flops /= sp
        item = 2  # bf16 activations
        moved = s * (attn_params // config.hidden_size) * item * n / sp  # q, k, v and o of each layer, per rank
        parts["all_to_all"] = 2 * moved / rates.interconnect  # forward and backward
    if optimizer_offload and trainable:
        per_rank = trainable / sp
        parts["cpu_optimizer_step"] = per_rank / rates.cpu_adam + 2 * per_rank / rates.host_bandwidth  # + weights back
    return StepTime(sum(parts.values()), model_flops, parts)
