"""CUDA runs autograd's backward — and with it checkpoint recomputation — on a device
thread of its own, not on the thread that ran the forward. The first GPU run found that
SeCO with checkpointing silently took the whole-sequence attention path there (the
active chunked run lived in a context variable). These tests run every backward on a
fresh thread, as CUDA does, and require stock autograd's gradients in float64."""

import threading

import pytest
import torch
from conftest import STRATEGIES, backward_on_another_thread, check_step, padded_batch, stock_and_ours

import longtrain as lt

THREADED = ["checkpoint", "checkpoint+mst", "fpdt", "fpdt+offload+mst", "fpdt+offload,kv-kept", "seco",
            "seco+checkpoint", "seco+offload+checkpoint+mst", "spaco(every chunk)",
            "memo+mst", "fpdt+offload,output-kept+mst"]


def test_the_helper_really_moves_backward_to_another_thread():
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()
    y.register_hook(lambda grad: seen.append(threading.get_ident()))
    with backward_on_another_thread():
        y.backward()
    assert seen and seen[0] != threading.get_ident()


@pytest.mark.parametrize("strategy", THREADED)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma2"])
def test_backward_on_another_thread_gives_stock_gradients(preset, strategy):
    stock, ours = stock_and_ours(preset)
    check_step(stock, ours, STRATEGIES[strategy](), padded_batch(stock.config.vocab_size, lengths=(100, 77)),
               another_thread=True)


def test_spaco_with_checkpointing_on_another_thread():
    stock, ours = stock_and_ours("tiny-qwen2")
    strategy = lt.Strategy(engine="spaco", engine_options={"chunk": 40, "budget": 8}, checkpoint=True, mst=True)
    check_step(stock, ours, strategy, padded_batch(stock.config.vocab_size, lengths=(100, 77)), another_thread=True)


@pytest.mark.parametrize("strategy", ["checkpoint+mst", "fpdt+offload+mst", "fpdt+offload,output-kept+mst",
                                      "seco+checkpoint"])
def test_attention_sinks_on_another_thread_give_stock_gradients(strategy):
    """gpt-oss's sinks (a per-head logit in every row's normaliser, with its own gradient)
    through whole-sequence, chunked and kept-output attention, backward on a fresh thread;
    its norms and router kept in float64 (:func:`longtrain.families.float64_throughout`)."""
    from longtrain.families import float64_throughout
    from longtrain.models.presets import preset_config

    config = preset_config("tiny-gpt-oss")
    config._experts_implementation = "eager"  # experts one by one: the grouped-matmul kernels take no float64
    stock, ours = stock_and_ours(config)
    with torch.no_grad():  # sinks away from their zero-mean initialisation
        for model in (stock, ours):
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    with float64_throughout():
        check_step(stock, ours, STRATEGIES[strategy](), padded_batch(config.vocab_size, lengths=(100, 77)),
                   another_thread=True)
    assert ours.model.layers[0].self_attn.sinks.grad.abs().min() > 0
