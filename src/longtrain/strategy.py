"""Strategy: which gradient engine runs, with which knobs, and which techniques are on.

A :class:`Strategy` is plain data: it round-trips through ``to_dict``/``from_dict``,
JSON and YAML, so a plan can be saved, reviewed and re-run. Conflicts between its parts
are settled when it is built (an engine names the techniques it composes with).
:func:`apply` finds the model's adapter, lets the engine refuse a model it cannot
train, installs the techniques and records the result — the
:class:`~longtrain.engines.base.EngineContext` — on the model, in the one attribute
longtrain keeps there; :func:`step` hands that context to the engine.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import yaml
from torch._subclasses.fake_tensor import is_fake

from . import engines as _builtin_engines  # noqa: F401  (registers the built-in engines)
from . import registry, validate
from . import techniques as _builtin_techniques  # noqa: F401  (registers the built-in techniques)
from .engines.base import EngineContext
from .engines.sequence_parallel import UlyssesOptions, distribute
from .errors import LongtrainError
from .models.adapters import adapter_for
from .models.attention import use_longtrain_attention
from .models.router_balance import install_router_balance
from .ops.loss import IGNORE_INDEX
from .parallel.distributed import collective_failures

__all__ = ["Strategy", "applied_context", "applied_strategy", "apply", "engine_context", "pinned_host_bytes", "router_aux_loss", "step"]


def _make_options(kind: str, name: str, options_cls: type, value: Any) -> Any:
    """Turn ``True``/``None``/a mapping/an options instance into an options instance."""
    if value is True or value is None:
        return options_cls()
    if isinstance(value, options_cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(options_cls)}
        unknown = sorted(set(value) - known, key=str)  # keys from a file may be of any type
        if unknown:
            raise LongtrainError(
                f"{kind} {name!r} has no option {unknown[0]!r}; its options are: "
                f"{', '.join(sorted(known)) or 'none'}"
            )
        hints = typing.get_type_hints(options_cls)
        for key, given in value.items():
            if isinstance(given, _Flag) and bool not in validate._kinds(hints[key]):
                raise LongtrainError(f"{kind} {name!r} option {key!r} takes a value: write options as name:key=value "
                                     f"({name}:{key}=...); a name alone sets a true/false option")
        # Text (command-line items, quoted YAML) is read by each option's declared type.
        return options_cls(**validate.coerce(name, options_cls, dict(value)))
    raise LongtrainError(
        f"{kind} {name!r} takes True, a mapping of options or {options_cls.__name__}(...), "
        f"not {value!r}"
    )


# Spellings of options that live elsewhere: each refused with one line pointing there.
_MOVED = {
    "attention": "chunked attention is now the 'fpdt' engine: write --engine fpdt:chunk=8192:offload=true "
                 "(Python: Strategy(engine='fpdt', engine_options=FPDTOptions(chunk=8192, offload=True)))",
}


def _spec_item(name: str, options, leave_out: str | None = None, flags_alone: bool = False) -> str:
    """``name:key=value...`` for the fields of ``options`` (a dataclass) not at their
    default, but ``leave_out``; ``flags_alone``: a flag set true as ``key`` alone."""
    changed = []
    for f in dataclasses.fields(options):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        value = getattr(options, f.name)
        if f.name == leave_out or value == default:
            continue
        changed.append(f.name if flags_alone and value is True else
                       f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
    return ":".join([name, *changed])


@dataclass(init=False)
class Strategy:
    """Which gradient engine runs and which model techniques are installed.

    ``Strategy()`` is plain autograd. ``engine`` names the gradient engine
    (``"backprop"``, ``"fpdt"``, ``"seco"``, ``"spaco"``, ``"adjoint"``) and
    ``engine_options`` its knobs (a mapping or its options dataclass). Techniques are
    named as keyword arguments, e.g. ``Strategy(checkpoint=True, mst=MsTOptions())``; each
    accepts ``True``, a mapping of its options or its options dataclass. A technique the
    engine does not compose with is refused here, with the reason.
    """

    engine: str
    engine_options: Any
    techniques: dict[str, Any]
    sequence_parallel: UlyssesOptions | None

    def __init__(self, engine: str = "backprop", engine_options: Any = None, sequence_parallel: Any = None,
                 **techniques: Any):
        if not isinstance(engine, str):
            raise LongtrainError(f"engine must be an engine name such as 'backprop' or 'fpdt', got {engine!r}")
        spec = registry.engine(engine)
        self.engine = engine
        self.engine_options = _make_options("engine", engine, spec.options, engine_options)
        chosen = {}
        for name, value in techniques.items():
            if name in _MOVED:
                raise LongtrainError(_MOVED[name])
            if value is False:
                continue
            tech = registry.technique(name)
            if name not in spec.accepts:
                reason = spec.conflicts.get(name) or (
                    f"it composes with {', '.join(spec.accepts) or 'no techniques'}")
                raise LongtrainError(f"the {engine} engine does not combine with '{name}': {reason}")
            chosen[name] = _make_options("technique", name, tech.options, value)
        for name in chosen:
            for other, reason in registry.technique(name).excludes.items():
                if other in chosen:
                    raise LongtrainError(f"'{name}' does not combine with '{other}': {reason}")
        # Stored in install order (apply's) so that equal strategies compare and print equally.
        self.techniques = {name: chosen[name] for name in install_order(chosen)}
        if isinstance(sequence_parallel, int) and not isinstance(sequence_parallel, bool):
            sequence_parallel = {"degree": sequence_parallel}
        self.sequence_parallel = None
        if sequence_parallel not in (None, False, 1) and sequence_parallel != {"degree": 1}:
            self.sequence_parallel = _make_options("option", "sequence_parallel", UlyssesOptions, sequence_parallel)
            if not spec.sequence_parallel:
                raise LongtrainError(f"the {engine} engine does not run under sequence parallelism; "
                                     "use backprop, fpdt, seco or spaco, or drop --sp")
            for name in self.techniques:
                if not registry.technique(name).sequence_parallel:
                    raise LongtrainError(f"{name} does not run under sequence parallelism yet; drop {name} or --sp")

    # ---- names -------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Short human name, e.g. ``"checkpoint"`` or ``"none"``; engines other than
        backprop are prefixed (``"seco:checkpoint"``)."""
        parts = ",".join(self.techniques) or "none"
        name = parts if self.engine == "backprop" else f"{self.engine}:{parts}"
        return name if self.sequence_parallel is None else f"{name}+sp{self.sequence_parallel.degree}"

    @property
    def spec(self) -> str:
        """The strategy as ``--strategy`` takes it, with the options that differ from their
        defaults (``"adjoint:offload_inputs=true"``, ``"checkpoint:offload_inputs=true,mst"``);
        sequence parallelism by its degree only (``+sp2``, as the command line gives it)."""
        engine = _spec_item(self.engine, self.engine_options)
        items = ([] if engine == "backprop" else [engine]) + [_spec_item(n, o) for n, o in self.techniques.items()]
        spec = ",".join(items) or "none"
        return spec if self.sequence_parallel is None else f"{spec}+sp{self.sequence_parallel.degree}"

    @property
    def label(self) -> str:
        """The strategy as a plan names it, and as ``--strategy`` reads it: :attr:`spec` with
        host budgets left out (they are the machine's, not the strategy's), a flag set true
        named alone (``fpdt:chunk=8192:offload``), and the techniques every plan candidate
        carries (MsT) after the others (``checkpoint:except_last=4,mst``); ``+spN`` under
        sequence parallelism. Made from the fields, never from another label."""
        engine = _spec_item(self.engine, self.engine_options, registry.engine(self.engine).costs.host_budget_option,
                            flags_alone=True)
        carried = sorted(name for name in self.techniques if registry.technique(name).costs.in_every_candidate)
        names = [name for name in self.techniques if name not in carried] + carried
        items = ([] if engine == Strategy().engine else [engine]) + [
            _spec_item(name, self.techniques[name], registry.technique(name).costs.host_budget_option, flags_alone=True)
            for name in names]
        label = ",".join(items) or "none"
        return label if self.sequence_parallel is None else f"{label}+sp{self.sequence_parallel.degree}"

    def uses(self, technique: str) -> bool:
        return technique in self.techniques

    # ---- serialization -----------------------------------------------------------
    def to_dict(self) -> dict:
        data = {
            "engine": {"name": self.engine, **dataclasses.asdict(self.engine_options)},
            "techniques": {n: dataclasses.asdict(o) for n, o in self.techniques.items()},
        }
        if self.sequence_parallel is not None:
            data["sequence_parallel"] = dataclasses.asdict(self.sequence_parallel)
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> "Strategy":
        if not isinstance(data, Mapping):
            raise LongtrainError(f"a strategy must be a mapping with 'engine' and 'techniques', got {type(data).__name__}")
        unknown = sorted(set(data) - {"engine", "techniques", "sequence_parallel"}, key=str)
        if unknown:
            raise LongtrainError(f"unknown strategy field {unknown[0]!r}; fields: engine, techniques, sequence_parallel")
        engine = data.get("engine", "backprop")
        if isinstance(engine, str):
            engine, engine_options = engine, None
        elif isinstance(engine, Mapping):
            engine = dict(engine)
            engine, engine_options = engine.pop("name", "backprop"), engine
        else:
            raise LongtrainError(f"a strategy's engine must be a name or a mapping with 'name' and options, got {engine!r}")
        techniques = data.get("techniques") or {}
        if not isinstance(techniques, Mapping):
            raise LongtrainError(f"a strategy's techniques must be a mapping of names to options, got {type(techniques).__name__}")
        return cls(engine=engine, engine_options=engine_options, sequence_parallel=data.get("sequence_parallel"),
                   **{str(k): v for k, v in techniques.items()})

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
              engine_options: Mapping | None = None, sequence_parallel: int | None = None) -> "Strategy":
        """Parse a command-line strategy: ``none``, ``checkpoint``, ``checkpoint,mst``,
        ``mst:loss_chunks=8`` (options after the name; a flag named alone, as in
        ``checkpoint:offload_inputs``, is true), or a path to a ``.yaml``/``.json`` file
        written by :meth:`to_yaml`/:meth:`to_json`. An item naming an engine selects it
        (``fpdt:chunk=8192:offload,mst``), and a trailing ``+spN`` sequence parallelism
        over N ranks: what ``longtrain plan`` prints parses as it is.

        ``engine`` (``"fpdt:chunk=8192:offload=true"``, ``"spaco:chunk=128:budget=8"``)
        and ``engine_options`` replace the engine a file names; an engine named in the
        command-line spec must be the same one (their options are merged, a clash refused).
        ``sequence_parallel`` (a degree, ``--sp``) replaces a file's sequence parallelism;
        a ``+spN`` in the spec must agree with it."""
        if isinstance(spec, str):
            spec, planned = _split_sequence_parallel(spec)
            if planned is not None:
                given = _degree(sequence_parallel)
                if given is not None and given != planned:
                    raise LongtrainError(f"strategy {spec}+sp{planned} runs sequence parallel over {planned} ranks, but "
                                         f"the degree given (--sp) is {given}; pass --sp {planned}, or drop +sp{planned}")
                sequence_parallel = planned if sequence_parallel is None else sequence_parallel
        if sequence_parallel is not None:
            strat = cls.parse(spec, engine, engine_options)
            return cls(strat.engine, strat.engine_options, sequence_parallel, **strat.techniques)
        if isinstance(spec, Strategy) and engine is None and not engine_options:
            return spec
        named = None  # the engine a command-line spec names: (name, options as text)
        if isinstance(spec, Strategy):
            strat = spec
        elif spec is None or isinstance(spec, str):
            strat, named = cls._parse_spec((spec or "none").strip())
        else:
            raise LongtrainError(f"a strategy is a Strategy, a comma list such as 'checkpoint,mst' or a file path, got {spec!r}")
        if engine is None and not engine_options:
            return strat
        if engine_options is not None and not isinstance(engine_options, Mapping):
            raise LongtrainError(f"engine_options must be a mapping of option names to values, got {engine_options!r}")
        if engine is None:
            name, options = strat.engine, dataclasses.asdict(strat.engine_options)
        elif not isinstance(engine, str):
            raise LongtrainError(f"an engine is a name with options such as 'fpdt:chunk=8192', got {engine!r}")
        else:
            name, options = _parse_item(engine)
            options = {} if options is True else options
            if named is not None:
                options = _same_engine(spec, named, (name, options))
        return cls(name, {**options, **(engine_options or {})}, strat.sequence_parallel, **strat.techniques)

    @classmethod
    def _parse_spec(cls, spec: str) -> "tuple[Strategy, tuple[str, dict] | None]":
        """The strategy ``spec`` describes, and the engine it names with its options as
        text (None for a file, which replaces its engine with one given apart)."""
        if spec.endswith((".yaml", ".yml", ".json")):
            try:
                text = Path(spec).read_text(encoding="utf-8")
            except (OSError, ValueError) as exc:  # ValueError: a NUL in the path, or not UTF-8
                reason = exc.strerror if isinstance(exc, OSError) else "not a readable UTF-8 file name or text"
                raise LongtrainError(f"cannot read strategy file {spec!r}: {reason}; pass the path of a .yaml or .json "
                                     "file written by Strategy.to_yaml() or to_json()") from None
            try:
                return (cls.from_json(text) if spec.endswith(".json") else cls.from_yaml(text)), None
            except (json.JSONDecodeError, yaml.YAMLError, RecursionError) as exc:
                reason = " ".join(str(exc).split())  # the parsers' messages span lines
                raise LongtrainError(f"strategy file {spec} is not valid {'JSON' if spec.endswith('.json') else 'YAML'}: "
                                     f"{reason}") from None
        if "·" in spec:  # an earlier plan's row note, e.g. "fpdt:chunk=8192:offload,mst · optimizer in host memory"
            strategy, note = (part.strip() for part in spec.split("·", 1))
            raise LongtrainError(f"'{note}' in --strategy {spec!r} is not part of a strategy: pass --strategy {strategy} "
                                 "with --optimizer-offload")
        items = [] if spec in ("none", "") else [n.strip() for n in spec.split(",")]
        if not all(items):
            raise LongtrainError(f"strategy {spec!r} has an empty item; separate names by single commas, as in "
                                 "'checkpoint,mst'")
        techniques: dict[str, Any] = {}
        named: tuple[str, dict] | None = None
        engines = registry.engines()
        for name, options in map(_parse_item, items):
            if name in engines:
                if named is not None:
                    raise LongtrainError(f"strategy {spec!r} names two engines, {named[0]!r} and {name!r}; name one")
                named = (name, {} if options is True else options)
                continue
            if name in techniques:
                raise LongtrainError(f"strategy {spec!r} names {name!r} twice; name each technique once, with all its options")
            techniques[name] = options
        engine, options = named or ("backprop", {})
        return cls(engine, options or None, **techniques), named


