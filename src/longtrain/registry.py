"""Registries of techniques and gradient engines.

A technique (layer checkpointing, mini-sequence MLP, chunked attention, ...) or an
engine (plain backprop, SeCO, ...) is added by writing one module that calls
:func:`register_technique` or :func:`register_engine`; nothing else in the tree needs
to change. The strategy looks names up here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from .errors import LongtrainError


@dataclass(frozen=True)
class Technique:
    """A model transformation installed by :func:`longtrain.apply`.

    ``options`` is a dataclass holding the technique's knobs (it may have no fields);
    ``install(model, options)`` patches the model in place; ``order`` fixes the install
    order when several techniques are combined (lower first).
    """

    name: str
    options: type
    install: Callable[[Any, Any], None]
    summary: str
    order: int = 100


@dataclass(frozen=True)
class Engine:
    """A gradient engine: ``step(model, batch, options, num_label_tokens) -> loss``.

    The engine runs forward and backward for one micro-batch, leaves gradients
    accumulated on the parameters and returns the detached loss, already divided by
    ``num_label_tokens``.
    """

    name: str
    options: type
    step: Callable[..., Any]
    summary: str
    check: Callable[[Any], None] | None = None  # check(model): refuse a model the engine cannot train


_TECHNIQUES: dict[str, Technique] = {}
_ENGINES: dict[str, Engine] = {}


def _check_options_class(options: type) -> None:
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"{options!r} must be a dataclass")


def register_technique(name: str, options: type, summary: str, order: int = 100):
    """Decorator registering ``install(model, options)`` as technique ``name``."""
    _check_options_class(options)

    def wrap(install):
        if name in _TECHNIQUES:
            raise ValueError(f"technique {name!r} is registered twice")
        _TECHNIQUES[name] = Technique(name, options, install, summary, order)
        return install

    return wrap


def register_engine(name: str, options: type, summary: str, check: Callable[[Any], None] | None = None):
    """Decorator registering ``step(model, batch, options, num_label_tokens)`` as an engine;
    ``check(model)``, if given, raises a clear error for models the engine cannot train
    (``longtrain.apply`` calls it, so the error comes before any work)."""
    _check_options_class(options)

    def wrap(step):
        if name in _ENGINES:
            raise ValueError(f"engine {name!r} is registered twice")
        _ENGINES[name] = Engine(name, options, step, summary, check)
        return step

    return wrap


def _load_builtins() -> None:
    # Importing the packages runs their registrations; done lazily to avoid cycles.
    from . import engines, techniques  # noqa: F401


def technique(name: str) -> Technique:
    _load_builtins()
    try:
        return _TECHNIQUES[name]
    except KeyError:
        raise LongtrainError(
            f"unknown technique {name!r}; available: {', '.join(sorted(_TECHNIQUES)) or 'none'}"
        ) from None


def engine(name: str) -> Engine:
    _load_builtins()
    try:
        return _ENGINES[name]
    except KeyError:
        raise LongtrainError(
            f"unknown engine {name!r}; available: {', '.join(sorted(_ENGINES))}"
        ) from None


def techniques() -> dict[str, Technique]:
    _load_builtins()
    return dict(_TECHNIQUES)


def engines() -> dict[str, Engine]:
    _load_builtins()
    return dict(_ENGINES)
