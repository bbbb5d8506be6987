"""PNG figures, with matplotlib's object API and Agg canvas (no display needed): a run's
``metrics.png`` — loss (and held-out loss), throughput and peak memory (on CUDA also the
allocator's reservation) per step, beside ``metrics.jsonl`` — and ``longtrain eval``'s
``eval.png``, whole-key accuracy by context length and needle depth."""

from __future__ import annotations

from pathlib import Path

from ..errors import writing

__all__ = ["plot_accuracy_map", "plot_available", "plot_metrics"]

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


def plot_accuracy_map(cells: list[dict], path: str | Path, title: str = "whole keys found") -> Path | None:
    """Write ``longtrain eval``'s cells to ``path`` (PNG) as a heat map: a column per length,
    a row per needle depth (0, the start of the context, at the top) and a row for the
    pass key below, each cell's whole-key accuracy in colour and percent. Returns None,
    writing nothing, when matplotlib is not installed."""
    if not plot_available():
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells if c["task"] == "needle"})
    rows = [[c for c in cells if c["task"] == "needle" and c["depth"] == d] for d in depths]
    labels = [f"{d:.2f}" for d in depths]
    if any(c["task"] == "passkey" for c in cells):
        rows.append([c for c in cells if c["task"] == "passkey"])
        labels.append("pass key")
    grid = [[next((c["accuracy"] for c in row if c["length"] == n), float("nan")) for n in lengths] for row in rows]
    figure = Figure(figsize=(2.2 + 1.0 * len(lengths), 1.4 + 0.45 * len(rows)), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if value == value:  # not NaN
                ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=9)
    if depths and len(rows) > len(depths):  # the pass key's row apart from the depths'
        ax.axhline(len(depths) - 0.5, color="white", lw=3)
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (0 = start)" if depths else "")
    samples = cells[0]["samples"] if cells else 0
    ax.set_title(f"{title} ({samples} samples per cell)", fontsize=10)
    figure.colorbar(image, ax=ax, fraction=0.05, format=lambda x, _: f"{x:.0%}")
    path = Path(path)
    with writing("the accuracy heat map", path):
        figure.savefig(path, dpi=100)
    return path