class _Flag(str):
    """An option named alone in a command-line item (``fpdt:offload``): ``"true"``, for an
    option that is a flag; any other option is refused by name (:func:`_make_options`)."""


def _parse_item(item: str) -> tuple[str, Any]:
    """``"mst"`` -> ("mst", True); ``"fpdt:chunk=8192:offload=true"`` -> ("fpdt",
    {"chunk": "8192", "offload": "true"}); a key alone is a flag set: ``"fpdt:offload"``
    -> ("fpdt", {"offload": "true"}). Values stay text, read later by the type each
    option declares (:func:`longtrain.validate.coerce`)."""
    name, *pairs = item.split(":")
    if not pairs:
        return name.strip(), True
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not key.strip():
            raise LongtrainError(f"cannot read {pair!r} in strategy item {item!r}; write options as "
                                 "name:key=value:key=value (or name:flag for flag=true)")
        if key.strip() in options:
            raise LongtrainError(f"strategy item {item!r} sets {key.strip()!r} twice; set each option once")
        options[key.strip()] = value.strip() if sep else _Flag("true")
    return name.strip(), options


def _split_sequence_parallel(spec: str) -> tuple[str, int | None]:
    """``"fpdt:chunk=8192:offload,mst+sp8"`` (a plan's row under ``--gpus 8``) ->
    (``"fpdt:chunk=8192:offload,mst"``, 8); a spec without ``+spN`` -> (spec, None)."""
    head, sep, tail = spec.strip().rpartition("+sp")
    tail, note = tail.split("·", 1) if "·" in tail else (tail, None)  # "+sp8 · optimizer in host memory"
    if not sep or not tail.strip().isdigit():
        return spec, None
    return head + (f" · {note.strip()}" if note is not None else ""), int(tail)


