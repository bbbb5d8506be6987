"""What the ``adjoint`` engine needs to know about a layer whose state is a diagonal
linear recurrence, whatever the layer computes around it.

A layer maps its input z (B, T, P) to z_out; inside, for every token t,

    h^t = a^t ⊙ h^{t−1} + b^t,   h^0 = 0
    z_out^t = f^t(z^{t−W..t}, h^t)

where a^t, b^t and f^t read only the ``window`` tokens before t and t itself (W = 0
for SSM-ResNet; K − 1 for Mamba, whose causal convolution has K taps). The state may
have any trailing shape (N for SSM-ResNet, (I, N) for Mamba). A family's adapter
returns one :class:`Recurrence` per layer (``adapter.recurrence(layer)``); the engine
does the rest: the scan without a graph, the adjoint states, and the VJPs of
:meth:`Recurrence.local` over blocks of tokens, each block reading its ``window``
tokens before it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Recurrence"]


class Recurrence:
    """One layer seen as a diagonal linear recurrence (see the module docstring)."""

    window: int = 0  # tokens before t that token t's maps read

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None):
        """The whole sequence, without a graph: (z_out, a, readout inputs, h); the
        readout inputs are a tuple of (B, T, ...) tensors :meth:`readout` reads."""
        raise NotImplementedError

    def readout(self, inputs: tuple, h: torch.Tensor) -> torch.Tensor:
        """The part of the layer's output that reads the states: its VJP in h is the
        gradient reaching h^t directly (C^{tT} g^t)."""
        raise NotImplementedError

    def local(self, z: torch.Tensor, mask: torch.Tensor | None, context: int, h_prev: torch.Tensor,
              h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For the last ``z.shape[1] − context`` tokens of ``z`` (the first ``context``
        ones, at most ``window``, only feed them), with their states h^{t−1} and h^t held
        fixed: (a^t ⊙ h^{t−1} + b^t, z_out^t). Its VJP with cotangents (adjoint state,
        ∂L/∂z_out^t) is those tokens' share of the parameter gradient and of ∂L/∂z."""
        raise NotImplementedError

    def token_bytes(self, element_size: int) -> int:
        """Working memory of one token's VJP (sets the tokens per block)."""
        raise NotImplementedError

    def stream_dtype(self) -> torch.dtype:
        """The dtype of the residual stream the layer receives (what a rank of a layer group
        allocates to receive it)."""
        raise NotImplementedError
