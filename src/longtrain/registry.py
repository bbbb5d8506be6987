"""Registries of techniques and gradient engines.

A technique (layer checkpointing, mini-sequence MLP, ...) or an engine (plain backprop,
FPDT, SeCO, ...) is added by writing one module that calls :func:`register_technique`
or :func:`register_engine` and importing it from its package's ``__init__``; nothing
else in the tree needs to change. The strategy (which imports those packages) looks
names up here. This module imports neither, so the import graph has no cycle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import LongtrainError


@dataclass(frozen=True)
class Technique:
    """A model transformation installed by :func:`longtrain.apply`.

    ``options`` is a dataclass holding the technique's knobs (it may have no fields);
    ``install(context, options)`` patches the model's modules in place (the
    :class:`~longtrain.engines.base.EngineContext` gives the model's adapter and the
    whole strategy, for defaults that depend on the engine); ``order`` fixes the install
    order when several techniques are combined (lower first); ``excludes`` maps the
    techniques it cannot be combined with to the reason. Techniques patch modules;
    they never run a schedule.
    """

    name: str
    options: type
    install: Callable[[Any, Any], None]
    summary: str
    order: int = 100
    excludes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Engine:
    """A gradient engine: ``step(context, batch, num_label_tokens) -> loss``.

    The engine runs forward and backward for one micro-batch, leaves gradients
    accumulated on the parameters and returns the detached loss, already divided by
    ``num_label_tokens``. ``accepts`` names the techniques it composes with (a strategy
    naming another is refused when it is built, with ``conflicts``' reason where one is
    given); ``check(context)``, if given, refuses a model the engine cannot train when
    the strategy is applied; ``sequence_parallel``: the engine runs under Ulysses.
    """

    name: str
    options: type
    step: Callable[..., Any]
    summary: str
    accepts: tuple[str, ...] = ()
    conflicts: dict[str, str] = field(default_factory=dict)
    check: Callable[[Any], None] | None = None
    sequence_parallel: bool = False  # runs under Ulysses sequence parallelism


_TECHNIQUES: dict[str, Technique] = {}
_ENGINES: dict[str, Engine] = {}


def _check_options_class(options: type) -> None:
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"{options!r} must be a dataclass")


def register_technique(name: str, options: type, summary: str, order: int = 100,
                       excludes: dict[str, str] | None = None):
    """Decorator registering ``install(model, options)`` as technique ``name`` (see
    :class:`Technique` for ``order`` and ``excludes``)."""
    _check_options_class(options)

    def wrap(install):
        if name in _TECHNIQUES:
            raise ValueError(f"technique {name!r} is registered twice")
        _TECHNIQUES[name] = Technique(name, options, install, summary, order, dict(excludes or {}))
        return install

    return wrap


def register_engine(name: str, options: type, summary: str, accepts: tuple[str, ...] = (),
                    conflicts: dict[str, str] | None = None, check: Callable[[Any], None] | None = None,
                    sequence_parallel: bool = False):
    """Decorator registering ``step(context, batch, num_label_tokens)`` as engine ``name``
    (see :class:`Engine` for ``accepts``, ``conflicts`` and ``check``)."""
    _check_options_class(options)

    def wrap(step):
        if name in _ENGINES:
            raise ValueError(f"engine {name!r} is registered twice")
        _ENGINES[name] = Engine(name, options, step, summary, tuple(accepts), dict(conflicts or {}), check, sequence_parallel)
        return step

    return wrap


def technique(name: str) -> Technique:
    try:
        return _TECHNIQUES[name]
    except KeyError:
        raise LongtrainError(
            f"unknown technique {name!r}; available: {', '.join(sorted(_TECHNIQUES)) or 'none'}"
        ) from None


def engine(name: str) -> Engine:
    try:
        return _ENGINES[name]
    except KeyError:
        raise LongtrainError(
            f"unknown engine {name!r}; available: {', '.join(sorted(_ENGINES))}"
        ) from None


def techniques() -> dict[str, Technique]:
    return dict(_TECHNIQUES)


def engines() -> dict[str, Engine]:
    return dict(_ENGINES)