def _degree(sequence_parallel: Any) -> int | None:
    """The degree a ``sequence_parallel`` argument asks for (None: not given or not readable here)."""
    if isinstance(sequence_parallel, int) and not isinstance(sequence_parallel, bool):
        return sequence_parallel
    if isinstance(sequence_parallel, Mapping) and isinstance(sequence_parallel.get("degree"), int):
        return sequence_parallel["degree"]
    if isinstance(sequence_parallel, UlyssesOptions):
        return sequence_parallel.degree
    return None


def _same_engine(spec: str, named: tuple[str, dict], given: tuple[str, dict]) -> dict:
    """The options of one engine named both in a command-line strategy and apart
    (``--engine``): merged, where they agree; a different engine or option value is refused."""
    if named[0] != given[0]:
        raise LongtrainError(f"strategy {spec!r} names engine {named[0]!r} but the engine given (--engine) is "
                             f"{given[0]!r}; name the engine once, in the strategy or in --engine")
    options = registry.engine(named[0]).options
    ours, theirs = (validate.coerce(named[0], options, values) for values in (named[1], given[1]))  # read by type
    for key, value in theirs.items():
        if key in ours and ours[key] != value:
            raise LongtrainError(f"strategy {spec!r} sets {named[0]} option {key}={named[1][key]} but --engine sets "
                                 f"{key}={given[1][key]}; set it once")
    return {**named[1], **given[1]}


