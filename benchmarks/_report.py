"""Write a benchmark's results as docs/<name>.json and docs/<name>.md."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"


def write_report(name: str, title: str, columns: list[tuple[str, str]], rows: list[dict], notes: str, command: str) -> None:
    """``columns`` pairs a row key with its header; ``rows`` hold the values."""
    DOCS.mkdir(exist_ok=True)
    meta = {"generated": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "machine": platform.machine(), "command": command}
    (DOCS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# {title}", "", notes.strip(), "", f"Reproduce: `{command}` (torch {torch.__version__}, {meta['generated']}).", ""]
    lines.append("| " + " | ".join(h for _, h in columns) + " |")
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[k]) for k, _ in columns) + " |")
    (DOCS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.2e}" if value and abs(value) < 0.01 else f"{value:.2f}"
    return str(value)
