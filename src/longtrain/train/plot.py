"""``metrics.png``: loss (and held-out loss), throughput and peak memory (on CUDA also the
allocator's reservation) per step, beside ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path

from ..errors import writing

PANELS = (  # (record key, axis label, scale)
    ("loss", "loss", 1.0),
    ("tokens_per_s", "tokens/s", 1.0),
    ("peak_bytes", "peak memory (MiB)", 1 / 2**20),
)


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_metrics(records: list[dict], path: str | Path) -> Path | None:
    """Write the step records' curves to ``path`` (PNG); held-out losses join the loss
    panel. Returns None, writing nothing, when matplotlib is not installed."""
    if not plot_available():
        return None
    # The object API with the Agg canvas: no pyplot state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [r for r in records if "loss" in r]
    held_out = [(r["step"], r["eval"]["loss"]) for r in records if isinstance(r.get("eval"), dict) and "loss" in r["eval"]]
    figure = Figure(figsize=(7, 7.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(PANELS), 1, sharex=True)
    for ax, (key, label, scale) in zip(axes, PANELS):
        points = [(r["step"], r[key] * scale) for r in steps if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), lw=1.2, label="train")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if held_out:
        axes[0].plot(*zip(*held_out), "o-", lw=1.2, label="held-out")
        axes[0].legend()
    reserved = [(r["step"], r["reserved_bytes"] / 2**20) for r in steps if isinstance(r.get("reserved_bytes"), (int, float))]
    if reserved:  # CUDA: the allocator's reservation, what runs out
        axes[-1].plot(*zip(*reserved), lw=1.2, ls="--", label="reserved")
        axes[-1].lines[0].set_label("allocated")
        axes[-1].legend()
    axes[-1].set_xlabel("step")
    path = Path(path)
    with writing("the metrics plot", path):
        figure.savefig(path, dpi=100)
    return path