# The order apply() installs the built-in techniques in, innermost first: liger's fused
# RMSNorm, gated MLP and rotary kernels replace the stock ops; mst runs the MLPs and the
# head in mini-sequences; what wraps a whole (patched) layer comes last, memo's token-wise
# swapping, then checkpoint's recomputation. Techniques registered elsewhere follow, in
# registration order (install_order, the one place that orders them).
INSTALL_SEQUENCE = ("liger", "mst", "memo", "checkpoint")


def install_order(names) -> list[str]:
    """``names`` in the order :func:`apply` installs them (:data:`INSTALL_SEQUENCE`)."""
    registered = list(registry.techniques())
    return sorted(names, key=lambda name: (INSTALL_SEQUENCE.index(name) if name in INSTALL_SEQUENCE else
                                           len(INSTALL_SEQUENCE) + registered.index(name)))


# The one attribute longtrain sets on a model: its EngineContext once a strategy is applied.
_CONTEXT_ATTR = "_longtrain"


def applied_context(model) -> EngineContext | None:
    """The context :func:`apply` recorded on ``model``, or None."""
    return getattr(model, _CONTEXT_ATTR, None)


def applied_strategy(model) -> Strategy | None:
    context = applied_context(model)
    return None if context is None else context.strategy


def pinned_host_bytes(model) -> int:
    """Page-locked host memory the model's engine holds for parked chunks."""
    context = applied_context(model)
    return 0 if context is None else context.pool.allocated_bytes


