"""One family's check: the tiny model against stock autograd under every strategy, then
with every dropout on (:mod:`.dropout`)."""

from __future__ import annotations

import contextlib
import copy
import time

import torch
import torch.nn.functional as F

from ..errors import LongtrainError
from .cases import (
    BATCHES,
    FD_TOLERANCE,
    MASKS_WITHOUT_POSITIONS,
    ROUTER_AUX_LOSS_COEF,
    STRATEGIES,
    TOLERANCE,
    _strategies,
    tiny_config,
)
from .dropout import _with_dropouts, dropout_errors
from .float64 import float64_throughout
from .result import FamilyResult, _finish, _is_refusal, _one_line

__all__ = ["check_family"]

def _stock_loss(model, batch) -> torch.Tensor:
    """Stock's loss: the mean next-token cross-entropy, plus ``coef · aux_loss`` where the
    model returns a router load-balancing loss (as its own loss adds it)."""
    if "position_ids" in batch and model.config.model_type in MASKS_WITHOUT_POSITIONS:
        logits, aux = _with_document_masks(model, batch)
    else:
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    position_ids=batch.get("position_ids"), use_cache=False)
        logits, aux = out.logits, getattr(out, "aux_loss", None)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    if aux is not None:
        loss = loss + model.config.router_aux_loss_coef * aux
    return loss

def _with_document_masks(model, batch) -> tuple:
    """(logits, router balancing loss or None) of a packed batch (no padding), the model's
    masks built with the position ids — each document attending only to itself — and handed
    to its decoder prepared; the balancing loss as the model's own forward computes it."""
    import sys

    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config, ids = model.config, batch["input_ids"]
    settings = dict(config=config, inputs_embeds=model.get_input_embeddings()(ids), attention_mask=None, cache=None,
                    position_ids=batch["position_ids"])
    masks = {"full_attention": create_causal_mask(**settings), "sliding_attention": create_sliding_window_causal_mask(**settings)}
    out = model.model(input_ids=ids, attention_mask=masks, position_ids=batch["position_ids"], use_cache=False,
                      output_router_logits=config.output_router_logits)
    aux = None
    if config.output_router_logits:
        from ..models.adapters import describe_model

        experts = next(f for f in describe_model(config).feed_forward if f.is_moe)
        balance = sys.modules[type(model).__module__].load_balancing_loss_func
        aux = balance(out.router_logits, experts.experts, experts.active, None)
    return model.lm_head(out.last_hidden_state), aux


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

def _relative_error(loss, ref, ours: dict, stock: dict) -> float:
    if ours.keys() != stock.keys() or not ours:
        return float("inf")
    error = abs(float(loss) - float(ref)) / abs(float(ref))
    for name, g in ours.items():
        error = max(error, float((g - stock[name]).norm() / stock[name].norm().clamp_min(1e-300)))
    return error

def _build_pair(config):
    """The stock model (SDPA, or eager where logits are soft-capped or the model has no
    SDPA path, as gpt-oss's sinks) and longtrain's build, with identical float64 weights."""
    from transformers import AutoModelForCausalLM

    from ..models.attention import stock_attention
    from ..models.loading import build_from_config, default_dtype

    # Experts one by one: the grouped-matmul kernels take no float64.
    stock_kwargs = {"attn_implementation": stock_attention(config), "experts_implementation": "eager"}
    ours = build_from_config(copy.deepcopy(config), torch.float64)
    ours.config._experts_implementation = "eager"
    with default_dtype(torch.float64):
        torch.manual_seed(0)
        stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), **stock_kwargs)
    ours.load_state_dict(stock.state_dict())
    return stock.train(), ours.train()

