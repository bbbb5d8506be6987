"""Where tensors live and how much: measurement, simulation, FLOPs."""

from .tracker import CATEGORIES, MemoryReport, MemoryTracker, host_allocations, mark_host_resident  # noqa: F401
from .units import format_bytes, parse_bytes, parse_tokens  # noqa: F401