def weights_on_device(model) -> None:
    """Every weight a technique keeps in host memory (``stream``) back on the device for
    good, and the streaming off: before LoRA's adapters are merged into the weights (the
    last use of a trained model), which would otherwise add a device delta to a host copy."""
    context = applied_context(model)
    if context is not None and context.weight_stream is not None:
        context.weight_stream.settle()


def apply(model, strategy: "Strategy | str | None"):
    """Install ``strategy`` on ``model`` in place and return it.

    The model's family must have an adapter (one line naming the supported families
    otherwise); the engine may refuse the model (an SSM under a chunked engine), and a
    config's attention dropout is refused (longtrain's kernels apply none); attention is routed through longtrain's backend; techniques
    patch their modules. Applying the same strategy again is a no-op; applying a
    different one to a model that already has one is an error (build a fresh model
    instead), because techniques patch modules and cannot all be undone cleanly.
    """
    strategy = Strategy.parse(strategy)
    prior = applied_strategy(model)
    if prior is not None:
        if prior == strategy:
            return model
        raise LongtrainError(
            f"this model already has strategy {prior.spec!r} applied; build a fresh model "
            f"to apply {strategy.spec!r}"
        )
    context = EngineContext(strategy, adapter_for(model))
    _check_trainable(context)
    _route_attention(context)
    context.router_balance = install_router_balance(context.adapter)  # before any technique wraps a layer
    for name in install_order(strategy.techniques):  # INSTALL_SEQUENCE, then the others
        registry.technique(name).install(context, strategy.techniques[name])
    if strategy.sequence_parallel is not None:
        distribute(context)  # join the group, shard parameters over all ranks (FSDP2)
    # (an engine's layer groups split the layers over processes once they are known:
    # registry.EngineSpec.layer_groups, called by the trainer)
    object.__setattr__(model, _CONTEXT_ATTR, context)  # the one documented place (see above)
    return model


