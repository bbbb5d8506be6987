"""A tour of the Python API: simulate before you run, then train a few steps.

    python examples/api_tour.py
"""

import torch

import longtrain as lt
from longtrain.memory import MemoryTracker
from longtrain.memory.units import format_bytes
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config

# 1. Will Llama-3-8B fit on an 80 GiB GPU at 16K tokens with layer checkpointing?
report = lt.simulate("llama3-8b", 16384, strategy="checkpoint", optimizer="adamw")
print(report.table())
print("fits on 80 GiB:", report.device_peak_bytes <= 80 * 2**30)

# 2. Train a tiny Llama with checkpointing, measuring each step's exact peak on CPU.
model = build_from_config(preset_config("tiny-llama"))
strategy = lt.Strategy(checkpoint=True)
lt.apply(model, strategy)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = [{"input_ids": torch.randint(0, 256, (2, 1024))} for _ in range(2)]  # two micro-batches
n_labels = sum(b["input_ids"][:, 1:].numel() for b in batches)  # label tokens of the whole step

with MemoryTracker(model, optimizer) as tracker:
    for step in range(3):
        tracker.reset_peak()
        loss = sum(lt.step(model, b, strategy, num_label_tokens=n_labels) for b in batches)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak = tracker.report()
        print(f"step {step}: loss {float(loss):.3f}, peak {format_bytes(peak.peak_device_bytes)} "
              f"(activations {format_bytes(peak.device_bytes('activations'))})")

# 3. Longer than the device holds: the fpdt engine (chunked attention) parks K/V and layer
#    inputs in host memory (exact gradients); the report shows what moved to the host.
long_strategy = lt.Strategy(engine="fpdt", engine_options=lt.FPDTOptions(chunk=512, offload=True), mst=lt.MsTOptions())
long_model = lt.apply(build_from_config(preset_config("tiny-llama")), long_strategy)
with MemoryTracker(long_model) as tracker:
    lt.step(long_model, {"input_ids": torch.randint(0, 256, (1, 4096))}, long_strategy)
    peak = tracker.report()
print(f"fpdt, 4,096 tokens: device peak {format_bytes(peak.peak_device_bytes)}, "
      f"host peak {format_bytes(peak.peak_host_bytes)}")

# 4. Chunk-wise engines: SeCO (exact) and SpaCO (about `budget` chunks backpropagated per
#    step, an unbiased estimate): the engine runs the chunks.
for engine, options in (("seco", {"chunk": 512}), ("spaco", {"chunk": 256, "budget": 4})):
    chunked = lt.Strategy(engine=engine, engine_options=options)
    chunk_model = lt.apply(build_from_config(preset_config("tiny-llama")), chunked)
    loss = lt.step(chunk_model, {"input_ids": torch.randint(0, 256, (1, 4096))}, chunked)
    print(f"{engine}: loss {float(loss):.3f}")

# 5. Packed documents: position ids that restart mark document boundaries; attention stays
#    inside each document on every engine.
packed = {"input_ids": torch.randint(0, 256, (1, 12)), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])}
print("packed batch loss:", float(lt.step(lt.apply(build_from_config(preset_config("tiny-llama")), lt.Strategy()), packed)))

# 6. On a GPU: layer checkpointing keeps attention's output in pinned host memory (backward
#    does not rerun attention), and `liger` adds Liger's fused norm/activation/rotary
#    kernels (pip install liger-kernel): together 0.99x HF + Liger's speed at 32K
#    tokens of Llama-3-8B on an H100, with exact-math gradients (docs/speed.md).
if torch.cuda.is_available():
    gpu_model = build_from_config(preset_config("tiny-llama"), torch.bfloat16).cuda()
    try:
        gpu_strategy = lt.Strategy(checkpoint=True, mst=True, liger=True)
        lt.apply(gpu_model, gpu_strategy)
    except lt.LongtrainError as why:  # liger-kernel not installed: the same without it
        print(why)
        gpu_model = lt.apply(build_from_config(preset_config("tiny-llama"), torch.bfloat16).cuda(),
                             gpu_strategy := lt.Strategy(checkpoint=True, mst=True))
    print("GPU loss:", float(lt.step(gpu_model, {"input_ids": torch.randint(0, 256, (1, 4096), device="cuda")}, gpu_strategy)))

# 7. Where the device has room, leave the top layers whole (nothing of theirs recomputed);
#    the planner sizes N for a card by simulation — here an 80 GB H100 at 16K tokens,
#    without optimizer state. `longtrain train --strategy auto` does the same on the card
#    it runs on.
from longtrain.plan.planner import PlanRequest, plan  # noqa: E402

sized = plan(PlanRequest("llama3-8b", 16384, device_memory=79 * 2**30, host_memory=62 * 2**30, optimizer="none"))
print(sized.verdict())
