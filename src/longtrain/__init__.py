"""longtrain: long-context training with bounded memory and exact gradients.

    import longtrain as lt
    model = lt.apply(model, lt.Strategy(checkpoint=True))
    loss = lt.step(model, batch)                      # forward + backward
    report = lt.simulate("llama3-8b", 32768, strategy="checkpoint")
    lt.Strategy(mst=True, attention=lt.ChunkedAttention(chunk=4096, offload=True))
"""

from .errors import LongtrainError
from .strategy import Strategy, apply, step
from .techniques.chunked_attention import ChunkedAttention
from .techniques.mst import MsT

__version__ = "0.1.0"


def simulate(*args, **kwargs):
    """See :func:`longtrain.memory.simulate.simulate`."""
    from .memory.simulate import simulate as _simulate

    return _simulate(*args, **kwargs)


__all__ = ["ChunkedAttention", "LongtrainError", "MsT", "Strategy", "apply", "simulate", "step", "__version__"]