def _check_trainable(context: EngineContext) -> None:
    """The engine may refuse the model (an SSM under a chunked engine); attention dropout
    is refused (longtrain's kernels apply none)."""
    engine = registry.engine(context.strategy.engine)
    if engine.check is not None:
        engine.check(context)
    context.adapter.check_trainable()
    if context.adapter.has_attention and context.adapter.attention_dropout() > 0:
        raise LongtrainError(f"longtrain's attention kernels apply no dropout to attention weights, and this model's "
                             f"config sets attention_dropout={context.adapter.attention_dropout():g}; set it to 0 for "
                             "training (other dropouts, LoRA's included, are applied and replayed exactly)")


def _route_attention(context: EngineContext) -> None:
    """Attention through longtrain's backend; no KV cache (useless in training, costs memory)."""
    base = context.adapter.base
    if context.adapter.has_attention:
        use_longtrain_attention(base)
    if hasattr(base.config, "use_cache"):
        base.config.use_cache = False


def engine_context(model, strategy: "Strategy | str") -> EngineContext:
    """A context for stepping ``model`` with ``strategy``'s engine and options directly
    (``engine.step(context, batch)``), whatever strategy the model has applied — for
    scripts and tests that compare engine options on one model. The model's applied
    techniques stay; ``strategy``'s own techniques are not installed."""
    strategy = Strategy.parse(strategy)
    if applied_context(model) is None:
        apply(model, Strategy())
    applied = applied_context(model)
    context = EngineContext(strategy, applied.adapter, pool=applied.pool)
    engine = registry.engine(strategy.engine)
    if engine.check is not None:
        engine.check(context)
    return context


BATCH_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")  # what a step reads of a batch


def _check_batch_keys(batch: Mapping) -> None:
    """A key the step does not read (a typo such as ``label``, pre-shifted ``shift_labels``)
    would change the loss unseen: refused in one line."""
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise LongtrainError(f"batch key {unknown[0]!r} is not read by longtrain.step (it reads {', '.join(BATCH_KEYS)}; "
                             "labels unshifted, -100 ignored); rename or drop it")


