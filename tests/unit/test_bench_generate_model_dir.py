"""``bench generate --work-dir``: a preset's weights written once where the generators write theirs, then reused."""

from __future__ import annotations

from pathlib import Path

from actors.commands.bench.generate import _model_dir


def test_a_preset_is_written_once_into_the_work_dir_and_reused(tmp_path: Path) -> None:
    first = _model_dir("tiny-moe", str(tmp_path))
    assert first.parent == tmp_path and first.name == "tiny-moe-seed0-bfloat16"  # as a generator names it
    weights = sorted(first.glob("*.safetensors"))
    assert weights
    written = [w.stat().st_mtime_ns for w in weights]
    assert _model_dir("tiny-moe", str(tmp_path)) == first
    assert [w.stat().st_mtime_ns for w in sorted(first.glob("*.safetensors"))] == written  # not written again


def test_a_model_directory_is_taken_as_it_is(tmp_path: Path) -> None:
    assert _model_dir(str(tmp_path), str(tmp_path / "unused")) == tmp_path
