"""The ``spaco`` engine: sparse chunk-wise optimization (backpropagates about ``budget``
chunks a step; unbiased). :mod:`.schedule` runs a step, :mod:`.costs` says what it costs,
:mod:`.options` holds its knobs."""

from ...registry import EngineSpec, register
from ..chunked.run import check_chunkable
from .costs import SpaCOCosts
from .options import SpaCOOptions
from .schedule import select_chunks, spaco_step

__all__ = ["SpaCOOptions", "select_chunks", "spaco_step", "SPEC"]

SPEC = register(EngineSpec(
    "spaco", SpaCOOptions, spaco_step, "sparse chunk-wise optimization: backprop ~budget chunks, unbiased",
    accepts=("checkpoint", "mst", "liger", "stream"), check=check_chunkable, sequence_parallel=True, costs=SpaCOCosts()))
