"""Adjoint sharding on an SSM-ResNet: check the gradient, compare memory, plan a run.

    python examples/ssm_adjoint.py

On several processes (layer groups; gloo on CPU, NCCL on GPUs):

    torchrun --nproc-per-node 2 -m longtrain.cli train --model ssm-demo --engine adjoint --seq-len 8K
"""

import torch

import longtrain as lt
from longtrain.engines.adjoint import AdjointStats, adjoint_step
from longtrain.memory import MemoryTracker
from longtrain.memory.units import format_bytes
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.strategy import engine_context

# 1. The adjoint engine's gradient is autograd's (float64, a 3-layer SSM, batch 2).
torch.manual_seed(0)
model = build_from_config(preset_config("tiny-ssm"), torch.float64)
batch = {"input_ids": torch.randint(0, 320, (2, 300))}
lt.step(model, batch)  # plain backprop through the scan
reference = {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad(set_to_none=True)
stats = AdjointStats()
adjoint_step(engine_context(model, lt.Strategy(engine="adjoint")), batch, stats=stats)  # one step, with its counts
error = max(float((p.grad - reference[n]).norm() / reference[n].norm()) for n, p in model.named_parameters())
print(f"adjoint vs autograd: max relative error {error:.1e} over {len(reference)} tensors; "
      f"{stats.token_vjps} token VJPs in {stats.vjp_calls} batched calls")

# 2. Truncated adjoint sharding (T̄ = 32) is an approximation: how far is it?
model.zero_grad(set_to_none=True)
adjoint_step(engine_context(model, lt.Strategy(engine="adjoint", engine_options={"truncate": 32})), batch)
error = max(float((p.grad - reference[n]).norm() / reference[n].norm()) for n, p in model.named_parameters())
print(f"truncated (T̄=32) vs exact: max relative difference {error:.1e}")

# 3. Memory of one step at 16K tokens, measured exactly on CPU.
for name, strategy in (("backprop", lt.Strategy()), ("adjoint", lt.Strategy(engine="adjoint"))):
    model = lt.apply(build_from_config(preset_config("ssm-demo")), strategy)
    with MemoryTracker(model) as tracker:
        lt.step(model, {"input_ids": torch.randint(0, 256, (1, 16384))}, strategy)
        print(f"{name:>9}: peak {format_bytes(tracker.report().peak_device_bytes)}")

# 4. Before renting a GPU: does the 1.27B preset fit at 64K tokens on 80 GiB?
report = lt.simulate("ssm-1.27b", 65536, strategy=lt.Strategy(engine="adjoint"))
print(f"ssm-1.27b, 64K tokens, adjoint: {format_bytes(report.device_peak_bytes)} "
      f"(fits on 80 GiB: {report.device_peak_bytes <= 80 * 2**30})")
