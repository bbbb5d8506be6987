"""What plans and simulations ask of ``stream``: the weights it moves off the device
(:func:`streamed_bytes`), when a plan weighs it (:func:`worth_weighing`), and its copies'
time (:class:`StreamCosts`).

Shapes: L layers; W one layer's weights in bytes (the config's, every expert's included)."""

from __future__ import annotations

from ...costs import StepWork, TechniqueCosts
from ...models.adapters import describe_model
from .options import StreamOptions

# A plan weighs streaming where the layers' frozen weights take at least this share of the device.
WORTH_WEIGHING = 0.25


def layer_weight_bytes(config, item: int) -> float:
    """W: one decoder layer's weights in ``item``-byte elements."""
    return describe_model(config).layer_weight_parameters() * item


def streamed_bytes(config, options: StreamOptions, item: int) -> tuple[int, int]:
    """(bytes that leave the device, bytes held in host memory): every layer's weights go to
    the host (L·W) and the device keeps the window of ``ahead`` + 1 layers."""
    layers = describe_model(config).layers
    per_layer = layer_weight_bytes(config, item)
    window = min(layers, options.ahead + 1)
    return int(per_layer * (layers - window)), int(per_layer * layers)


def worth_weighing(config, device_memory: int, item: int, frozen: bool) -> bool:
    """Whether a plan weighs each candidate with and without ``stream``: the layers' weights
    are ``frozen`` (LoRA over a base held in ``item``-byte elements) and take at least
    :data:`WORTH_WEIGHING` of the device."""
    layers = describe_model(config).layers
    return frozen and layers > 2 and layer_weight_bytes(config, item) * layers >= WORTH_WEIGHING * device_memory


class StreamCosts(TechniqueCosts):
    """Frozen weights streamed from host memory: each layer's W (bf16) copied to the device
    once per sweep over the layers, behind that sweep's compute of the layer before; what a
    layer's compute does not hide is exposed. The whole sequence's forward and backward
    (whose recomputation of a layer runs beside its backward) are two sweeps; a chunk-major
    engine (SeCO) sweeps three times per chunk — its no-grad forward, the recomputation,
    the backward — which SpaCO does for its sampled chunks only (charged for all: an upper
    bound). The copies share the host link with what the step offloads (not modelled)."""

    needs_frozen_layers = True

    def weighed_with_each(self, config, device_memory: int, item: int, frozen: bool) -> bool:
        return worth_weighing(config, device_memory, item, frozen)

    def weights_moved(self, config, options: StreamOptions, item: int) -> tuple[int, int]:
        return streamed_bytes(config, options, item)

    def layers_apart_at_top(self, options: StreamOptions) -> int:
        return options.ahead  # the window reaches past the top layer

    def add_work(self, work: StepWork, options: StreamOptions) -> None:
        n = work.layers
        if not n:
            return
        copy = layer_weight_bytes(work.config, 2) / work.rates.host_bandwidth
        forward = (work.layer_fwd / work.rates.matmul + work.attention_fwd / work.attention_rate) / n
        if work.chunk_major and work.chunk:
            chunks = -(-work.tokens // work.chunk)
            sweeps = [forward / chunks, forward / chunks, 2 * forward / chunks] * chunks
        else:
            sweeps = [forward, 2 * forward + (work.recomputed * forward if work.recomputes_layers else 0.0)]
        work.exposed += n * sum(max(0.0, copy - compute) for compute in sweeps)