def _check_vocabulary(context: EngineContext, batch) -> None:
    """Token ids and labels must index the model's vocabulary (labels may also be -100):
    an id outside it would fail deep in an embedding or loss kernel (an IndexError on
    CPU, a device-side assert on CUDA). One reduction, read once per micro-batch; fake
    tensors (simulation) hold no values to check."""
    vocab = context.adapter.description.vocab
    if not isinstance(batch, Mapping) or vocab is None:
        return  # the engine's batch check names what is wrong with the mapping

    def checkable(t) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() > 0 and not t.dtype.is_floating_point and not is_fake(t)

    ids, labels = batch.get("input_ids"), batch.get("labels")
    outside = {}
    if checkable(ids):
        outside["input_ids"] = ((ids < 0) | (ids >= vocab)).any()
    if checkable(labels):
        outside["labels"] = (((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab)).any()
    if not outside:
        return
    flags = list(outside.values())
    for name, out_of_range in zip(outside, torch.stack([f.to(flags[0].device) for f in flags]).tolist()):
        if out_of_range:
            allowed = f"0..{vocab - 1}" + (f" or {IGNORE_INDEX}" if name == "labels" else "")
            raise LongtrainError(f"{name} hold ids outside the model's vocabulary of {vocab} (allowed: {allowed}); "
                                 "tokenize with the model's own tokenizer")


def router_aux_loss(model) -> torch.Tensor | None:
    """The routers' load-balancing loss of ``model``'s last step (Hugging Face's ``aux_loss``,
    before ``router_aux_loss_coef``; :func:`step`'s loss includes ``coef · aux_loss``), or
    None where the step added none (a dense model, or ``output_router_logits`` off)."""
    context = applied_context(model)
    balance = None if context is None else context.router_balance
    return None if balance is None else balance.last_aux_loss


def step(model, batch: Mapping, strategy: Strategy | None = None, num_label_tokens: int | None = None, *,
         aux_loss_weight: float = 1.0):
    """Run forward + backward for one micro-batch with the applied strategy's engine.

    ``batch`` holds ``input_ids`` (B, S) and optionally ``attention_mask``, ``labels``
    and ``position_ids`` (Hugging Face conventions: labels are *not* shifted, -100 is
    ignored; position ids that restart inside a row mark packed documents, which attend
    only within themselves). Gradients are accumulated on the parameters. The returned
    loss is the sum of token losses divided by ``num_label_tokens`` (plus, for a mixture
    of experts whose config sets ``output_router_logits``, ``router_aux_loss_coef`` times
    the micro-batch's load-balancing loss, as Hugging Face adds it) — pass the
    label-token count of the whole accumulation step so that the sum of the returned
    losses equals the mean loss stock Hugging Face computes for one batch holding all
    of them. By default, the count of this micro-batch is used.

    ``aux_loss_weight`` multiplies that load-balancing term (a trainer that averages it over
    accumulation steps passes 1/steps, as TRL does).

    A model with no strategy applied gets ``strategy`` (or plain backprop) applied when
    it changes no module (an engine alone); techniques need :func:`apply` first.
    """
    context = applied_context(model)
    if context is None:
        strategy = Strategy.parse(strategy)
        if strategy.techniques:
            raise LongtrainError(
                f"strategy {strategy.spec!r} is not installed on this model; call "
                "longtrain.apply(model, strategy) first"
            )
        apply(model, strategy)
        context = applied_context(model)
    elif strategy is not None and Strategy.parse(strategy) != context.strategy:
        raise LongtrainError(
            f"this model has strategy {context.strategy.spec!r} applied, not {Strategy.parse(strategy).spec!r}; "
            "build a fresh model to step with another strategy"
        )
    _check_batch_keys(batch)
    _check_vocabulary(context, batch)
    if context.router_balance is not None:
        context.router_balance.weight = aux_loss_weight
    engine = registry.engine(context.strategy.engine)
    sp = context.sequence_parallel
    try:
        if sp is None:
            return engine.step(context, batch, num_label_tokens)
        with collective_failures("the sequence-parallel step"):
            sp.check_same_batch(batch)
            with sp.random_stream(next(context.adapter.base.parameters()).device):
                return engine.step(context, batch, num_label_tokens)
    except BaseException:
        if context.router_balance is not None:
            context.router_balance.abandon()
        raise
