"""The check's second pass: every dropout on, each strategy's gradient against a central
difference of the loss it reports (same seed). A recomputation that draws other random
numbers than its forward backpropagates another loss, and this shows it."""

from __future__ import annotations

import copy

import torch

from ..errors import LongtrainError
from .cases import DROPOUT, _padded, _strategies
from .result import _one_line

__all__ = ["directional_error", "dropout_errors"]

def _with_dropouts(config):
    """``config`` with every dropout but attention's (which is refused) and a router's jitter at :data:`DROPOUT`."""
    from ..models.adapters.base import _ATTENTION_DROPOUT_FIELDS

    config = copy.deepcopy(config)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key or "jitter" in key) and isinstance(value, float) \
                and key not in _ATTENTION_DROPOUT_FIELDS:
            setattr(config, key, DROPOUT)
    return config

def dropout_errors(config, state_dict: dict, strategies) -> dict:
    """Per strategy, with the model's dropouts and LoRA's ``lora_dropout`` on: the relative
    error of ⟨gradient, d⟩ against the derivative of the reported loss along a random
    direction d (:func:`directional_error`), on the right-padded batch; where a recomputation
    drew other numbers than its forward, the gradient belongs to another loss and this shows."""
    from .. import strategy as lt
    from ..models.loading import build_from_config

    model = build_from_config(copy.deepcopy(config), torch.float64)
    model.config._experts_implementation = "eager"
    model.load_state_dict(state_dict)
    model = _with_lora(model.train())
    makers, cells, batch = _strategies(), {}, _padded(False)
    draws = {seed: float(lt.step(copy.deepcopy(model), batch)) for seed in (1, 2) if torch.manual_seed(seed)}
    if draws[1] == draws[2]:
        return {name: "dropout: the model draws no random numbers with its dropouts on (is peft installed?)"
                for name in strategies}
    for name in strategies:
        o = copy.deepcopy(model)
        try:
            lt.apply(o, makers[name]())
            cells[name] = directional_error(o, batch)
        except LongtrainError as error:
            cells[name] = _one_line(error)
        except Exception as error:  # noqa: BLE001 - recorded as this cell's failure
            cells[name] = f"dropout: {_one_line(error)}"
    return cells

def _with_lora(model):
    """LoRA (rank 4, ``lora_dropout`` :data:`DROPOUT`, random B) on every linear layer of the
    decoder layers; the model as it is where peft is not installed."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return model
    names = sorted({name.rsplit(".", 1)[-1] for name, module in model.model.layers.named_modules()
                    if type(module) is torch.nn.Linear})
    if not names:
        return model
    torch.manual_seed(0)  # A's initialisation: the same adapters in every process
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=names, lora_dropout=DROPOUT))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model

def directional_error(model, batch, seed: int = 11, step: float = 1e-4) -> float:
    """|D − ⟨g, d⟩| / |⟨g, d⟩| for the gradient g a step leaves and a random unit direction
    d, D the derivative of the loss the step reports along d (the generators seeded alike
    for every evaluation): central differences at h and h/2, Richardson-extrapolated
    (error O(h⁴)). h is small because a mixture of experts' loss is piecewise smooth: a step that moves a
    token's top-k choice crosses a jump."""
    from .. import strategy as lt

    params = [p for p in model.parameters() if p.requires_grad]

    def loss_at(direction=None, t: float = 0.0) -> float:
        with torch.no_grad():
            for p, d in zip(params, direction or ()):
                p.add_(d, alpha=t)
        try:
            torch.manual_seed(seed)
            return float(lt.step(model, batch))
        finally:
            with torch.no_grad():
                for p, d in zip(params, direction or ()):
                    p.sub_(d, alpha=t)

    model.zero_grad(set_to_none=True)
    loss_at()
    gradient = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(5)
    direction = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in params]
    norm = sum(float(d.square().sum()) for d in direction) ** 0.5
    direction = [d / norm for d in direction]
    along = sum(float((g * d).sum()) for g, d in zip(gradient, direction))
    central = [(loss_at(direction, h) - loss_at(direction, -h)) / (2 * h) for h in (step, step / 2)]
    return abs((4 * central[1] - central[0]) / 3 - along) / max(abs(along), 1e-300)
