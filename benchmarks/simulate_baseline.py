"""Stock baseline: simulated steady-state peaks of Llama-3-8B at 8K/16K/32K tokens.

Layer checkpointing (the baseline later techniques are measured against) and plain
autograd for reference, with AdamW and with no optimizer; bf16 weights, gradients
and optimizer state; batch 1. Writes docs/results/baseline_llama3_8b.{json,md}.
"""

from _report import write_report

from longtrain.memory.units import gib
from longtrain.plan.simulate import simulate

GiB = 2**30


def main() -> None:
    rows = []
    for strategy in ("checkpoint", "none"):
        for optimizer in ("adamw", "none"):
            for seq_len in (8192, 16384, 32768):
                r = simulate("llama3-8b", seq_len, strategy=strategy, optimizer=optimizer, dtype="bfloat16")
                p = r.peak
                row = {
                    "strategy": strategy, "optimizer": optimizer, "seq_len": seq_len,
                    "peak_gib": gib(p.peak_device_bytes),
                    "parameters_gib": gib(p.device_bytes("parameters")),
                    "gradients_gib": gib(p.device_bytes("gradients")),
                    "optimizer_state_gib": gib(p.device_bytes("optimizer_state")),
                    "activations_gib": gib(p.device_bytes("activations")),
                    "temporaries_gib": gib(p.device_bytes("temporaries")),
                    "host_gib": gib(p.peak_host_bytes),
                    "fits_80gib": p.peak_device_bytes <= 80 * GiB,
                    "largest": f"{p.largest[0].origin or 'parameter'} {list(p.largest[0].shape)}" if p.largest else "",
                }
                rows.append(row)
                print(strategy, optimizer, seq_len, f"{row['peak_gib']:.2f} GiB", flush=True)
    write_report(
        "baseline_llama3_8b",
        "Stock baseline: Llama-3-8B simulated peak memory (bf16, batch 1)",
        [("strategy", "strategy"), ("optimizer", "optimizer"), ("seq_len", "tokens"), ("peak_gib", "device peak GiB"),
         ("parameters_gib", "params"), ("gradients_gib", "grads"), ("optimizer_state_gib", "optimizer state"),
         ("activations_gib", "activations"), ("temporaries_gib", "temporaries"), ("host_gib", "host GiB"),
         ("fits_80gib", "fits 80 GiB")],
        rows,
        notes="""
Steady-state peak of one training step (second iteration, so AdamW state exists), from
`longtrain simulate` on fake tensors: nothing is allocated. Categories are the bytes alive
at the device peak. Weights, gradients and AdamW moments are bf16 (8 bytes per parameter
in all); attention is an SDPA flash-style kernel (output + log-sum-exp saved, no s×s
scores); the optimizer step runs per parameter (fused AdamW on CUDA); allocator
fragmentation is not modelled. With AdamW the peak sits at the optimizer step or the
start of backward; without an optimizer it is set by activations and logits.
""",
        command="python benchmarks/simulate_baseline.py",
    )


if __name__ == "__main__":
    main()
