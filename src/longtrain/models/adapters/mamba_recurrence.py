"""A Hugging Face Mamba block (``transformers`` ``MambaBlock``, its pure-PyTorch path)
as a :class:`~longtrain.ops.recurrence.Recurrence`, for the ``adjoint`` engine.

The block, for every token t (u = RMSNorm(z), padding zeroed as the model zeroes it):

    x̃, g = in_proj(u)                          (I channels each)
    x^t = SiLU(conv1d(x̃^{t−K+1..t}))           causal depthwise convolution, K taps
    δ, B^t, C^t = x_proj(x^t);  Δ^t = softplus(dt_proj.weight δ + dt_proj.bias)
    a^t = exp(Δ^t A),  b^t = Δ^t B^t x^t       (I, N) each; A = −exp(A_log)
    h^t = a^t ⊙ h^{t−1} + b^t
    y^t = (C^t · h^t + D x^t) ⊙ SiLU(g^t)
    z_out^t = z^t + out_proj(y^t)

Token t reads the K − 1 tokens before it (the convolution): ``window = K − 1``. The
maps are computed as the model's torch path computes them, casts included (A, D, the
Δ bias, B and x in float32, the residual in float32 with ``residual_in_fp32``), from
the block's own modules and parameters (so LoRA on its linear layers counts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.recurrence import Recurrence

__all__ = ["MambaRecurrence"]


class MambaRecurrence(Recurrence):
    """A ``MambaBlock`` (norm + mixer + residual)."""

    def __init__(self, layer):
        super().__init__(layer)
        self.mixer = layer.mixer
        self.window = self.mixer.conv_kernel_size - 1

    def maps(self, z: torch.Tensor, mask: torch.Tensor | None, context: int):
        """(residual, a, b, readout inputs) of the last ``z.shape[1] − context`` tokens."""
        block, mixer = self.layer, self.mixer
        residual = z[:, context:]
        u = block.norm(z.to(dtype=block.norm.weight.dtype))
        if block.residual_in_fp32:
            residual = residual.to(torch.float32)
        dtype = u.dtype
        if mask is not None:
            u = (u * mask[:, :, None]).to(dtype)
        x, gate = mixer.in_proj(u).chunk(2, dim=-1)
        gate = gate[:, context:]
        # The model pads the convolution's input with K − 1 zeros at the sequence's start;
        # a block further in reads the tokens before it instead.
        x = F.pad(x.transpose(1, 2), (self.window - context, 0))
        weight = mixer.conv1d.weight
        x = F.conv1d(x.to(weight.dtype), weight, mixer.conv1d.bias, groups=weight.shape[0])
        x = mixer.act(x).to(dtype).transpose(1, 2)
        if mask is not None:
            x = (x * mask[:, context:, None]).to(dtype)
        rank, n = mixer.time_step_rank, mixer.ssm_state_size
        step, b_in, c = torch.split(mixer.x_proj(x), [rank, n, n], dim=-1)
        dt = step @ mixer.dt_proj.weight.transpose(0, 1)
        if mixer.dt_proj.bias is not None:
            dt = dt + mixer.dt_proj.bias.float()
        dt = F.softplus(dt)
        a_log = -torch.exp(mixer.A_log.float())
        a = torch.exp(a_log * dt[..., None])
        b = dt[..., None] * b_in[:, :, None, :].float() * x[..., None].float()
        return residual, a, b, (c, x, gate)

    def readout(self, inputs: tuple, h: torch.Tensor) -> torch.Tensor:
        c, x, gate = inputs
        mixer = self.mixer
        y = torch.matmul(h.to(x.dtype), c[..., None]).squeeze(-1)
        y = (y + x * mixer.D.float()) * F.silu(gate)
        return mixer.out_proj(y.to(x.dtype))

    def stream_dtype(self) -> torch.dtype:
        # residual_in_fp32: the block adds its output to a float32 copy of the stream (a
        # float64 model's stream stays float64, as the sum promotes).
        weight = self.mixer.out_proj.weight.dtype
        probe = torch.empty(0, dtype=weight)
        residual = probe.to(torch.float32) if self.layer.residual_in_fp32 else probe
        return torch.promote_types(residual.dtype, weight)

    def state_size(self) -> int:
        return self.mixer.intermediate_size * self.mixer.ssm_state_size  # Mamba-2: H·P·N, as H·P = I

    def token_bytes(self, element_size: int) -> int:
        # Per token: the norm, projections, convolution and gates (about 8 hidden- and
        # 8 channel-sized vectors) and a, b, the cotangents of the state (6 (I, N) arrays).
        mixer = self.mixer
        return (8 * mixer.hidden_size + 8 * mixer.intermediate_size + 6 * mixer.intermediate_size * mixer.ssm_state_size) * element_size
