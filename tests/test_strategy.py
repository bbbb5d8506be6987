import pytest
import torch

import longtrain as lt
import longtrain.strategy
from longtrain.errors import LongtrainError
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config


def test_round_trips_through_yaml_and_json():
    strategy = lt.Strategy(checkpoint=True)
    assert lt.Strategy.from_yaml(strategy.to_yaml()) == strategy
    assert lt.Strategy.from_json(strategy.to_json()) == strategy
    assert lt.Strategy.from_dict(strategy.to_dict()).name == "checkpoint"
    assert lt.Strategy.parse("none") == lt.Strategy()
    assert lt.Strategy.parse("checkpoint") == strategy
    assert lt.Strategy.parse("checkpoint") != lt.Strategy()


def test_strategy_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(lt.Strategy(checkpoint=True).to_yaml())
    assert lt.Strategy.parse(str(path)) == lt.Strategy(checkpoint=True)
    with pytest.raises(LongtrainError, match="cannot read strategy file"):
        lt.Strategy.parse(str(tmp_path / "missing.yaml"))


def test_unknown_names_and_options_are_clear_errors():
    with pytest.raises(LongtrainError, match="unknown technique 'flashy'; available: .*checkpoint"):
        lt.Strategy.parse("flashy")
    with pytest.raises(LongtrainError, match="unknown engine"):
        lt.Strategy(engine="warp")
    with pytest.raises(LongtrainError, match="has no option 'every'"):
        lt.Strategy(checkpoint={"every": 2})
    with pytest.raises(LongtrainError, match="unknown strategy field"):
        lt.Strategy.from_dict({"engines": "backprop"})


@pytest.mark.parametrize("spec,printed", [
    ("adjoint:offload_inputs", "adjoint:offload_inputs=true"),
    ("checkpoint:offload_inputs,mst", "mst,checkpoint:offload_inputs=true"),
    ("fpdt:chunk=8192:offload,mst:loss_chunks=8", "fpdt:chunk=8192:offload=true,mst:loss_chunks=8"),
    ("memo:host_memory=8GiB,mst", None), ("checkpoint:except_last=2,mst+sp2", "mst,checkpoint:except_last=2+sp2"), ("none", "none"), ("adjoint", "adjoint")])
def test_a_strategy_prints_as_the_command_line_takes_it(spec, printed):
    """``Strategy.spec`` (what a simulation report names) keeps the options ``name`` drops
    (``adjoint:offload_inputs`` is not ``adjoint:none``) and parses back to the same strategy."""
    strategy = lt.Strategy.parse(spec)
    assert printed is None or strategy.spec == printed
    assert lt.Strategy.parse(strategy.spec) == strategy


def test_command_line_items_carry_options_and_engines():
    strategy = lt.Strategy.parse("mst:loss_chunks=8", engine="fpdt:chunk=8192:offload=true:host_memory=120GiB")
    assert strategy.engine_options == lt.FPDTOptions(chunk=8192, offload=True, host_memory="120GiB")
    assert strategy.techniques["mst"] == lt.MsTOptions(loss_chunks=8) and strategy.name == "fpdt:mst"
    assert lt.Strategy.from_yaml(strategy.to_yaml()) == strategy
    spaco = lt.Strategy.parse("checkpoint", engine="spaco:budget=4", engine_options={"chunk": 64})
    assert spaco.engine == "spaco" and (spaco.engine_options.budget, spaco.engine_options.chunk) == (4, 64)
    assert lt.Strategy.from_yaml(spaco.to_yaml()) == spaco
    with pytest.raises(LongtrainError, match="write options as name:key=value"):
        lt.Strategy.parse("mst:loss_chunks")
    with pytest.raises(LongtrainError, match="fpdt chunk must be a positive integer"):
        lt.Strategy.parse("none", engine="fpdt:chunk=big")


def test_conflicts_are_settled_when_the_strategy_is_built():
    with pytest.raises(LongtrainError, match="fpdt engine does not combine with 'checkpoint'"):
        lt.Strategy.parse("checkpoint,mst", engine="fpdt")
    with pytest.raises(LongtrainError, match="adjoint engine does not combine with 'mst'"):
        lt.Strategy(engine="adjoint", mst=True)
    with pytest.raises(LongtrainError, match="engine must be a name or a mapping"):
        lt.Strategy.from_dict({"engine": 5})
    with pytest.raises(LongtrainError, match="techniques must be a mapping"):
        lt.Strategy.from_dict({"techniques": ["checkpoint"]})
    with pytest.raises(LongtrainError, match="a strategy is a Strategy"):
        lt.Strategy.parse(["checkpoint"])


def test_the_only_state_on_a_model_is_its_context():
    model = build_from_config(preset_config("tiny-llama"))
    before = set(vars(model))
    lt.apply(model, lt.Strategy(checkpoint=True, mst=True))
    assert set(vars(model)) - before == {"_longtrain"}


def test_apply_is_idempotent_and_refuses_a_second_strategy():
    model = build_from_config(preset_config("tiny-llama"))
    lt.apply(model, lt.Strategy(checkpoint=True))
    lt.apply(model, lt.Strategy(checkpoint=True))  # same strategy: no-op
    with pytest.raises(LongtrainError, match="already has strategy 'checkpoint'"):
        lt.apply(model, lt.Strategy())


def test_step_refuses_a_strategy_that_was_not_applied():
    model = build_from_config(preset_config("tiny-llama"))
    with pytest.raises(LongtrainError, match="call longtrain.apply"):
        lt.step(model, {"input_ids": torch.zeros(1, 8, dtype=torch.long)}, lt.Strategy(checkpoint=True))


def test_step_applies_an_engine_alone_but_not_techniques():
    model = build_from_config(preset_config("tiny-llama"))
    lt.step(model, {"input_ids": torch.randint(0, 300, (1, 16))})  # plain backprop, applied on the way
    assert lt.strategy.applied_strategy(model) == lt.Strategy()


def test_batch_without_label_tokens_is_refused():
    model = build_from_config(preset_config("tiny-llama"))
    ids = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(LongtrainError, match="no label tokens"):
        lt.step(model, {"input_ids": ids, "labels": torch.full_like(ids, -100)})


def test_layering_techniques_never_import_engines_and_the_registry_imports_neither():
    """The import graph of the architecture: techniques patch modules and never reach an
    engine; the registry imports no engine, technique or strategy (no cycle through it);
    longtrain sets state on a model in one place only."""
    import ast
    from pathlib import Path

    root = Path(lt.__file__).parent

    def imports(path: Path) -> set[str]:
        """Modules imported at run time (``if TYPE_CHECKING:`` blocks left out)."""
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
        names = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                names.add("." * node.level + (node.module or ""))
                names.update("." * node.level + (node.module + "." if node.module else "") + a.name for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    for path in (root / "techniques").rglob("*.py"):
        assert not [n for n in imports(path) if "engines" in n], path
    assert not [n for n in imports(root / "registry.py") if any(k in n for k in ("engines", "techniques", "strategy"))]
    for path in (root / "engines").glob("*.py"):
        assert not [n for n in imports(path) if "strategy" in n], path
    setters = [p for p in root.rglob("*.py") if "object.__setattr__(" in p.read_text()]
    assert setters == [root / "strategy.py"]
