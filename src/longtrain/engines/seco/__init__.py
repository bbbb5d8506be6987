"""The ``seco`` engine: sequential chunk-wise optimization (exact; the activations of one
chunk, K/V parked). :mod:`.schedule` runs a step, :mod:`.costs` says what it costs,
:mod:`.options` holds its knobs."""

from ...registry import EngineSpec, register
from ..chunked.run import check_chunkable
from .costs import SeCOCosts
from .options import SeCOOptions
from .schedule import backward_chunk_major, forward_chunk_major, seco_step

__all__ = ["SeCOOptions", "seco_step", "forward_chunk_major", "backward_chunk_major", "SPEC"]

SPEC = register(EngineSpec(
    "seco", SeCOOptions, seco_step, "sequential chunk-wise optimization: exact, activations of one chunk (K/V parked)",
    accepts=("checkpoint", "mst", "liger", "stream"), check=check_chunkable, sequence_parallel=True, costs=SeCOCosts()))
