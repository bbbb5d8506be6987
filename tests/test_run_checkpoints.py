
import pytest

from longtrain.errors import LongtrainError
from longtrain.train import run_checkpoints as ckpt


def _writer(text):
    return lambda path: path.write_text(text)


def test_save_verify_and_prune(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, {"a.txt": _writer(f"step {step}")}, {"step": step}, keep=2)
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step-00000003"
    assert ckpt.verify_checkpoint(latest) == {"step": 3}
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]


def test_a_write_killed_midway_never_replaces_the_last_good_checkpoint(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, {"a.txt": _writer("good")}, {})

    def dies_midway(path):
        path.write_text("partial")
        raise KeyboardInterrupt  # the process is interrupted while writing

    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 2, {"a.txt": _writer("x"), "b.txt": dies_midway}, {})
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step-00000001"
    ckpt.verify_checkpoint(latest)
    assert not (tmp_path / "step-00000002").exists()
    # The next successful save clears the debris.
    ckpt.save_checkpoint(tmp_path, 3, {"a.txt": _writer("ok")}, {})
    assert not list(tmp_path.glob(".tmp-*"))


def test_corruption_is_detected(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, {"a.bin": _writer("0123456789")}, {})
    (path / "a.bin").write_text("0123456780")  # same size, one byte changed
    with pytest.raises(LongtrainError, match="a.bin does not match its checksum"):
        ckpt.verify_checkpoint(path)
    (path / "a.bin").unlink()
    with pytest.raises(LongtrainError, match="a.bin is missing"):
        ckpt.verify_checkpoint(path)
    (path / ckpt.MANIFEST).write_text("{not json")
    with pytest.raises(LongtrainError, match="incomplete or corrupt"):
        ckpt.verify_checkpoint(path)


def test_dangling_latest_pointer(tmp_path):
    (tmp_path / ckpt.LATEST).write_text("step-00000009")
    with pytest.raises(LongtrainError, match="missing"):
        ckpt.latest_checkpoint(tmp_path)
