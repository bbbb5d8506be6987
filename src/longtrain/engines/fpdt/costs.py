"""What plans and simulations ask of the FPDT engine (:mod:`longtrain.costs`): what it
parks and copies, its time beyond the plain step, its small-simulation settings and the
variants a plan weighs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...costs import StepWork
from ...models.adapters import adapter_class, describe_model
from ...models.shapes import kept_output_bytes, kv_bytes_per_token
from ...ops.chunked_attention import chunk_bounds
from ..chunked.costs import ChunkedCosts, outputs_that_fit, parked_host_bytes, planned_kept_outputs
from ..chunked.settings import ChunkSettings

__all__ = ["FPDTCosts", "HostTraffic", "host_traffic", "KeptOutputsCorrection"]


@dataclass(frozen=True)
class HostTraffic:
    """Bytes one FPDT step copies between the device and host memory, by what moves."""

    kv: int  # parked K/V and their gradient sums: quadratic in the chunks (every pair of chunks)
    inputs: int  # parked layer inputs, output gradients, rotary tables and kept attention outputs: linear

    @property
    def total(self) -> int:
        return self.kv + self.inputs


def host_traffic(config, batch: int, length: int, item: int, settings: ChunkSettings, kept_outputs: int,
                 position_rows: int = 1) -> HostTraffic:
    """What :func:`fpdt_step` copies to and from host memory in one training step over
    ``batch`` rows of ``length`` tokens (``item`` bytes per element), from its schedule, for
    a causal batch without padding, packing or a sliding window (every pair of chunks meets),
    on one device. K/V count with ``offload``; inputs, rotary tables and kept outputs with
    ``offload_inputs``. tests/test_fpdt.py counts a step's copies and finds exactly this.

    Per layer, with P the K/V of every (query chunk, earlier chunk) pair: the forward parks
    its K/V and fetches P; backward parks them again (``recompute_kv``), fetches P twice (a
    recomputed attention, then its backward; once where the output was kept), and sends P of
    gradients to the earlier chunks' sums, each fetched and parked again per addition (the
    first is only parked; the chunk's own backward fetches the sum last)."""
    n = describe_model(config).layers
    bounds = chunk_bounds(length, settings.chunk)
    kv_per_token = batch * kv_bytes_per_token(config, item)
    kv = kv_per_token * length
    pairs = sum(kv_per_token * (b - a) * (len(bounds) - 1 - j) for j, (a, b) in enumerate(bounds))
    kept = min(kept_outputs, n)
    # With segments, backward first runs each segment's lower layers forward again from its
    # parked input: their attention parks K/V and fetches P, their outputs are parked again.
    segment = max(1, settings.segment)
    rerun = [layer for layer in range(n - 1) if (layer + 1) % segment] if segment > 1 else []
    kv_traffic = 0
    if settings.offload:
        parks = n * (2 if settings.recompute_kv else 1) + len(rerun)
        history = (n + len(rerun)) * pairs + (2 * n - kept) * pairs  # forward (and reruns); recomputation, backward
        kv_traffic = parks * kv + history + 2 * n * pairs  # + gradient sums: every addition parked, fetched
    inputs = 0
    if settings.offload_inputs:
        x = batch * length * describe_model(config).hidden * item
        rotary_dim = describe_model(config).rotary_dim
        rotary = 2 * position_rows * length * rotary_dim * item
        reads = 3 if settings.recompute_kv else 2  # a layer input is read by the forward, the K/V re-park, the recomputation
        inputs = ((n - 1) * x * (1 + reads)  # each layer's input but the first (embeddings): parked, fetched
                  + rotary + n * rotary * reads  # the rotary tables: parked once, read by each layer as its inputs are
                  + 2 * n * x  # output gradients: the head's and each layer's but the first parked, each layer's fetched
                  + len(rerun) * (x + rotary) + sum(1 for layer in rerun if layer > 0) * x
                  + 2 * kept * kept_output_bytes(config, batch, length, item))
    return HostTraffic(kv=kv_traffic, inputs=inputs)


def _keeps_some_outputs(options, layers: int, sequence_parallel) -> bool:
    """Keeping the attention outputs of the lowest N layers (or as many as fit), which a
    small simulation cannot: its handful of layers would keep all."""
    if sequence_parallel is not None:
        return False
    keep = options.keep_output
    return keep == "fit" or (not isinstance(keep, bool) and isinstance(keep, int) and 0 < keep < layers)


@dataclass(frozen=True, eq=False)
class KeptOutputsCorrection:
    """What :meth:`FPDTCosts.kept_outputs_apart` adds at full scale — (device bytes, host
    bytes, layers keeping theirs) at ``tokens`` — to small simulations that keep every
    layer's output (in host memory, with ``offload_inputs``) or none (on the device,
    without): the outputs of the layers that keep none taken off the host peak, or those of
    the N that keep theirs added to the device peak (all alive at once: an upper bound). A
    class, not a closure, so that it pickles back from a plan's worker processes."""

    config: object
    settings: ChunkSettings
    layers: int
    batch_size: int
    item: int

    def __call__(self, tokens: int) -> tuple[int, int, int]:
        settings, layers = self.settings, self.layers
        kept = outputs_that_fit(settings.keep_output, layers, settings.offload_inputs, settings.host_budget,
                                lambda k: parked_host_bytes(self.config, self.batch_size, tokens, self.item, settings, k))
        one = kept_output_bytes(self.config, self.batch_size, tokens, self.item)
        return (0, -(layers - kept) * one, kept) if settings.offload_inputs else (kept * one, 0, kept)


