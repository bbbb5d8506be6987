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

from .costs import EngineCosts, TechniqueCosts
from .errors import LongtrainError


@dataclass(frozen=True)
class Technique:
    """A model transformation installed by :func:`longtrain.apply`.

    ``options`` is a dataclass holding the technique's knobs (it may have no fields);
    ``install(context, options)`` patches the model's modules in place (the
    :class:`~longtrain.engines.base.EngineContext` gives the model's adapter and the
    whole strategy, for defaults that depend on the engine; where it installs among the
    others: :func:`longtrain.strategy.apply`); ``excludes`` maps the
    techniques it cannot be combined with to the reason; ``costs`` is what plans and
    simulations ask of it (:class:`~longtrain.costs.TechniqueCosts`);
    ``sequence_parallel``: it runs under Ulysses. Techniques patch modules; they never
    run a schedule.
    """

    name: str
    options: type
    install: Callable[[Any, Any], None]
    summary: str
    excludes: dict[str, str] = field(default_factory=dict)
    costs: TechniqueCosts = field(default_factory=TechniqueCosts)
    sequence_parallel: bool = True


@dataclass(frozen=True)
class Engine:
    """A gradient engine: ``step(context, batch, num_label_tokens) -> loss``.

    The engine runs forward and backward for one micro-batch, leaves gradients
    accumulated on the parameters and returns the detached loss, already divided by
    ``num_label_tokens``. ``accepts`` names the techniques it composes with (a strategy
    naming another is refused when it is built, with ``conflicts``' reason where one is
    given); ``check(context)``, if given, refuses a model the engine cannot train when
    the strategy is applied; ``sequence_parallel``: the engine runs under Ulysses;
    ``costs``: what plans and simulations ask of it (:class:`~longtrain.costs.EngineCosts`);
    ``layer_groups(context, rank, world_size)``, if given, splits the applied model's layers
    over the processes of a distributed run (each keeps its own).
    """

    name: str
    options: type
    step: Callable[..., Any]
    summary: str
    accepts: tuple[str, ...] = ()
    conflicts: dict[str, str] = field(default_factory=dict)
    check: Callable[[Any], None] | None = None
    sequence_parallel: bool = False  # runs under Ulysses sequence parallelism
    costs: EngineCosts = field(default_factory=EngineCosts)
    layer_groups: Callable[[Any, int, int], Any] | None = None


__all__ = ["Technique", "Engine", "register_technique", "register_engine", "technique", "engine", "techniques",
           "engines", "unregister_engine", "unregister_technique"]

_TECHNIQUES: dict[str, Technique] = {}
_ENGINES: dict[str, Engine] = {}


def _check_options_class(options: type) -> None:
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"{options!r} must be a dataclass")


def register_technique(name: str, options: type, summary: str,
                       excludes: dict[str, str] | None = None, costs: TechniqueCosts | None = None,
                       sequence_parallel: bool = True):
    """Decorator registering ``install(model, options)`` as technique ``name`` (see
    :class:`Technique` for the other fields)."""
    _check_options_class(options)

    def wrap(install):
        if name in _TECHNIQUES:
            raise ValueError(f"technique {name!r} is registered twice")
        _TECHNIQUES[name] = Technique(name, options, install, summary, dict(excludes or {}),
                                      costs or TechniqueCosts(), sequence_parallel)
        return install

    return wrap


def register_engine(name: str, options: type, summary: str, accepts: tuple[str, ...] = (),
                    conflicts: dict[str, str] | None = None, check: Callable[[Any], None] | None = None,
                    sequence_parallel: bool = False, costs: EngineCosts | None = None,
                    layer_groups: Callable[[Any, int, int], Any] | None = None):
    """Decorator registering ``step(context, batch, num_label_tokens)`` as engine ``name``
    (see :class:`Engine` for ``accepts``, ``conflicts`` and ``check``)."""
    _check_options_class(options)

    def wrap(step):
        if name in _ENGINES:
            raise ValueError(f"engine {name!r} is registered twice")
        _ENGINES[name] = Engine(name, options, step, summary, tuple(accepts), dict(conflicts or {}), check,
                                sequence_parallel, costs or EngineCosts(), layer_groups)
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


def unregister_engine(name: str) -> None:
    """Remove engine ``name`` (for tests that register a toy engine)."""
    _ENGINES.pop(name, None)


def unregister_technique(name: str) -> None:
    """Remove technique ``name`` (for tests that register a toy technique)."""
    _TECHNIQUES.pop(name, None)


def techniques() -> dict[str, Technique]:
    return dict(_TECHNIQUES)


def engines() -> dict[str, Engine]:
    return dict(_ENGINES)
