"""Earlier public names kept importable: each warns once, naming its replacement."""

from __future__ import annotations

import warnings

_warned: set[tuple[str, str]] = set()


def renamed(module: str, namespace: dict, table: dict[str, str], name: str):
    """Module ``__getattr__`` body: the object now called ``table[name]``, with a
    ``FutureWarning`` the first time ``name`` is used; AttributeError for other names."""
    if name not in table:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = table[name]
    if (module, name) not in _warned:
        _warned.add((module, name))
        warnings.warn(f"{module}.{name} is now {new}; the old name will be removed", FutureWarning, stacklevel=3)
    return namespace[new]
