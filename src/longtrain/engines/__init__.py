"""Gradient engines. Each module registers one engine with :mod:`longtrain.registry`."""

from . import backprop  # noqa: F401  (registers "backprop")
from . import seco  # noqa: F401  (registers "seco" and "spaco")
from . import adjoint  # noqa: F401  (registers "adjoint")
