"""Strategy: which techniques are on, with which knobs, and which gradient engine runs.

A :class:`Strategy` is plain data: it round-trips through ``to_dict``/``from_dict``,
JSON and YAML, so a plan can be saved, reviewed and re-run. :func:`apply` installs its
techniques into a model; :func:`step` runs one forward + backward with its engine.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from . import registry
from .errors import LongtrainError


def _make_options(kind: str, name: str, options_cls: type, value: Any) -> Any:
    """Turn ``True``/``None``/a mapping/an options instance into an options instance."""
    if value is True or value is None:
        return options_cls()
    if isinstance(value, options_cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(options_cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise LongtrainError(
                f"{kind} {name!r} has no option {unknown[0]!r}; its options are: "
                f"{', '.join(sorted(known)) or 'none'}"
            )
        return options_cls(**value)
    raise LongtrainError(
        f"{kind} {name!r} takes True, a mapping of options or {options_cls.__name__}(...), "
        f"not {value!r}"
    )


@dataclass(init=False)
class Strategy:
    """Which gradient engine runs and which model techniques are installed.

    ``Strategy()`` is plain autograd. Techniques are named as keyword arguments, e.g.
    ``Strategy(checkpoint=True)``; each accepts ``True``, a mapping of its options or its
    options dataclass. ``engine`` names the gradient engine (``"backprop"`` by default)
    and ``engine_options`` its knobs.
    """

    engine: str
    engine_options: Any
    techniques: dict[str, Any]

    def __init__(self, engine: str = "backprop", engine_options: Any = None, **techniques: Any):
        spec = registry.engine(engine)
        self.engine = engine
        self.engine_options = _make_options("engine", engine, spec.options, engine_options)
        chosen = {}
        for name, value in techniques.items():
            if value is False:
                continue
            tech = registry.technique(name)
            chosen[name] = _make_options("technique", name, tech.options, value)
        # Stored in install order so that equal strategies compare and print equally.
        order = registry.techniques()
        self.techniques = dict(sorted(chosen.items(), key=lambda kv: (order[kv[0]].order, kv[0])))

    # ---- names -------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Short human name, e.g. ``"checkpoint"`` or ``"none"``; engines other than
        backprop are prefixed (``"seco:checkpoint"``)."""
        parts = ",".join(self.techniques) or "none"
        return parts if self.engine == "backprop" else f"{self.engine}:{parts}"

    def uses(self, technique: str) -> bool:
        return technique in self.techniques

    # ---- serialization -----------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "engine": {"name": self.engine, **dataclasses.asdict(self.engine_options)},
            "techniques": {n: dataclasses.asdict(o) for n, o in self.techniques.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Strategy":
        if not isinstance(data, Mapping):
            raise LongtrainError(f"a strategy must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - {"engine", "techniques"})
        if unknown:
            raise LongtrainError(f"unknown strategy field {unknown[0]!r}; fields: engine, techniques")
        engine = data.get("engine", "backprop")
        if isinstance(engine, str):
            engine, engine_options = engine, None
        else:
            engine = dict(engine)
            engine_name = engine.pop("name", "backprop")
            engine, engine_options = engine_name, engine
        techniques = data.get("techniques") or {}
        return cls(engine=engine, engine_options=engine_options, **dict(techniques))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "Strategy":
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "Strategy":
        return cls.from_dict(yaml.safe_load(text))

    @classmethod
    def parse(cls, spec: "str | Strategy | None", engine: str | None = None,
              engine_options: Mapping | None = None) -> "Strategy":
        """Parse a command-line strategy: ``none``, ``checkpoint``, ``checkpoint,mst``,
        ``mst,attention:chunk=8192:offload=true`` (options after the name), or a path
        to a ``.yaml``/``.json`` file written by :meth:`to_yaml`/:meth:`to_json`.

        ``engine`` (``"seco"``, ``"spaco:chunk=128:budget=8"``) and ``engine_options``
        replace the engine the spec names (a file may name one)."""
        if isinstance(spec, Strategy) and engine is None and not engine_options:
            return spec
        if isinstance(spec, Strategy):
            strat = spec
        else:
            strat = cls._parse_spec((spec or "none").strip())
        if engine is None and not engine_options:
            return strat
        if engine is None:
            name, options = strat.engine, dataclasses.asdict(strat.engine_options)
        else:
            name, options = _parse_item(engine)
            options = {} if options is True else options
        return cls(name, {**options, **(engine_options or {})}, **strat.techniques)

    @classmethod
    def _parse_spec(cls, spec: str) -> "Strategy":
        if spec.endswith((".yaml", ".yml", ".json")):
            try:
                text = Path(spec).read_text()
            except OSError as exc:
                raise LongtrainError(f"cannot read strategy file {spec}: {exc.strerror}") from None
            try:
                return cls.from_json(text) if spec.endswith(".json") else cls.from_yaml(text)
            except (json.JSONDecodeError, yaml.YAMLError) as exc:
                raise LongtrainError(f"strategy file {spec} is not valid: {exc}") from None
        items = [] if spec == "none" else [n.strip() for n in spec.split(",") if n.strip()]
        return cls("backprop", None, **dict(_parse_item(item) for item in items))


def _parse_item(item: str) -> tuple[str, Any]:
    """``"mst"`` -> ("mst", True); ``"attention:chunk=8192:offload=true"`` -> ("attention",
    {"chunk": 8192, "offload": True}) (values read as YAML scalars)."""
    name, *pairs = item.split(":")
    if not pairs:
        return name, True
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise LongtrainError(f"cannot read {pair!r} in strategy item {item!r}; write options as name:key=value:key=value")
        options[key.strip()] = yaml.safe_load(value)
    return name.strip(), options


def apply(model, strategy: Strategy):
    """Install ``strategy``'s techniques into ``model`` in place and return it.

    Applying the same strategy again is a no-op; applying a different one to a model
    that already has one is an error (build a fresh model instead), because techniques
    patch modules and cannot all be undone cleanly.
    """
    strategy = Strategy.parse(strategy)
    prior = getattr(model, "_longtrain_strategy", None)
    if prior is not None:
        if prior == strategy:
            return model
        raise LongtrainError(
            f"this model already has strategy {prior.name!r} applied; build a fresh model "
            f"to apply {strategy.name!r}"
        )
    engine = registry.engine(strategy.engine)
    if engine.check is not None:
        engine.check(model)
    for name, options in strategy.techniques.items():
        registry.technique(name).install(model, options)
    object.__setattr__(model, "_longtrain_strategy", strategy)
    return model


def applied_strategy(model) -> Strategy | None:
    return getattr(model, "_longtrain_strategy", None)


def step(model, batch: Mapping, strategy: Strategy | None = None, num_label_tokens: int | None = None):
    """Run forward + backward for one micro-batch with the strategy's engine.

    ``batch`` holds ``input_ids`` (B, S) and optionally ``attention_mask`` and
    ``labels`` (Hugging Face conventions: labels are *not* shifted, -100 is ignored).
    Gradients are accumulated on the parameters. The returned loss is the sum of token
    losses divided by ``num_label_tokens`` — pass the label-token count of the whole
    accumulation step so that the sum of the returned losses equals the mean loss stock
    Hugging Face computes for one batch holding all of them. By default, the count of
    this micro-batch is used.
    """
    applied = applied_strategy(model)
    if strategy is None:
        strategy = applied or Strategy()
    elif strategy.techniques and applied != strategy:
        raise LongtrainError(
            f"strategy {strategy.name!r} is not installed on this model; call "
            "longtrain.apply(model, strategy) first"
        )
    spec = registry.engine(strategy.engine)
    return spec.step(model, batch, strategy.engine_options, num_label_tokens)