def check_family(family: str, strategies: tuple[str, ...] = STRATEGIES, dropout: bool = True,
                 dropout_strategies: tuple[str, ...] | None = None,
                 batches: tuple[str, ...] | None = None) -> FamilyResult:
    """Build ``family`` tiny and compare every strategy with stock autograd on ``batches``
    (default: every one of :data:`BATCHES`; see the module); with ``dropout``, a second pass
    checks each of ``dropout_strategies`` (default: every strategy; backprop's always, it
    sets the tolerance) against the derivative of its reported loss with every dropout on
    (:func:`dropout_errors`)."""
    from ..models.adapters import base as adapters

    started = time.perf_counter()
    registered = family in adapters.supported_families()
    result = FamilyResult(family, "exact", adapters.adapter_class(family).__name__ if registered else None)
    if registered and not adapters.adapter_class(family).has_attention:
        return _finish(result, "attention-free", "an SSM: its engines are proven in tests/test_mamba.py, "
                                                 "tests/test_mamba2.py and tests/test_adjoint.py", started)
    try:
        config = tiny_config(family)
        if getattr(config, "output_router_logits", None) is not None:  # a mixture of experts: its balancing loss on
            config.output_router_logits, config.router_aux_loss_coef = True, ROUTER_AUX_LOSS_COEF
        stock, ours = _build_pair(config)
        if registered:
            adapters.adapter_for(ours)  # the family's own checks refuse here, in one line
    except LongtrainError as error:
        return _finish(result, "refused", _one_line(error), started)
    except Exception as error:  # noqa: BLE001 - a family transformers cannot build tiny is reported, not raised
        return _finish(result, "not built", _one_line(error), started)
    with _registered_as_llama(family, registered), float64_throughout():
        result.cells = _stock_errors(stock, ours, strategies, batches or tuple(BATCHES))
        if dropout:
            chosen = strategies if dropout_strategies is None else \
                tuple(s for s in strategies if s == "backprop" or s in dropout_strategies)
            try:
                result.dropout = dropout_errors(_with_dropouts(config), ours.state_dict(), chosen)
            except MemoryError:
                raise
            except Exception as error:  # noqa: BLE001 - a family without an adapter the Llama one cannot run
                if registered:
                    raise
                result.dropout = {"backprop": f"dropout pass: {_one_line(error)}"}
            floor = result.dropout.get("backprop")
            if isinstance(floor, float):
                result.dropout_tolerance = max(FD_TOLERANCE, 10 * floor)
    exact = [v for v in result.cells.values() if isinstance(v, float)]
    failures = [v for v in result.cells.values() if isinstance(v, str) or v > TOLERANCE]
    failures += [v for v in result.dropout.values() if isinstance(v, str) and not _is_refusal(v) or
                 isinstance(v, float) and v > result.dropout_tolerance]
    if failures and not exact:
        return _finish(result, "refused", str(failures[0]) if registered else _outside_llama_layout(ours, str(failures[0])),
                       started)
    if any(isinstance(v, float) and v > TOLERANCE or isinstance(v, str) and not _is_refusal(v) for v in failures):
        return _finish(result, "inexact", None, started)
    return _finish(result, "exact", None, started)

def _stock_errors(stock, ours, strategies, batches) -> dict:
    """Per strategy, its worst relative error against stock over ``batches`` (names of
    :data:`BATCHES`; stock's loss and gradients computed once per batch), or the line it
    failed with."""
    from .. import strategy as lt

    references = {}
    for batch_name in batches:
        make_batch = BATCHES[batch_name]
        s = copy.deepcopy(stock)
        batch = make_batch()
        ref = _stock_loss(s, batch)
        ref.backward()
        references[batch_name] = batch, ref.detach(), _grads(s)
    makers, cells = _strategies(), {}
    for name in strategies:
        worst = 0.0
        o = copy.deepcopy(ours)  # one model steps every batch, as training does (state kept between steps)
        for batch_name, (batch, ref, stock_grads) in references.items():
            try:
                lt.apply(o, makers[name]())
                o.zero_grad(set_to_none=True)
                loss = lt.step(o, batch)
                worst = max(worst, _relative_error(loss, ref, _grads(o), stock_grads))
                _check_mlp_output_reading(o)
            except LongtrainError as error:
                worst = _one_line(error)
                break
            except Exception as error:  # noqa: BLE001 - recorded as this cell's failure
                worst = f"{batch_name}: {_one_line(error)}"
                break
        cells[name] = worst
    return cells

def _check_mlp_output_reading(model) -> None:
    """Where FPDT learned whether a layer's MLP output is saved after the MLP (its first
    recomputation), the adapter's reading for the time model must agree."""
    from ..engines.fpdt.schedule import _UNREAD_MLP_OUTPUTS
    from ..models.adapters import adapter_for

    adapter = adapter_for(model)
    learned = {_UNREAD_MLP_OUTPUTS.learned(layer) for layer in adapter.layers} - {None}
    told = adapter.mlp_output_saved(adapter.config)
    if learned and learned != {not told}:
        raise RuntimeError(f"the adapter's mlp_output_saved says {told}, the layers' graphs say "
                           f"{sorted(not safe for safe in learned)}")


def _outside_llama_layout(model, failure: str) -> str:
    """Why a family without an adapter is refused when the Llama-layout one cannot run it."""
    return f"no adapter; the Llama-layout adapter could not run it ({type(model).__name__}): {failure}"


@contextlib.contextmanager
def _registered_as_llama(family: str, registered: bool):
    """A family without an adapter, tried with the Llama-layout one for the length of the check."""
    from ..models.adapters import base as adapters

    if registered:
        yield
        return
    adapters._ADAPTERS[family] = adapters.DecoderAdapter
    try:
        yield
    finally:
        adapters._ADAPTERS.pop(family, None)
