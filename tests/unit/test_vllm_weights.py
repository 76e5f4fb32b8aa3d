"""What a vLLM engine loads (actors/generator/vllm_weights.py): transformers' in-memory names (fused experts) under
the checkpoint's names, as copies or, for a staging slot that the next version refreshes in place, as views."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.generator.model_facts import read_model_facts
from actors.generator.vllm_weights import CheckpointWeights
from async_rl.model.presets import load_model, save_pretrained_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pretrained_dir(tmp_path_factory.mktemp("weights") / "m", preset="moe-107m", seed=0, dtype="bfloat16")


def _in_memory(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    model = load_model("moe-107m", seed=seed, dtype="bfloat16")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fused_experts_convert_into_views_that_follow_their_source(model_dir: Path) -> None:
    weights = CheckpointWeights(read_model_facts(model_dir))
    published = _in_memory(model_dir, seed=0)
    assert any("experts.gate_up_proj" in k for k in published), "the preset no longer fuses its experts"
    copies = dict(weights.prepare(published))
    views = dict(weights.prepare(published, views=True))
    assert set(views) == set(copies) == set(weights.facts.shapes)
    storages = {t.untyped_storage().data_ptr() for t in published.values()}
    for name, t in views.items():
        assert torch.equal(t, copies[name]), name
        assert t.untyped_storage().data_ptr() in storages, f"{name} is a copy, not a view of a published tensor"
    # The next version copied into the same tensors (a staging slot): the views hold its values, bit for bit.
    for name, t in _in_memory(model_dir, seed=1).items():
        published[name].copy_(t)
    for name, t in weights.prepare(published).items():
        assert torch.equal(views[name], t), name
    expert = next(k for k in views if "experts.0.gate_proj" in k)
    assert not torch.equal(views[expert], copies[expert]), "the second version has the first one's expert weights"


def test_checkpoint_names_pass_unchanged_and_mistakes_are_named(model_dir: Path) -> None:
    from safetensors.torch import load_file

    weights = CheckpointWeights(read_model_facts(model_dir))
    saved = load_file(str(model_dir / "model.safetensors"))
    got = weights.prepare(saved, views=True)
    assert all(got[k] is v for k, v in saved.items())
    name = next(k for k in saved if "experts.0.down_proj" in k)
    wrong = {**saved, name: saved[name][:, :-1]}
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        weights.prepare(wrong, views=True)
