"""Where tensors live and how much: measurement, simulation, offline placement.

The names below are imported on first use (PEP 562): the command line reads sizes and
token counts (``units``) before torch, which the tracker needs, is loaded.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "CATEGORIES": "tracker", "MemoryReport": "tracker", "MemoryTracker": "tracker",
    "host_allocations": "tracker", "mark_host_resident": "tracker",
    "format_bytes": "units", "parse_bytes": "units", "parse_tokens": "units",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
