"""``longtrain calibrate``: measure the time model's rates on the machine at hand.

The planner predicts step time from a few rates (:class:`~longtrain.plan.time_model.MachineRates`);
built in: those fitted to the steps measured on one H100 and one H200. ``calibrate`` times each on this machine in
seconds — a linear layer's GEMMs and causal attention (whole and in blocks), each
forward and backward as a step runs them, an RMSNorm's elementwise kernels, pinned host
copies, the CPU's fused AdamW —
and stores them per device name, where ``plan --rates`` and ``--strategy auto`` read
them. Rates it cannot measure here (attention block kernels without a GPU, copies
without pinned memory, the fitted slow spots) keep the
built-in table of the card (the H200's on an H200, else the H100's) and are listed as such.
The built-in tables were fitted to whole steps and so absorb what the model does not count;
rates measured kernel by kernel do not, and predict somewhat faster steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from ..errors import LongtrainError
from ..models.description import stock_norm_bytes
from ..models.flops import device_peak_flops
from .time_model import BUILT_IN, MachineRates, built_in_for

__all__ = ["device_name", "load", "local_rates", "measure", "save", "store_dir"]


def store_dir() -> Path:
    """Where calibrations live: ``$LONGTRAIN_CACHE/rates`` or ``~/.cache/longtrain/rates``."""
    root = os.environ.get("LONGTRAIN_CACHE") or Path.home() / ".cache" / "longtrain"
    return Path(root) / "rates"


def device_name(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{os.cpu_count()}-cores"
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


def _timed(fn: Callable[[], None], device: torch.device, repeat: int) -> float:
    """Seconds per call of ``fn`` (after one warm-up call), measured with device events on CUDA."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def _forward_backward(forward: Callable[[], torch.Tensor], inputs: tuple) -> Callable[[], None]:
    """One forward and the backward to ``inputs`` (gradients returned, not accumulated)."""
    def run() -> None:
        out = forward()
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    return run


