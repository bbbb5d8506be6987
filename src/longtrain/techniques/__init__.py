"""Model techniques: each patches modules of a model (never a schedule) and registers
itself with :mod:`longtrain.registry`."""

from . import checkpoint  # noqa: F401  (registers "checkpoint")
from . import mst  # noqa: F401  (registers "mst")
from . import memo  # noqa: F401  (registers "memo")
from . import liger  # noqa: F401  (registers "liger")