class FPDTCosts(ChunkedCosts):
    """FPDT: layer-major chunks, K/V and layer inputs parked (in host memory with
    ``offload``/``offload_inputs``), attention outputs kept with ``keep_output``, checkpoint
    segments with ``segment``."""

    def layer_period(self, options) -> int:
        return max(1, int(options.segment or 1))

    def small_options(self, options, config, sequence_parallel):
        if _keeps_some_outputs(options, describe_model(config).layers, sequence_parallel):
            # Every layer's output or none (kept_outputs_apart corrects the figures).
            return dataclasses.replace(options, keep_output=options.settings().offload_inputs)
        return options

    def kept_outputs_apart(self, config, options, batch: int, item: int, sequence_parallel):
        if not _keeps_some_outputs(options, describe_model(config).layers, sequence_parallel):
            return None
        return KeptOutputsCorrection(config, options.settings(), describe_model(config).layers, batch, item)

    def parked(self, config, seq_len: int, options, item: int, batch: int) -> tuple[int, int]:
        """K/V where ``offload`` puts them; layer inputs (segment starts with segments) and
        kept attention outputs where ``offload_inputs`` (by default ``offload``) does."""
        settings = options.settings()
        n, tokens = describe_model(config).layers, batch * seq_len
        segment = options.segment
        inputs = (n - 1 if segment <= 1 else -(-n // segment) - 1) * tokens * describe_model(config).hidden * item
        kv = tokens * kv_bytes_per_token(config, item) * (1 if options.recompute_kv else n)
        inputs += planned_kept_outputs(config, seq_len, settings, item, batch) * kept_output_bytes(config, batch, seq_len, item)
        return (kv * (not settings.offload) + inputs * (not settings.offload_inputs),
                kv * settings.offload + inputs * settings.offload_inputs)

    def candidates(self, seq_len: int, host_memory: int | None, layers: int, every_chunk: bool,
                   chunks: tuple[int, ...]) -> dict[str, dict]:
        """At each chunk size: what goes to host memory (K/V and layer inputs, the inputs
        only — one layer's K/V and their gradient sums stay on the device, no copy per pair of
        chunks — or nothing), each plain, with every attention output kept, with √n checkpoint
        segments (which park the fewest inputs; not with the inputs alone parked) and, with a
        host budget, with as many kept outputs as it holds. ``every_chunk``: however many
        chunks (else one chunk, which is no chunking, and over 32, which cost host time, are left out)."""
        segment = max(2, round(layers ** 0.5))
        found = {}
        for chunk in chunks:
            if not every_chunk and (chunk >= seq_len or seq_len // chunk > 32):
                continue
            for parked, offload, segments in ((":offload", {"offload": True}, True),
                                              (":offload_inputs", {"offload_inputs": True}, False), ("", {}, True)):
                variants = [("", {}), (":keep_output", {"keep_output": True})]
                if segments:
                    variants.append((f":segment={segment}", {"segment": segment}))
                if offload and host_memory:
                    variants.append((":keep_output=fit", {"keep_output": "fit"}))
                for variant, extra in variants:
                    found[f"fpdt:chunk={chunk}{parked}{variant}"] = {"chunk": chunk, **offload, **extra}
        return found

    def fit_to_host(self, config, seq_len: int, options, item: int, batch: int, room: int, sequence_parallel):
        """``keep_output=fit`` made a count — the layers whose outputs ``room`` bytes hold beside
        the parked inputs and K/V, as the engine counts them — so a chunk curve does not count
        again at each length. None where that is no layer or every one (the plain and
        ``:keep_output`` variants) or under sequence parallelism (ranks share the host)."""
        if options.keep_output != "fit":
            return options
        if sequence_parallel is not None:
            return None
        fitted = dataclasses.replace(options, host_memory=max(1, room)).settings()
        kept = planned_kept_outputs(config, seq_len, fitted, item, batch)
        if kept in (0, describe_model(config).layers):
            return None
        return dataclasses.replace(options, keep_output=kept)

    def in_longest_search(self, options) -> bool:
        return not (options.keep_output or options.segment == 1)  # those park more at the same chunk

    def describe(self, work: StepWork, options) -> None:
        super().describe(work, options)
        # The recomputed layer is only backpropagated through and skips the MLP's output
        # (ops.tiled_mlp.outputs_unread) unless a later op saves it.
        work.recompute_reads_mlp = adapter_class(work.config.model_type).mlp_output_saved(work.config)
        work.inner = (options.segment - 1) / options.segment  # layers whose input backward recomputes

    def add_work(self, work: StepWork, options) -> None:
        settings = options.settings()
        if options.recompute_kv:
            # q/k/v projections once more (o_proj is skipped: about half the block)
            work.matmul += 2.0 * work.tokens * work.batch * work.attention_params * work.layers / 2
        kept = 0
        if options.keep_output:
            # The recomputation hands a kept output to attention's backward (bf16 bytes for "fit").
            kept = planned_kept_outputs(work.config, work.tokens, settings, 2, work.batch)
            work.attention_passes -= kept / work.layers
        work.add_layer_forwards(work.inner)
        work.attention_passes += work.inner
        # Under sequence parallelism a rank copies what one device would for its N/P tokens (a
        # gathered chunk's K/V are P chunks' tokens of 1/P of the heads): times P here, as the
        # time model divides every part by P. Sliding windows are charged every pair (an upper bound).
        sp = work.sequence_parallel
        traffic = host_traffic(work.config, work.batch, -(-work.tokens // sp), 2, settings, kept)
        work.exposed += sp * work.rates.offload_exposed * traffic.total / work.rates.host_bandwidth
