"""The strategies the planner weighs (:func:`candidates`: each technique's and each engine's
variants, as their costs propose them), the name each goes by (:attr:`~longtrain.strategy.Strategy.label`), and
their adjustments to the machine: host budgets beside AdamW's state in host memory, kept
attention outputs within the host's room, and the technique that can leave top layers whole."""

from __future__ import annotations

from .. import registry
from ..errors import LongtrainError
from ..strategy import Strategy
from .bounds import _engine_costs

__all__ = [
    "CHUNKS",
    "added_techniques",
    "candidates",
    "host_budgets_beside_optimizer",
    "outputs_kept_within",
]


CHUNKS = (8192, 16384, 32768)

# The option that holds a host budget: the plan fills it from --host-memory (less what AdamW's
# state takes there), a run from its own host memory; a label leaves it out.
def candidates(seq_len: int, host_memory: int | None, layers: int = 32, every_chunk: bool = False,
               chunks: tuple[int, ...] = CHUNKS, adapter=None, added: tuple[str, ...] = (),
               carried: tuple[str, ...] = ()) -> dict[str, Strategy]:
    """The strategies the planner weighs at ``seq_len`` tokens, by :attr:`~longtrain.strategy.Strategy.label`:
    each technique's variants on the default engine, then each engine's (``candidates`` of
    their costs), with the techniques every candidate carries (MsT) where the engine takes
    them. ``every_chunk``:
    every chunk size, however many chunks (for :func:`max_context`). ``adapter``: the
    model's adapter class; only the variants its costs say serve such models (no chunked
    attention for a state-space model, no adjoint engine for a transformer). ``added``: techniques
    weighed with every candidate too (:func:`added_techniques`), each variant after its base.
    ``carried``: techniques every candidate carries as MsT does, where its engine takes them
    (what ``--strategy auto`` adds: the ranking is then of what runs)."""
    techniques = registry.techniques()
    always = [name for name, technique in sorted(techniques.items()) if technique.costs.in_every_candidate]

    def built(accepts, every: dict | None = None, **chosen) -> Strategy:
        """The candidate with what every candidate carries where the engine takes it (``every``:
        options of those, where not their defaults; the ``carried`` ones only where they
        combine with the candidate's own techniques)."""
        usual = {name: (every or {}).get(name, True) for name in always if name in accepts}
        riding = {name: True for name in carried if name in accepts and name not in usual and name not in chosen
                  and (adapter is None or techniques[name].costs.serves(adapter, techniques[name].options()))}
        try:
            return Strategy(**chosen, **usual, **riding)
        except LongtrainError:
            return Strategy(**chosen, **usual)

    found = []
    default = registry.engine(Strategy().engine).accepts
    lighter = [{name: options} for name in always for options in techniques[name].costs.variants_on_default_engine()
               if adapter is None or techniques[name].costs.serves(adapter, options)]
    for name, technique in sorted(techniques.items()):
        for options in technique.costs.candidates(host_memory).values():
            if adapter is None or technique.costs.serves(adapter, options):
                found.append(built(default, **{name: options}))
                found += [built(default, every, **{name: options}) for every in lighter]
    for name, engine in sorted(registry.engines().items()):
        for options in engine.costs.candidates(seq_len, host_memory, layers, every_chunk, chunks).values():
            if adapter is None or engine.costs.serves(adapter, options):
                found.append(built(engine.accepts, engine=name, engine_options=options))
    for name in added:
        found = [variant for strategy in found for variant in
                 ((strategy, _rebuilt(strategy, **{name: True})) if name in registry.engine(strategy.engine).accepts
                  else (strategy,))]
    return {strategy.label: strategy for strategy in found}


def added_techniques(config, device_memory: int, item: int, frozen: bool) -> tuple[str, ...]:
    """The techniques a plan weighs with every candidate too, on this model and device
    (:meth:`~longtrain.costs.TechniqueCosts.weighed_with_each`: streaming frozen weights
    where they fill much of the device)."""
    return tuple(name for name, technique in sorted(registry.techniques().items())
                 if technique.costs.weighed_with_each(config, device_memory, item, frozen))


def host_budgets_beside_optimizer(strategy: Strategy, room: int) -> Strategy:
    """``strategy`` with its techniques' host budgets cut to ``room``: what the host keeps
    beside what lives there for the whole run (AdamW's state and master weights, streamed
    weights)."""
    changed = {name: registry.technique(name).costs.with_host_budget(options, room)
               for name, options in strategy.techniques.items()}
    return _rebuilt(strategy, **changed)


def outputs_kept_within(config, seq_len: int, strategy: Strategy, item: int, batch: int, room: int) -> Strategy | None:
    """A candidate with its host-dependent choices made for ``room`` bytes of host memory
    (FPDT's ``keep_output=fit`` made a count: :meth:`~longtrain.costs.EngineCosts.fit_to_host`;
    its label follows from its options), or None where the candidate is then redundant.
    Other candidates come back as they are."""
    options = _engine_costs(strategy).fit_to_host(config, seq_len, strategy.engine_options, item, batch, room,
                                                  strategy.sequence_parallel)
    if options is None:
        return None
    if options is strategy.engine_options:
        return strategy
    return Strategy(engine=strategy.engine, engine_options=options, sequence_parallel=strategy.sequence_parallel,
                    **strategy.techniques)


def _leaves_layers_whole(strategy: Strategy) -> str | None:
    """The technique of ``strategy`` that can leave top layers whole (checkpointing's
    ``except_last``), or None."""
    return next((name for name, options in strategy.techniques.items()
                 if registry.technique(name).costs.with_whole_layers(options, 0) is not None), None)


def _rebuilt(strategy: Strategy, sequence_parallel=None, **techniques) -> Strategy:
    """``strategy`` with a sequence-parallel degree and/or techniques replaced."""
    return Strategy(engine=strategy.engine, engine_options=strategy.engine_options,
                    sequence_parallel=sequence_parallel or strategy.sequence_parallel,
                    **{**strategy.techniques, **techniques})
