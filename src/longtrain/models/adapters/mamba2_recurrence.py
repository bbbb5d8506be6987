"""A Hugging Face Mamba-2 block (``transformers`` ``Mamba2Block``, its pure-PyTorch path)
as a :class:`~longtrain.ops.recurrence.Recurrence`, for the ``adjoint`` engine.

The block, for every token t (u = RMSNorm(z), padding zeroed as the model zeroes it):

    g, x̃BC, δ = in_proj(u)                     (I, I + 2GN and H channels)
    x^t, B^t, C^t = SiLU(conv1d(x̃BC^{t−K+1..t}))   causal depthwise convolution, K taps;
                                                x^t is (H, P), B^t and C^t are (G, N)
    Δ^t = clamp(softplus(δ^t + dt_bias), time_step_limit)     one per head
    a^t = exp(Δ^t A),  b^t = Δ^t x^t ⊗ B^t      a^t (H,) broadcast over (P, N); b^t (H, P, N),
                                                group g's B serving its H/G heads; A = −exp(A_log)
    h^t = a^t ⊙ h^{t−1} + b^t
    y^t = C^t · h^t + D x^t                     (H, P)
    z_out^t = z^t + out_proj(RMSNormGated(y^t, g^t))   norm of y ⊙ SiLU(g), per group

The model's torch path computes the scan in chunks of ``chunk_size`` (SSD: exp of
segment sums within a chunk, a recurrence over the chunks' states); the plain
recurrence is the same sum, in another order. Token t reads the K − 1 tokens before it
(the convolution): ``window = K − 1``. The maps are computed as the model's torch path
computes them, casts included (the scan, A, D, B, C and x in float32, the gated norm's
output float32, the residual in float32 with ``residual_in_fp32``), from the block's
own modules and parameters (so LoRA on its linear layers counts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mamba_recurrence import MambaRecurrence

__all__ = ["Mamba2Recurrence"]


class Mamba2Recurrence(MambaRecurrence):
    """A ``Mamba2Block`` (norm + mixer + residual); states (B, T, H, P, N), decays (B, T, H, 1, 1)
    that broadcast over (P, N). The block is laid out as Mamba's (``norm``, ``mixer`` with
    ``conv_kernel_size`` and ``out_proj``, ``residual_in_fp32``): the scan, the per-block
    map and the stream's dtype are :class:`~.mamba_recurrence.MambaRecurrence`'s."""

    def _mask(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # As apply_mask_to_padding_states: padded tokens zeroed, the dtype kept.
        return x if mask is None else (x * mask[:, :, None]).to(x.dtype)

    def maps(self, z: torch.Tensor, mask: torch.Tensor | None, context: int):
        """(residual, a, b, readout inputs) of the last ``z.shape[1] − context`` tokens."""
        block, mixer = self.layer, self.mixer
        heads, head_dim, groups, n = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
        inner = mixer.intermediate_size
        residual = z[:, context:]
        u = block.norm(z.to(dtype=block.norm.weight.dtype))
        if block.residual_in_fp32:
            residual = residual.to(torch.float32)
        gate, xbc, dt = mixer.in_proj(self._mask(u, mask)).split([inner, mixer.conv_dim, heads], dim=-1)
        gate, dt = gate[:, context:], dt[:, context:]
        # The model pads the convolution's input with K − 1 zeros at the sequence's start;
        # a block further in reads the tokens before it instead.
        weight = mixer.conv1d.weight
        conv = F.conv1d(F.pad(xbc.transpose(1, 2), (self.window - context, 0)).to(weight.dtype), weight,
                        mixer.conv1d.bias, groups=weight.shape[0])
        xbc = self._mask(mixer.act(conv).to(xbc.dtype).transpose(1, 2), None if mask is None else mask[:, context:])
        x, b_in, c = torch.split(xbc, [inner, groups * n, groups * n], dim=-1)
        rows, length = x.shape[:2]
        dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype))
        dt = torch.clamp(dt, min=mixer.time_step_limit[0], max=mixer.time_step_limit[1]).float()
        x = x.reshape(rows, length, heads, head_dim).float()
        a = torch.exp(-torch.exp(mixer.A_log.float()) * dt)[..., None, None]
        b_in = b_in.reshape(rows, length, groups, 1, n).float().repeat_interleave(heads // groups, dim=2, output_size=heads)
        b = (x * dt[..., None])[..., None] * b_in
        return residual, a, b, (c.reshape(rows, length, groups, n).float(), x, gate)

    def readout(self, inputs: tuple, h: torch.Tensor) -> torch.Tensor:
        c, x, gate = inputs
        mixer = self.mixer
        c = c.repeat_interleave(h.shape[2] // c.shape[2], dim=2, output_size=h.shape[2])
        y = torch.matmul(h.to(c.dtype), c[..., None]).squeeze(-1) + mixer.D[:, None] * x
        y = mixer.norm(y.reshape(*y.shape[:2], -1), gate)
        return mixer.out_proj(y.to(gate.dtype))

    def token_bytes(self, element_size: int) -> int:
        # Per token: the norm, projections, convolution, gates and gated norm (about 8
        # hidden- and 10 channel-sized vectors) and b, its product with the state, the
        # cotangents of the state (5 (I, N) arrays; the decays are per head).
        mixer = self.mixer
        return (8 * mixer.hidden_size + 10 * mixer.conv_dim + 5 * mixer.intermediate_size * mixer.ssm_state_size) * element_size
