"""Model techniques: each patches modules of a model (never a schedule) and registers
itself with :mod:`longtrain.registry`."""

from . import checkpoint, liger, memo, mst, stream  # noqa: F401  (each registers its technique)
