"""Does the simulator agree with exact measurement? Tiny Llama, 2K-8K tokens, float32.

The same `run_training_steps` runs once on fake tensors and once on real CPU tensors;
the tracker counts live storages in both. Writes docs/results/simulator_agreement.{json,md}.
"""

from _report import write_report

from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.plan.simulate import run_training_steps

MiB = 2**20


def main() -> None:
    rows = []
    build = lambda: build_from_config(preset_config("tiny-llama"))  # noqa: E731
    for strategy in ("none", "checkpoint"):
        for seq_len in (2048, 4096, 8192):
            sim, _ = run_training_steps(build, seq_len=seq_len, strategy=strategy, fake=True)
            real, _ = run_training_steps(build, seq_len=seq_len, strategy=strategy, fake=False)
            rows.append({
                "strategy": strategy, "seq_len": seq_len,
                "simulated_mib": sim.peak_device_bytes / MiB, "measured_mib": real.peak_device_bytes / MiB,
                "difference_pct": 100 * (sim.peak_device_bytes - real.peak_device_bytes) / real.peak_device_bytes,
            })
    write_report(
        "simulator_agreement",
        "Simulated vs exactly measured peak (tiny Llama, CPU, float32, AdamW)",
        [("strategy", "strategy"), ("seq_len", "tokens"), ("simulated_mib", "simulated MiB"),
         ("measured_mib", "measured MiB"), ("difference_pct", "difference %")],
        rows,
        notes="Acceptance requires agreement within 2%. Both columns come from one code path, real vs fake tensors.",
        command="python benchmarks/simulator_agreement.py",
    )


if __name__ == "__main__":
    main()
