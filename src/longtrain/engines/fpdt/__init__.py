"""The ``fpdt`` engine: layer-major chunked attention with host offload and prefetch (FPDT on
one device, exact). :mod:`.schedule` runs a step, :mod:`.costs` says what it parks,
copies and costs, :mod:`.options` holds its knobs."""

from ...registry import EngineSpec, register
from ..chunked.run import check_chunkable
from .costs import FPDTCosts, HostTraffic, host_traffic
from .options import FPDTOptions
from .schedule import backward_layer_major, forward_layer_major, fpdt_step

__all__ = ["FPDTOptions", "fpdt_step", "forward_layer_major", "backward_layer_major", "HostTraffic", "host_traffic", "SPEC"]

SPEC = register(EngineSpec(
    "fpdt", FPDTOptions, fpdt_step,
    "layer-major chunked attention with host offload and prefetch (FPDT on one device, exact)",
    accepts=("mst", "liger", "stream"),
    conflicts={"checkpoint": "the fpdt engine already recomputes every layer chunk by chunk; drop 'checkpoint'"},
    check=check_chunkable, sequence_parallel=True, costs=FPDTCosts()))
