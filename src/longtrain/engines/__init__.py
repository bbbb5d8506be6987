"""Gradient engines: each owns the schedule of a step's forward and backward. Each is a
package (options, schedule, costs) whose ``__init__`` registers its spec with
:mod:`longtrain.registry`; the chunked engines share :mod:`.chunked`."""

from . import backprop  # noqa: F401
from . import fpdt  # noqa: F401
from . import seco  # noqa: F401
from . import spaco  # noqa: F401
from . import adjoint  # noqa: F401
