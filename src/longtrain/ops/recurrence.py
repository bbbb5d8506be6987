"""What the ``adjoint`` engine needs to know about a layer whose state is a diagonal
linear recurrence, whatever the layer computes around it.

A layer maps its input z (B, T, P) to z_out; inside, for every token t,

    h^t = a^t ⊙ h^{t−1} + b^t,   h^0 = 0
    z_out^t = f^t(z^{t−W..t}, h^t)

where a^t, b^t and f^t read only the ``window`` tokens before t and t itself (W = 0
for SSM-ResNet; K − 1 for Mamba, whose causal convolution has K taps). The state may
have any trailing shape (N for SSM-ResNet, (I, N) for Mamba). A family's adapter
returns one :class:`Recurrence` per layer (``adapter.recurrence(layer)``), which
says how the layer computes a^t, b^t and its output from the states
(:meth:`Recurrence.maps`, :meth:`Recurrence.readout`); the engine does the rest: the
scan without a graph (whole, or chunk by chunk from a kept state), the adjoint states,
and the VJPs of :meth:`Recurrence.local` over blocks of tokens, each block reading its
``window`` tokens before it.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear_scan import linear_scan

__all__ = ["Recurrence"]


class Recurrence:
    """One layer seen as a diagonal linear recurrence (see the module docstring).

    Shapes: z (B, T, P); decays a (B, T, *S) or broadcastable to it; states h (B, T, *S)."""

    window: int = 0  # tokens before t that token t's maps read

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def maps(self, z: torch.Tensor, mask: torch.Tensor | None, context: int):
        """For the last ``z.shape[1] − context`` tokens of ``z`` (the first ``context``
        ones, at most ``window``, only feed them): (residual, a, b, readout inputs), the
        readout inputs a tuple of (B, T', ...) tensors :meth:`readout` reads. ``b`` is a
        tensor of its own, (B, T', *S) (a scan from a state adds to its first token)."""
        raise NotImplementedError

    def readout(self, inputs: tuple, h: torch.Tensor) -> torch.Tensor:
        """The part of the layer's output that reads the states: its VJP in h is the
        gradient reaching h^t directly (C^{tT} g^t)."""
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, z: torch.Tensor, mask: torch.Tensor | None, context: int = 0, h0: torch.Tensor | None = None):
        """The tokens after ``context``, without a graph, their scan started from the state
        ``h0`` (B, *S) before them (None: h^0 = 0): (z_out, a, readout inputs, h)."""
        residual, a, b, inputs = self.maps(z, mask, context)
        if h0 is not None:
            b[:, 0] += a[:, 0] * h0
        h = linear_scan(a, b)
        return residual + self.readout(inputs, h), a, inputs, h

    def local(self, z: torch.Tensor, mask: torch.Tensor | None, context: int, h_prev: torch.Tensor,
              h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For the tokens after ``context``, with their states h^{t−1} and h^t held fixed:
        (a^t ⊙ h^{t−1} + b^t, z_out^t). Its VJP with cotangents (adjoint state,
        ∂L/∂z_out^t) is those tokens' share of the parameter gradient and of ∂L/∂z."""
        residual, a, b, inputs = self.maps(z, mask, context)
        return a * h_prev + b, residual + self.readout(inputs, h)

    def state_size(self) -> int:
        """Elements of one token's state (the product of *S)."""
        raise NotImplementedError

    def token_bytes(self, element_size: int) -> int:
        """Working memory of one token's VJP (sets the tokens per block)."""
        raise NotImplementedError

    def stream_dtype(self) -> torch.dtype:
        """The dtype of the residual stream the layer receives (what a rank of a layer group
        allocates to receive it)."""
        raise NotImplementedError
