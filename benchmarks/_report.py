"""Write a benchmark's results as docs/results/<name>.json and docs/results/<name>.md."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs" / "results"  # generated output; docs/ holds the written pages


def write_report(name: str, title: str, columns: list[tuple[str, str]], rows: list[dict], notes: str, command: str,
                 out_dir: Path | None = None, meta: dict | None = None, quiet: bool = False) -> None:
    """``columns`` pairs a row key with its header; ``rows`` hold the values. Written to
    docs/results/ (or ``out_dir``); ``meta`` adds fields (the device, versions) to the JSON."""
    out = Path(out_dir) if out_dir is not None else DOCS
    out.mkdir(parents=True, exist_ok=True)
    meta = {"generated": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "machine": platform.machine(), "command": command,
            **(meta or {})}
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# {title}", "", notes.strip(), "", f"Reproduce: `{command}` (torch {torch.__version__}, {meta['generated']}).", ""]
    lines.append("| " + " | ".join(h for _, h in columns) + " |")
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[k]) for k, _ in columns) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.2e}" if value and abs(value) < 0.01 else f"{value:.2f}"
    return str(value)


def median_step_times(models: dict, batch: dict, repeats: int) -> dict:
    """Median forward + backward time of each model on ``batch``, all alternated round by
    round in one run (the first round warms up), so machine noise falls on all alike."""
    import statistics

    import longtrain as lt

    times = {key: [] for key in models}
    for _ in range(repeats + 1):
        for key, model in models.items():
            t0 = time.perf_counter()
            lt.step(model, batch)
            times[key].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    return {key: statistics.median(t[1:]) for key, t in times.items()}


def plot_series(ax, rows: list[dict], group: str, x: str, y: str) -> None:
    """One line per value of ``rows[group]``, in order of first appearance."""
    for name in dict.fromkeys(r[group] for r in rows):
        mine = [r for r in rows if r[group] == name]
        ax.plot([r[x] for r in mine], [r[y] for r in mine], marker="o", label=name)
