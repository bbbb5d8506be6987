"""The command line asks CUDA's allocator for expandable segments (docs/speed.md: the
reserved peak of offloaded chunked steps ran 1.3–1.4× the allocated one without them),
and a user's own allocator setting is left alone; a CUDA run reports the reservation
and the attention kernel its blocks ran."""

import pytest

from longtrain.cli import main
from longtrain.memory import allocator
from longtrain.train.trainer import format_summary


@pytest.fixture
def clean_env(monkeypatch):
    for name in allocator.ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: False)
    return monkeypatch


def test_expandable_segments_are_asked_for_unless_the_user_configured_the_allocator(clean_env):
    env = {}
    assert allocator.prefer_expandable_segments(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator.allocator_setting(env) == "expandable_segments:True"
    for name in allocator.ALLOC_CONF_VARIABLES:
        mine = {name: "max_split_size_mb:256"}
        assert not allocator.prefer_expandable_segments(mine) and mine == {name: "max_split_size_mb:256"}
        assert allocator.allocator_setting(mine) == "max_split_size_mb:256"
    assert allocator.allocator_setting({}) == "default"


def test_too_late_once_cuda_allocated(clean_env):
    clean_env.setattr(allocator, "_cuda_initialized", lambda: True)
    env = {}
    assert not allocator.prefer_expandable_segments(env) and env == {}


def test_train_sets_it_before_it_builds_anything(clean_env, capsys):
    import os

    refused = ["train", "--model", "no-such-preset", "--steps", "1"]  # refused after the setting, before a model
    assert main(refused) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    clean_env.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8")
    clean_env.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert main(refused) == 2
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    capsys.readouterr()


def test_a_cuda_summary_reports_the_reservation_and_the_setting():
    summary = {"final_loss": 1.0, "first_loss": 2.0, "task": None, "tokens_per_s": 100.0, "device": "cuda:0",
               "measured_peak_bytes": 40 * 2**30, "measured_with": "cuda-allocator", "measured_reserved_bytes": 42 * 2**30,
               "allocator": "expandable_segments:True", "simulated_stock_peak_bytes": 2**30, "simulated_stock_setup": "same setup",
               "seq_len": 1024, "seconds": 10.0, "steps": 2, "strategy": "fpdt", "attention_kernel": "cudnn"}
    text = format_summary(summary)
    assert "100 tokens/s on cuda:0 (attention kernel cudnn)" in text
    assert "40.00 GiB (cuda-allocator), 42.00 GiB reserved (1.05×, allocator expandable_segments:True)" in text
    cpu = dict(summary, device="cpu", measured_with="tracked-storages", measured_reserved_bytes=None, allocator=None)
    assert "reserved" not in format_summary(cpu) and "kernel" not in format_summary(cpu)
    kept = dict(summary, strategy_notes={"kept_attention_outputs": 13})  # what fpdt:keep_output=fit came to
    assert "the lowest 13 layers keep their attention output" in format_summary(kept)


def test_metrics_plot_draws_the_reservation_beside_the_allocation(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from longtrain.train.plot import plot_metrics

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda figure, *a, **k: drawn.append(figure) or save(figure, *a, **k))
    records = [{"step": s, "loss": 3.0 - s / 10, "tokens_per_s": 100.0, "peak_bytes": 2**30, "reserved_bytes": 2**30 + s * 2**20}
               for s in range(1, 5)] + [{"step": 4, "eval": {"loss": 2.9, "samples": 2}}]
    assert plot_metrics(records, tmp_path / "metrics.png").stat().st_size > 0
    memory = drawn[0].axes[-1]
    assert [line.get_label() for line in memory.lines] == ["allocated", "reserved"]
    assert list(memory.lines[1].get_ydata()) == [1025.0, 1026.0, 1027.0, 1028.0]  # MiB
