"""Mixed precision: float32 weights under bfloat16 autocast (what a Hugging Face Trainer
runs with ``bf16=True``). Attention takes its inputs in autocast's dtype, as stock SDPA
does under autocast — the rotary tables would otherwise leave q and k in float32 beside a
bfloat16 v — and every engine and technique trains as stock does, to bf16's precision."""

import pytest
import torch
from conftest import grads, padded_batch, stock_and_ours, stock_loss

import longtrain as lt

STRATEGIES = {
    "backprop": lambda: lt.Strategy(),
    "checkpoint,mst": lambda: lt.Strategy(checkpoint=True, mst=lt.MsTOptions(mlp_chunk=37)),
    "memo": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=0.5, keep_last=0, offload=False)),
    "fpdt,mst": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 40}, mst=True),
    "seco": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 40}),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_float32_weights_under_bfloat16_autocast(strategy):
    stock, ours = stock_and_ours("tiny-llama", dtype=torch.float32)
    batch = padded_batch(stock.config.vocab_size, lengths=(101, 80))
    lt.apply(ours, STRATEGIES[strategy]())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = stock_loss(stock, batch)
        reference.backward()
        loss = lt.step(ours, batch)
    assert float(loss) == pytest.approx(float(reference), rel=1e-4)
    ours_grads, stock_grads = grads(ours), grads(stock)
    error = max(float((ours_grads[k] - stock_grads[k]).norm() / stock_grads[k].norm()) for k in stock_grads)
    assert error < 2e-2, error  # bf16 rounding in a different order (stock: 0 against itself)
