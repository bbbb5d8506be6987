"""Gradient engines: each owns the schedule of a step's forward and backward. Each
module registers one engine (or two) with :mod:`longtrain.registry`."""

from . import backprop  # noqa: F401  (registers "backprop")
from . import fpdt  # noqa: F401  (registers "fpdt")
from . import seco  # noqa: F401  (registers "seco" and "spaco")
from . import adjoint  # noqa: F401  (registers "adjoint")
