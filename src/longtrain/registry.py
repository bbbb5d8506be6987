"""The registry of gradient engines and model techniques.

Each engine is a package ``longtrain/engines/<name>/`` and each technique a package
``longtrain/techniques/<name>/``: ``options.py`` (the options dataclass), ``schedule.py``
(an engine's step) or ``install.py`` (a technique's patching), ``costs.py`` (what plans
and simulations ask of it) and an ``__init__.py`` that builds one frozen
:class:`EngineSpec` or :class:`TechniqueSpec` and calls :func:`register`. Adding one is
that folder plus one import line in its kind's ``__init__``; nothing else changes. The
strategy looks names up here; this module imports neither package, so the import graph
has no cycle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from .costs import EngineCosts, TechniqueCosts
from .errors import LongtrainError


@dataclass(frozen=True)
class TechniqueSpec:
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
class EngineSpec:
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


__all__ = ["EngineSpec", "TechniqueSpec", "register", "technique", "engine", "techniques", "engines", "unregister_engine",
           "unregister_technique"]

_TECHNIQUES: dict[str, TechniqueSpec] = {}
_ENGINES: dict[str, EngineSpec] = {}


def register(spec: EngineSpec | TechniqueSpec) -> EngineSpec | TechniqueSpec:
    """Register an engine's or a technique's spec under its name (once)."""
    if not dataclasses.is_dataclass(spec.options):
        raise TypeError(f"{spec.options!r} must be a dataclass")
    table, kind = (_ENGINES, "engine") if isinstance(spec, EngineSpec) else (_TECHNIQUES, "technique")
    if spec.name in table:
        raise ValueError(f"{kind} {spec.name!r} is registered twice")
    table[spec.name] = spec
    return spec


def technique(name: str) -> TechniqueSpec:
    try:
        return _TECHNIQUES[name]
    except KeyError:
        raise LongtrainError(
            f"unknown technique {name!r}; available: {', '.join(sorted(_TECHNIQUES)) or 'none'}"
        ) from None


def engine(name: str) -> EngineSpec:
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


def techniques() -> dict[str, TechniqueSpec]:
    return dict(_TECHNIQUES)


def engines() -> dict[str, EngineSpec]:
    return dict(_ENGINES)
