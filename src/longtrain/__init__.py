"""longtrain: long-context training with bounded memory and exact gradients.

    import longtrain as lt
    model = lt.apply(model, lt.Strategy(checkpoint=True, mst=lt.MsT()))
    loss = lt.step(model, batch)                      # forward + backward
    report = lt.simulate("llama3-8b", 32768, strategy="checkpoint")
    lt.Strategy(engine="fpdt", engine_options=lt.FPDT(chunk=4096, offload=True), mst=True)
"""

from .engines.fpdt import FPDT
from .engines.seco import SeCOOptions, SpaCOOptions
from .engines.sequence_parallel import Ulysses
from .errors import LongtrainError
from .models.adapters import supported_families
from .strategy import Strategy, apply, step
from .techniques.memo import Memo
from .techniques.mst import MsT

__version__ = "0.2.0"


def simulate(*args, **kwargs):
    """See :func:`longtrain.plan.simulate.simulate`."""
    from .plan.simulate import simulate as _simulate

    return _simulate(*args, **kwargs)


def __getattr__(name: str):
    if name == "ChunkedAttention":  # renamed when chunked attention became an engine
        raise LongtrainError("longtrain.ChunkedAttention is now longtrain.FPDT, the options of the 'fpdt' engine: "
                             "Strategy(engine='fpdt', engine_options=FPDT(chunk=8192, offload=True))")
    raise AttributeError(f"module 'longtrain' has no attribute {name!r}")


__all__ = ["FPDT", "LongtrainError", "Memo", "MsT", "SeCOOptions", "SpaCOOptions", "Strategy", "Ulysses", "apply", "simulate",
           "step", "supported_families", "__version__"]
