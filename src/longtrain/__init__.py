"""longtrain: long-context training with bounded memory and exact gradients.

    import longtrain as lt
    model = lt.apply(model, lt.Strategy(checkpoint=True, mst=lt.MsTOptions()))
    loss = lt.step(model, batch)                      # forward + backward
    report = lt.simulate("llama3-8b", 32768, strategy="checkpoint")
    lt.Strategy(engine="fpdt", engine_options=lt.FPDTOptions(chunk=4096, offload=True), mst=True)
"""

from __future__ import annotations

import importlib

from .errors import LongtrainError

__version__ = "0.2.0"

# The public names and the modules that define them. They are imported on first use
# (PEP 562), so `import longtrain` — and every command line start, `--help` included —
# does not pay for torch and transformers until something needs them.
_LAZY = {
    "FPDTOptions": "engines.fpdt",
    "SeCOOptions": "engines.seco",
    "SpaCOOptions": "engines.spaco",
    "UlyssesOptions": "engines.sequence_parallel",
    "supported_families": "models.adapters",
    "Strategy": "strategy",
    "apply": "strategy",
    "step": "strategy",
    "router_aux_loss": "strategy",
    "CheckpointOptions": "techniques.checkpoint",
    "LigerOptions": "techniques.liger",
    "MemoOptions": "techniques.memo",
    "MsTOptions": "techniques.mst",
    "StreamOptions": "techniques.stream",
}


def simulate(model, seq_len, *args, **kwargs):
    """See :func:`longtrain.plan.simulate.simulate`; ``seq_len`` may also be written
    like the command line's ``--seq-len`` (``"4K"``, ``"1M"``)."""
    from .memory.units import parse_tokens
    from .plan.simulate import simulate as _simulate

    if isinstance(seq_len, str):
        seq_len = parse_tokens(seq_len)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise LongtrainError(f"simulate's seq_len must be an integer of at least 2 or a count like '64K', got {seq_len!r}")
    return _simulate(model, seq_len, *args, **kwargs)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name == "ChunkedAttention":  # a deprecated name: chunked attention is the fpdt engine
        raise LongtrainError("longtrain.ChunkedAttention is now longtrain.FPDTOptions, the options of the 'fpdt' engine: "
                             "Strategy(engine='fpdt', engine_options=FPDTOptions(chunk=8192, offload=True))")
    try:  # a submodule not imported yet (lt.registry, lt.plan, ...)
        module = importlib.import_module(f"{__name__}.{name}")
        if name == "registry":  # its tables fill as the built-in engines and techniques are imported
            importlib.import_module(f"{__name__}.strategy")
        return module
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'longtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["LongtrainError", "simulate", "__version__", *_LAZY]
