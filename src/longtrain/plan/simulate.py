"""Full-scale memory simulation: run real training steps on fake tensors.

The model is built from its config under ``FakeTensorMode`` (shapes and dtypes, no
storage), the strategy is applied, and forward + backward + optimizer step run for
two iterations so the optimizer state exists at the steady-state peak. The same
:class:`~longtrain.memory.tracker.MemoryTracker` that measures real CPU runs counts the
fake storages, so a simulated figure and an exact CPU measurement come from one code
path (:func:`run_training_steps` with ``fake=False``).

Assumptions, stated in every report: attention runs PyTorch SDPA (its fused kernels
keep the output and the log-sum-exp, never the s×s scores, on CPU and CUDA alike);
the optimizer step runs per parameter (as fused AdamW on CUDA) with state in the
parameter dtype; the CUDA caching allocator's fragmentation is not modelled.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch import nn
from transformers import PretrainedConfig

from ..errors import LongtrainError
from ..memory.plan import fragmentation_report
from ..memory.tracker import CATEGORIES, MemoryReport, MemoryTracker
from ..memory.units import format_bytes
from ..models.loading import build_from_config, default_dtype, load_config, parse_dtype
from ..optimizers import make_optimizer
from ..parallel.distributed import simulated_world
from ..strategy import Strategy, applied_context, apply, step

ASSUMPTIONS = (
    "attention: fused flash kernel, whole-sequence or per chunk (saves output + log-sum-exp, no s×s scores); "
    "optimizer: per-parameter step, state in parameter dtype; allocator fragmentation not modelled; "
    "under --sp: one rank's share, FSDP2's all-gather buffer counted, its gathered parameter copy not"
)


def run_training_steps(
    build_model: Callable[[], nn.Module],
    *,
    seq_len: int,
    batch_size: int = 1,
    strategy: Strategy | str | None = None,
    optimizer: str = "adamw",
    dtype: torch.dtype = torch.float32,
    iterations: int = 2,
    fake: bool = True,
    seed: int = 0,
    grad_accum: int = 1,
    trace: list | None = None,
) -> tuple[MemoryReport, int]:
    """Train ``iterations`` steps and report the last step's peak.

    ``grad_accum`` micro-batches per step: from the second on, the gradients of the
    earlier ones are alive during the forward pass, as in real accumulation. ``trace``:
    a list that receives the last step's device allocation trace (for the memory planner).

    ``build_model()`` must return a model (strategy not yet applied). With ``fake=True``
    everything runs on fake tensors; with ``fake=False`` it allocates for real, which
    is the exact CPU measurement. Returns (report, parameter count).
    """
    strategy = Strategy.parse(strategy)
    with contextlib.ExitStack() as stack:
        if strategy.sequence_parallel is not None:
            if not fake:
                raise LongtrainError("sequence parallelism is measured under torchrun, or simulated (fake=True)")
            stack.enter_context(simulated_world(strategy.sequence_parallel.degree))
        if fake:
            stack.enter_context(FakeTensorMode())
        stack.enter_context(default_dtype(dtype))
        torch.manual_seed(seed)
        model = build_model()
        apply(model, strategy)
        model.train()
        n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        vocab = model.config.vocab_size
        opt = make_optimizer(optimizer, model.parameters(), lr=1e-4)
        generator = None if fake else torch.Generator().manual_seed(seed)
        with MemoryTracker(model, opt) as tracker:
            for it in range(iterations):
                if it == iterations - 1:
                    tracker.reset_peak()
                for _ in range(grad_accum):
                    input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
                    # The label count is passed, not computed: under fake tensors it would
                    # need the data (every position but the last has a label here).
                    step(model, {"input_ids": input_ids}, strategy, num_label_tokens=grad_accum * batch_size * (seq_len - 1))
                    del input_ids
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
            report = tracker.report()
            if trace is not None:
                trace.extend(tracker.trace())
    return report, n_params


@dataclass
class SimulationReport:
    model: str
    seq_len: int
    batch_size: int
    strategy: dict
    optimizer: str
    dtype: str
    parameters: int
    peak: MemoryReport
    assumptions: str = ASSUMPTIONS
    fragmentation: Any = None  # a FragmentationReport when asked for
    notes: dict = field(default_factory=dict)  # what techniques chose (memo's alpha)

    @property
    def device_peak_bytes(self) -> int:
        return self.peak.peak_device_bytes

    def to_dict(self) -> dict:
        data = asdict(self)
        data["peak"] = self.peak.to_dict()
        return data

    def fragmentation_table(self) -> str:
        rows = [("device memory of the last step", "")] + self.fragmentation.rows()
        return format_table(rows) + (f"\n({self.fragmentation.blocks:,} tensors; offsets planned once for the "
                                     "recorded step, as Memo's memory planner does)")

    def table(self) -> str:
        """Device and host bytes by category at the device peak, plus the largest tensors."""
        rows = [("category", "device", "host")]
        for category in CATEGORIES:
            rows.append((category, format_bytes(self.peak.device_bytes(category)), format_bytes(self.peak.host_bytes(category))))
        rows.append(("total at device peak", format_bytes(self.peak.peak_device_bytes), format_bytes(self.peak.host_bytes_at_peak)))
        rows.append(("host peak", "", format_bytes(self.peak.peak_host_bytes)))
        strategy_name = Strategy.from_dict(self.strategy).name
        head = (
            f"{self.model}: {self.parameters / 1e9:.2f}B parameters, seq_len {self.seq_len}, batch {self.batch_size}, "
            f"strategy {strategy_name}, optimizer {self.optimizer}, {self.dtype}"
        )
        lines = [head, format_table(rows), "", "largest tensors at the device peak:"]
        for info in self.peak.largest:
            shape = "x".join(str(d) for d in info.shape)
            lines.append(f"  {format_bytes(info.nbytes):>12}  {info.category:<16} {info.location:<6} {info.dtype}[{shape}]  {info.origin}")
        for key, value in self.notes.items():
            lines.append(f"{key}: {value:.3g}" if isinstance(value, float) else f"{key}: {value}")
        if self.fragmentation is not None:
            lines += ["", self.fragmentation_table()]
        lines.append(f"assumes {self.assumptions}")
        return "\n".join(lines)


def format_table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def simulate(
    model: str | PretrainedConfig,
    seq_len: int,
    *,
    batch_size: int = 1,
    strategy: Strategy | str | None = None,
    optimizer: str = "adamw",
    dtype: str | torch.dtype = "bfloat16",
    lora_rank: int | None = None,
    iterations: int | None = None,
    grad_accum: int = 1,
    fragmentation: bool = False,
) -> SimulationReport:
    """Simulated steady-state peak of one training step at full scale (no allocation).

    ``model`` is a preset name (``"llama3-8b"``), a local model directory (only its
    config is read) or a ``PretrainedConfig``. ``iterations``: steps simulated (default
    2, so optimizer state exists at the peak; 1 suffices with ``optimizer="none"``).
    ``grad_accum``: micro-batches per step (gradients alive during later forwards).
    ``fragmentation``: also plan the last step's device memory offline
    (:func:`longtrain.memory.plan.fragmentation_report`).
    """
    if lora_rank:
        # peft moves new adapter weights with torch.utils.swap_tensors, which fake tensors
        # refuse (they carry weak references); until that is worked around, say so.
        raise LongtrainError("simulating LoRA is not supported yet; simulate full fine-tuning (an upper bound) instead")
    config = load_config(model)
    config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, seq_len)
    config.use_cache = False
    torch_dtype = parse_dtype(dtype)
    strategy = Strategy.parse(strategy)

    trace = [] if fragmentation else None
    built: list = []  # the model, for what its techniques noted (memo's alpha)

    def build():
        built.append(build_from_config(config, torch_dtype))
        return built[-1]

    report, n_params = run_training_steps(
        build, seq_len=seq_len, batch_size=batch_size, strategy=strategy, optimizer=optimizer, dtype=torch_dtype,
        iterations=iterations or (1 if optimizer == "none" else 2), grad_accum=grad_accum, trace=trace,
    )
    context = applied_context(built[0])
    notes = dict(context.notes) if context is not None else {}
    frag = fragmentation_report(trace) if fragmentation else None
    name = model if isinstance(model, str) else getattr(config, "name_or_path", "") or config.model_type
    return SimulationReport(
        model=name, seq_len=seq_len, batch_size=batch_size, strategy=strategy.to_dict(), optimizer=optimizer,
        dtype=str(torch_dtype).replace("torch.", ""), parameters=n_params, peak=report, fragmentation=frag,
        notes=notes,
    )
