"""Model techniques. Each module registers one technique with :mod:`longtrain.registry`."""

from . import checkpoint  # noqa: F401  (registers "checkpoint")
from . import mst  # noqa: F401  (registers "mst")
from . import chunked_attention  # noqa: F401  (registers "attention")
