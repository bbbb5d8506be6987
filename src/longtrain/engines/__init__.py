"""Gradient engines: each owns the schedule of a step's forward and backward. Each is a
package (options, schedule, costs) whose ``__init__`` registers its spec with
:mod:`longtrain.registry`; the chunked engines share :mod:`.chunked`."""

from . import adjoint, backprop, fpdt, seco, spaco  # noqa: F401  (each registers its engine)
