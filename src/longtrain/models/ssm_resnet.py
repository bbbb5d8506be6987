"""SSM-ResNet: a causal LM made of residual selective diagonal state-space layers.

The architecture of the adjoint sharding paper (§3), as a Hugging Face model (config + ``PreTrainedModel``, registered with the Auto
classes, so it saves, loads and trains like any other). Layer k reads the residual
stream z_{k−1}, normalizes it (u = RMSNorm(z)), and for every token t

    A^t = sigmoid(W_a u^t + b_a)                 decay network (diagonal, in (0, 1))
    B^t x^t = (1 − A^t) ⊙ W_b u^t                input network
    c^t = W_c u^t,  C^t = W_o diag(c^t)          readout network
    h^t = A^t ⊙ h^{t−1} + B^t x^t,  h^0 = 0
    z_k^t = z_{k−1}^t + C^t h^t

Under half precision A, B x and h are float32. The (1 − A) factor keeps the state on
the scale of the inputs however long the memory. Padding positions (attention mask 0) leave the state untouched (A = 1,
B x = 0), so left padding does not leak into the state.

Two forwards compute the same thing: the parallel one runs the recurrence with
:func:`~longtrain.ops.linear_scan.diagonal_recurrence` (log-depth scan, adjoint
backward); ``scan_implementation="sequential"`` is the reference, a Python loop over
time that autograd differentiates step by step. :meth:`SSMLayer.maps` and
:meth:`SSMLayer.readout` are the token-wise maps whose vector-Jacobian products the
``adjoint`` engine takes.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from ..ops.linear_scan import diagonal_recurrence
from ..ops.loss import IGNORE_INDEX, causal_lm_loss, shift_labels

__all__ = ["SSMLayer", "SSMResNetConfig", "SSMResNetForCausalLM"]

MODEL_TYPE = "ssm_resnet"


class SSMResNetConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        state_size: int = 512,
        num_hidden_layers: int = 8,
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        decay_min: float = 0.9,
        decay_max: float = 0.999,
        scan_implementation: str = "parallel",
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if scan_implementation not in ("parallel", "sequential"):
            raise ValueError(f"scan_implementation must be 'parallel' or 'sequential', got {scan_implementation!r}")
        if not 0 < decay_min <= decay_max < 1:
            raise ValueError(f"need 0 < decay_min <= decay_max < 1, got {decay_min}, {decay_max}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.state_size = state_size
        self.num_hidden_layers = num_hidden_layers
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.decay_min = decay_min
        self.decay_max = decay_max
        self.scan_implementation = scan_implementation
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class SSMRMSNorm(nn.Module):
    """RMSNorm in the input dtype (half precision upcast to float32), so float64 runs stay float64."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SSMLayer(nn.Module):
    def __init__(self, config: SSMResNetConfig):
        super().__init__()
        p, n = config.hidden_size, config.state_size
        self.norm = SSMRMSNorm(p, config.rms_norm_eps)
        self.decay_proj = nn.Linear(p, n)  # A network
        self.decay_proj.decay_range = (config.decay_min, config.decay_max)  # read by _init_weights
        self.input_proj = nn.Linear(p, n, bias=False)  # B network
        self.readout_proj = nn.Linear(p, n, bias=False)  # C network (selective part)
        self.out_proj = nn.Linear(n, p, bias=False)  # C network (shared part)
        self.sequential = config.scan_implementation == "sequential"

    def maps(self, z: torch.Tensor, mask: torch.Tensor | None = None):
        """Token-wise (A^t, B^t x^t, c^t) from the residual stream z (..., P)."""
        u = self.norm(z)
        # Decays and states stay in float32 under half precision: bfloat16 rounds a
        # decay of 0.999 to 1 (its spacing below 1 is 2^-8), losing every memory longer
        # than ~256 tokens.
        state_dtype = torch.float32 if u.dtype in (torch.float16, torch.bfloat16) else u.dtype
        a = torch.sigmoid(self.decay_proj(u).to(state_dtype))
        b = (1 - a) * self.input_proj(u).to(state_dtype)
        c = self.readout_proj(u)
        if mask is not None:  # padding keeps the state: A = 1, B x = 0
            keep = mask[..., None].to(a.dtype)
            a = a * keep + (1 - keep)
            b = b * keep
        return a, b, c

    def readout(self, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The layer output C^t h^t (in the model's dtype)."""
        return self.out_proj(c * h.to(c.dtype))

    def states(self, z: torch.Tensor, mask: torch.Tensor | None = None):
        """(A, c, h) over a (batch, time, P) sequence."""
        a, b, c = self.maps(z, mask)
        if self.sequential:
            h, steps = torch.zeros_like(b[:, 0]), []
            for t in range(b.shape[1]):
                h = a[:, t] * h + b[:, t]
                steps.append(h)
            return a, c, torch.stack(steps, 1)
        return a, c, diagonal_recurrence(a, b)

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        _, c, h = self.states(z, mask)
        return z + self.readout(c, h)


class SSMResNetPreTrainedModel(PreTrainedModel):
    config_class = SSMResNetConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SSMLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            decay_range = getattr(module, "decay_range", None)
            if decay_range is None:
                module.bias.zero_()
            else:
                # Decays spread log-uniformly in memory length 1/(1 − A), from
                # 1/(1 − decay_min) to 1/(1 − decay_max) tokens, as S4/Mamba initialize.
                lo, hi = (-math.log(1 - d) for d in decay_range)
                memory = torch.exp(torch.linspace(lo, hi, module.bias.shape[0], dtype=torch.float64))
                module.bias.copy_(torch.logit(1 - 1 / memory).to(module.bias.dtype))
        if isinstance(module, SSMRMSNorm):
            module.weight.fill_(1.0)


class SSMResNetModel(SSMResNetPreTrainedModel):
    def __init__(self, config: SSMResNetConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SSMLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = SSMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs) -> BaseModelOutput:
        z = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                z = torch.utils.checkpoint.checkpoint(layer, z, attention_mask, use_reentrant=False)
            else:
                z = layer(z, attention_mask)
        return BaseModelOutput(last_hidden_state=self.norm(z))


class SSMResNetForCausalLM(SSMResNetPreTrainedModel, GenerationMixin):
    """The LM. ``generate`` works but keeps no recurrent state between steps (no cache
    yet): each new token reruns the sequence."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SSMResNetConfig):
        super().__init__(config)
        self.model = SSMResNetModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, labels=None, inputs_embeds=None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutput:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds).last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, (shift_labels(labels) != IGNORE_INDEX).sum().clamp(min=1))
        return CausalLMOutput(loss=loss, logits=logits)


AutoConfig.register(MODEL_TYPE, SSMResNetConfig, exist_ok=True)
AutoModelForCausalLM.register(SSMResNetConfig, SSMResNetForCausalLM, exist_ok=True)
