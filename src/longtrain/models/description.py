"""A model's shape and cost facts, in one place: what engines, techniques, the time model,
the FLOP counts, the simulator and the planner know of a model.

Each family's adapter builds its :class:`ModelDescription` from the config
(:func:`longtrain.models.adapters.describe_model`); nothing else reads a model's shape from its config. Per layer: the
attention it runs (global, a sliding window, or chunked) and its feed-forward block
(a dense MLP, or a mixture of experts with routed experts, experts active per token and
shared experts, which every token runs).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Attention", "FeedForward", "ModelDescription", "stock_norm_bytes"]


def stock_norm_bytes(item: int) -> int:
    """Bytes per element one forward of an RMSNorm written in PyTorch ops moves: cast up to
    float32, square, mean, scale, cast down, weight (``item``: the activations' element size)."""
    return 4 * item + 7 * 4


@dataclass(frozen=True)
class Attention:
    """One layer's attention: ``kind`` is ``"global"`` (every earlier token), ``"sliding"``
    (the last ``window`` tokens) or ``"chunked"`` (earlier tokens of its ``window``-token block)."""

    kind: str = "global"
    window: int | None = None


@dataclass(frozen=True)
class FeedForward:
    """One layer's feed-forward block. Dense: one MLP of ``width`` hidden units and
    ``matrices`` weight matrices (3 when gated: gate, up, down). Mixture of experts:
    ``experts`` routed experts of ``width`` each, ``active`` of them per token, a router
    (hidden × experts) and ``shared_width`` units of shared experts that every token runs
    (scaled by a one-output gate where ``shared_gate``)."""

    width: int
    matrices: int = 3
    experts: int = 0
    active: int = 0
    shared_width: int = 0
    shared_gate: bool = False

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def parameters(self, hidden: int, active_only: bool = False) -> int:
        """Matmul parameters of the block: all of them, or (``active_only``) those one token
        multiplies by — what its FLOPs count."""
        one = self.matrices * hidden * self.width
        if not self.is_moe:
            return one
        routed = (self.active if active_only else self.experts) * one
        shared = self.matrices * hidden * self.shared_width + (hidden if self.shared_gate else 0)
        return routed + shared + hidden * self.experts


@dataclass(frozen=True)
class ModelDescription:
    """Shapes a step's costs depend on. Attention-free models have ``heads == 0`` and no
    per-layer attention; models without a feed-forward block (SSMs) an empty ``feed_forward``."""

    layers: int
    hidden: int
    vocab: int
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    rotary_dim: int = 0  # elements of a head that rotary embeddings rotate
    attention: tuple[Attention, ...] = ()  # per layer
    feed_forward: tuple[FeedForward, ...] = ()  # per layer
    tied_embeddings: bool = False
    max_positions: int | None = None
    mixer_parameters: int = 0  # matmul parameters of a layer's token mixer other than attention (an SSM's projections)
    stream_item: int | None = None  # bytes per element of the residual stream where wider than activations (residual_in_fp32: 4)

    @property
    def has_attention(self) -> bool:
        return self.heads > 0

    def layer_inputs_bytes(self, tokens: int, item: int, layers: int | None = None) -> int:
        """What the inputs of the bottom ``layers`` layers (default: all) hold for ``tokens``
        tokens: the lowest in the activations' ``item`` (the embedding's output), those above
        in the residual stream's (``stream_item``, where wider)."""
        n = self.layers if layers is None else layers
        return tokens * self.hidden * (item + (n - 1) * max(item, self.stream_item or item)) if n > 0 else 0

    @property
    def attention_width(self) -> int:
        """Heads × head dimension (differs from the hidden size in e.g. Gemma-2); 0 without attention."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_parameters(self) -> int:
        """One layer's q, k, v and o projections."""
        return 2 * self.hidden * self.attention_width + 2 * self.hidden * self.kv_width

    def mlp_parameters(self, active_only: bool = True) -> float:
        """Feed-forward matmul parameters per layer, averaged over the layers (a token's
        share of a mixture of experts with ``active_only``)."""
        if not self.feed_forward:
            return 0
        total = sum(block.parameters(self.hidden, active_only) for block in self.feed_forward)
        return total // self.layers if total % self.layers == 0 else total / self.layers

    def layer_weight_parameters(self) -> float:
        """One layer's matmul weights, every expert's included, averaged over the layers:
        what a layer holds (norms aside) and what streaming its frozen weights moves."""
        return self.attention_parameters + self.mixer_parameters + self.mlp_parameters(active_only=False)

    def matmul_parameters(self, active_only: bool = True) -> int:
        """Parameters in matmuls (layers' projections and MLPs or experts, the head; not the
        embedding lookup): all of them, or the ones a token multiplies by."""
        total = sum(block.parameters(self.hidden, active_only) for block in self.feed_forward)
        return self.layers * (self.attention_parameters + self.mixer_parameters) + total + self.vocab * self.hidden

    def flops_per_token(self, seq_len: int) -> float:
        """Forward and backward FLOPs per token of a ``seq_len``-token sample (the MFU
        convention: 6 per active matmul parameter, causal attention 6·layers·width·length)."""
        return 6.0 * self.matmul_parameters(active_only=True) + 6.0 * self.layers * self.attention_width * seq_len

    def inactive_expert_parameters(self) -> int:
        """Expert parameters a token does not multiply by, summed over the layers: the
        difference between a model's matmul parameters and the ones its FLOPs count."""
        return sum(block.parameters(self.hidden) - block.parameters(self.hidden, True) for block in self.feed_forward)

    @property
    def is_moe(self) -> bool:
        return any(block.is_moe for block in self.feed_forward)

    @property
    def sliding_window(self) -> int | None:
        """The widest window of the layers that attend through one, if any layer does."""
        windows = [a.window for a in self.attention if a.kind != "global" and a.window]
        return max(windows) if windows else None

    def per_layer(self) -> list[tuple]:
        """What distinguishes each layer (its attention and feed-forward): the layer
        period of a simulation's extrapolation."""
        n = self.layers
        attention = self.attention or (None,) * n
        feed_forward = self.feed_forward or (None,) * n
        return list(zip(attention, feed_forward))


    def whole_layer_bytes(self, tokens: int, item: int) -> int:
        """At least what a layer run without checkpointing keeps for its backward over
        ``tokens`` tokens (its input, the two norms' outputs, attention's output and its
        projection's, the MLP's gate, up and activation outputs): what leaving one whole costs."""
        width = max(((block.active if block.is_moe else 1) * block.width + block.shared_width
                     for block in self.feed_forward), default=0)
        return tokens * item * (4 * self.hidden + self.attention_width + 3 * width)

    def elementwise_bytes(self, item: int, fused: frozenset[str] = frozenset()) -> tuple[float, float]:
        """Bytes one token's forward moves through a layer's elementwise kernels (norms,
        rotary, the gated activation, residual adds, attention's output made contiguous),
        averaged over the layers, and the share of it in the MLP's activation: ``(layer,
        mlp)``. Counted as the stock PyTorch ops read and write them (RMSNorm upcasts to
        float32 and makes five passes), or, for the kernels named in ``fused`` (``"norm"``,
        ``"rope"``, ``"mlp"``: Liger's), one read and one write of each input and output.
        ``item``: bytes per activation element. A backward counts as two forwards."""
        norm = 2 * item if "norm" in fused else stock_norm_bytes(item)
        layer = 2 * norm * self.hidden + 2 * 3 * item * self.hidden  # two norms, two residual adds
        if self.has_attention:
            rotated = self.rotary_dim / self.head_dim if self.head_dim else 0.0
            rope = 2 * item if "rope" in fused else 5 * item  # q·cos, rotate_half, ·sin, add
            layer += rotated * rope * (self.attention_width + self.kv_width) + 2 * item * self.attention_width
        mlp = 0.0
        for block in self.feed_forward:
            width = (block.active if block.is_moe else 1) * block.width + block.shared_width
            gated = block.matrices == 3
            per_unit = (3 * item if "mlp" in fused else 5 * item) if gated else 2 * item
            mlp += per_unit * width / self.layers
        return layer + mlp, mlp
