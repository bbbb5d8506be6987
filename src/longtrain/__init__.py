"""longtrain: long-context training with bounded memory and exact gradients.

    import longtrain as lt
    model = lt.apply(model, lt.Strategy(checkpoint=True))
    loss = lt.step(model, batch)                      # forward + backward
    report = lt.simulate("llama3-8b", 32768, strategy="checkpoint")
"""

from .errors import LongtrainError
from .strategy import Strategy, apply, step
from .techniques.mst import MsT

__version__ = "0.1.0"


def simulate(*args, **kwargs):
    """See :func:`longtrain.memory.simulate.simulate`."""
    from .memory.simulate import simulate as _simulate

    return _simulate(*args, **kwargs)


__all__ = ["LongtrainError", "MsT", "Strategy", "apply", "simulate", "step", "__version__"]