def measure(device: torch.device, *, quick: bool = False, say: Callable[[str], None] = lambda _: None) -> tuple[MachineRates, list[str]]:
    """The rates measured on ``device`` (and this host), and the names of those left at the
    card's built-in table."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    repeat = 3 if quick or not cuda else 10
    measured = {}

    # A linear layer at training shapes (tokens × hidden → MLP width), forward and both
    # backward GEMMs: the work the matmul rate is charged for.
    n = (8192 if cuda else 1024) // (4 if quick else 1)
    hidden, width = n // 2, n * 7 // 4
    x = torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(width, hidden, device=device, dtype=dtype, requires_grad=True)
    say(f"linear layer {n}×{hidden} → {width}, forward + backward ({dtype})")
    measured["matmul"] = 3 * 2 * n * hidden * width / _timed(_forward_backward(lambda: x @ w.T, (x, w)), device, repeat)

    # Attention forward + backward, counted as the time model counts it (causal: 2·w·s²
    # forward, 4·w·s² backward, w = heads × head dimension; a full block twice that).
    heads, head_dim = 32, 128
    s = (16384 if cuda else 1024) // (4 if quick else 1)
    q = torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    say(f"causal attention over {s:,} tokens, forward + backward")
    causal = _timed(_forward_backward(lambda: sdpa(q, q, q, is_causal=True), (q,)), device, repeat)
    measured["fused_attention"] = 6 * heads * head_dim * s * s / causal

    chunk = s // 4
    qc = q.detach()[:, :, :chunk].clone().requires_grad_()
    say(f"attention blocks of {chunk:,} × {chunk:,} tokens, forward + backward")
    block = _timed(_forward_backward(lambda: sdpa(qc, qc, qc), (qc,)), device, repeat)
    measured["block_attention"] = 12 * heads * head_dim * chunk * chunk / block
    # SeCO's blocks also merge partial results and accumulate a K/V gradient: the built-in ratio.
    base = built_in_for(device_name(device))[1]
    measured["chunkwise_attention"] = measured["block_attention"] * base.chunkwise_attention / base.block_attention
    # The chunked head's weight gradient (one GEMM per chunk, float32 out): the built-in ratio to matmul.
    measured["head_weight_grad"] = measured["matmul"] * base.head_weight_grad / base.matmul

    # An RMSNorm in PyTorch ops, forward + backward (a backward moving twice a forward's bytes,
    # as the time model counts every elementwise kernel).
    rows = (16384 if cuda else 2048) // (4 if quick else 1)
    h = torch.randn(rows, 4096, device=device, dtype=dtype, requires_grad=True)
    weight = torch.ones(4096, device=device, dtype=dtype)

    def norm() -> torch.Tensor:
        up = h.float()
        return weight * (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    say(f"RMSNorm over {rows:,} × 4,096, forward + backward")
    seconds = _timed(_forward_backward(norm, (h,)), device, repeat)
    measured["elementwise"] = 3 * stock_norm_bytes(h.element_size()) * h.numel() / seconds

    if cuda:
        host = torch.empty(256 * 2**20 // (4 if quick else 1), dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty_like(host, device=device)
        say("pinned host -> device copies")
        measured["host_bandwidth"] = host.numel() / _timed(lambda: on_device.copy_(host, non_blocking=True), device, repeat)

    count = 2**24 // (4 if quick else 1)
    params = [torch.zeros(count)]
    params[0].grad = torch.randn(count)
    adam = torch.optim.AdamW(params, lr=1e-4, fused=True)
    say(f"fused CPU AdamW over {count / 1e6:.0f}M parameters")
    measured["cpu_adam"] = count / _timed(adam.step, torch.device("cpu"), 3)

    # MFU's peak: the datasheet figure of a known GPU (H100, H200, ...: the trainer's and the
    # benchmarks' MFU use the same), else what this machine's GEMM reached.
    measured["peak"] = device_peak_flops(device) or measured["matmul"]
    rates = dataclasses.replace(base, **measured)
    kept = [f.name for f in dataclasses.fields(MachineRates) if f.name not in measured]
    return rates, kept


def save(rates: MachineRates, name: str, unmeasured: tuple[str, ...] | list[str] = ()) -> Path:
    """Store ``rates`` under ``name``, without the ``unmeasured`` fields (:func:`measure`'s
    second result): a later :func:`load` takes those from the defaults of its own version,
    so rates fitted together (per_chunk_layer with offload_exposed) are never mixed across
    versions."""
    path = store_dir() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({k: v for k, v in dataclasses.asdict(rates).items() if k not in unmeasured}, indent=2))
    os.replace(tmp, path)  # atomic: a reader sees the old calibration or the new one
    return path


def load(name_or_path: str) -> MachineRates:
    """A built-in table (``h100``, ``h200``), or a stored calibration by device name
    (``longtrain calibrate`` prints it) or JSON path; the rates a calibration did not measure
    come from the built-in table of its card."""
    if name_or_path.lower() in BUILT_IN:
        return BUILT_IN[name_or_path.lower()]
    path = Path(name_or_path)
    if not path.suffix:
        path = store_dir() / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in store_dir().glob("*.json")) if store_dir().is_dir() else []
        raise LongtrainError(f"no calibration {name_or_path!r} (looked for {path}); run `longtrain calibrate` on that "
                             f"machine, or use one of: {', '.join([*BUILT_IN, *known])}")
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not data:
            raise ValueError("no measured rate in it")
        return dataclasses.replace(built_in_for(path.stem)[1], **{k: float(v) for k, v in data.items()})
    except (ValueError, TypeError) as exc:
        raise LongtrainError(f"{path} is not a calibration written by `longtrain calibrate` ({exc}); run it again") from None


def local_rates(device: torch.device) -> tuple[str, MachineRates]:
    """(what a plan calls them, the rates): this machine's stored calibration under its device
    name, else the built-in table of its card (the H100's where none is built in for it)."""
    name = device_name(device)
    path = store_dir() / f"{name}.json"
    return (name, load(str(path))) if path.is_file() else built_in_for(name)
