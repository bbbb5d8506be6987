"""A new engine is one folder plus one import line: a toy engine, written here as a package
the way longtrain's engines are (options, schedule, costs, an ``__init__`` registering its
spec), is simulated, timed and planned without any change to ``longtrain.plan``."""

import importlib
import sys
import textwrap

import pytest

import longtrain as lt
from longtrain import registry
from longtrain.models.presets import preset_config
from longtrain.plan.planner import PlanRequest, candidates, parked_split, plan
from longtrain.plan.simulate import simulate
from longtrain.plan.time_model import step_time

GIB = 2**30
PARKED_PER_TOKEN = 1000  # host bytes the toy engine says it parks per token

TOY_PACKAGE = {
    "__init__.py": """
        from longtrain.registry import EngineSpec, register
        from .costs import ToyCosts
        from .options import ToyOptions
        from .schedule import toy_step

        SPEC = register(EngineSpec("toy", ToyOptions, toy_step, "backprop, claiming extra work (a test's toy)",
                                   accepts=("mst",), costs=ToyCosts()))
    """,
    "options.py": """
        from dataclasses import dataclass

        @dataclass
        class ToyOptions:
            extra_passes: int = 1  # forwards of every layer it claims to add
    """,
    "costs.py": """
        from longtrain.costs import EngineCosts

        PARKED_PER_TOKEN = 1000

        class ToyCosts(EngineCosts):
            def parked(self, config, seq_len, options, item, batch):
                return 0, PARKED_PER_TOKEN * batch * seq_len

            def candidates(self, seq_len, host_memory, layers, every_chunk, chunks):
                return {"toy": {}, "toy:extra_passes=3": {"extra_passes": 3}}

            def add_work(self, work, options):
                work.matmul += options.extra_passes * work.layer_fwd
    """,
    "schedule.py": """
        from longtrain.engines.backprop.schedule import forward_loss

        def toy_step(context, batch, num_label_tokens=None):
            with context.forward_pass():
                loss = forward_loss(context, batch, num_label_tokens)
            loss.backward()
            return context.finish(loss)
    """,
}


@pytest.fixture
def toy_engine(tmp_path, monkeypatch):
    folder = tmp_path / "toy_engine_package"
    folder.mkdir()
    for name, text in TOY_PACKAGE.items():
        (folder / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("toy_engine_package")  # the one import line
    yield "toy"
    registry.unregister_engine("toy")
    for name in [m for m in sys.modules if m == "toy_engine_package" or m.startswith("toy_engine_package.")]:
        del sys.modules[name]


def test_a_toy_engine_is_simulated_timed_and_planned(toy_engine):
    config = preset_config("tiny-llama")
    toy, plain = lt.Strategy(engine=toy_engine, mst=True), lt.Strategy(mst=True)
    # simulated: its step runs on fake tensors like any engine's (it is backprop underneath)
    assert simulate(config, 512, strategy=toy, dtype="float32").device_peak_bytes == \
        simulate(config, 512, strategy=plain, dtype="float32").device_peak_bytes
    # timed: its costs' work is added to the plain step's
    extra = step_time(config, 4096, toy).parts["matmul"] - step_time(config, 4096, plain).parts["matmul"]
    more = step_time(config, 4096, lt.Strategy(engine=toy_engine, engine_options={"extra_passes": 3}, mst=True))
    assert extra > 0 and more.parts["matmul"] - step_time(config, 4096, plain).parts["matmul"] == pytest.approx(3 * extra)
    # counted: what it parks bounds a plan before any simulation
    assert parked_split(config, 2048, toy, 2) == (0, PARKED_PER_TOKEN * 2048)
    # planned: its variants are candidates, carrying MsT, and each gets a row
    assert {"toy,mst", "toy:extra_passes=3,mst"} <= set(candidates(2048, GIB))
    result = plan(PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=GIB, optimizer_offload=False,
                              exhaustive=True))
    rows = {row.name: row for row in result.rows}
    assert rows["toy,mst"].fits and rows["toy,mst"].step_seconds < rows["toy:extra_passes=3,mst"].step_seconds
    short = plan(PlanRequest("tiny-llama", 2048, device_memory=GIB, host_memory=PARKED_PER_TOKEN * 2048 - 1,
                             optimizer_offload=False, exhaustive=True))
    assert "host memory: at least" in {row.name: row for row in short.rows}["toy,mst"].binds
