"""Model presets, the offline tokenizer and self-contained HF directories."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from async_rl.config.configurable import ConfigError, from_dict
from async_rl.model import toy_tokenizer as toy_tok
from async_rl.model.presets import (
    ModelConfig,
    build_model,
    load_model,
    load_model_config,
    load_tokenizer,
    num_moe_layers,
    save_pretrained_dir,
    shared_preset_dir,
    tiny_moe_config,
)


def test_tiny_moe_shape_and_size():
    model = build_model("tiny-moe", seed=0)
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok) == (2, 64, 4, 2)
    assert cfg.vocab_size == toy_tok.VOCAB_SIZE
    num_params = sum(p.numel() for p in model.parameters())
    assert 200_000 < num_params < 260_000, num_params
    assert num_moe_layers(cfg) == 2
    assert num_moe_layers(build_model("tiny-dense").config) == 0


def test_build_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("tiny-moe", seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_model("tiny-moe", seed=7)
    c = build_model("tiny-moe", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.gate.weight"], sc["model.layers.0.mlp.gate.weight"])


def test_save_dir_loads_offline_with_same_weights_and_logits(tmp_path):
    model = build_model("tiny-moe", seed=3)
    path = save_pretrained_dir(tmp_path / "m", model)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / f).is_file(), f
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_moe"
    loaded = load_model(path)
    ids = torch.tensor([[toy_tok.BOS_ID, *toy_tok.encode("12345=")]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert load_model_config(path).num_experts == 4
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert tok.pad_token_id == toy_tok.PAD_ID and tok.eos_token_id == toy_tok.EOS_ID
    assert tok("12+3=").input_ids == toy_tok.encode("12+3=")


def _ask_for_tiny_moe(target):
    return shared_preset_dir(target, preset="tiny-moe", seed=3)


def test_a_shared_preset_dir_is_written_once_whoever_asks_at_once(tmp_path):
    """Generators sharing ``vllm.work_dir`` start together: each (a process of its own) gets the whole directory,
    one copy is kept, no half-written one is ever seen, and the next start reads it as it is."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    target = tmp_path / "presets" / "tiny-moe-seed3-float32"
    with ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("fork")) as pool:
        got = list(pool.map(_ask_for_tiny_moe, [target] * 3))
    assert got == [target] * 3 and sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no leftovers
    weights = target / "model.safetensors"
    written = weights.stat().st_mtime_ns
    ids = torch.tensor([[toy_tok.BOS_ID, *toy_tok.encode("12345=")]])
    with torch.inference_mode():
        assert torch.equal(load_model(target)(ids).logits, build_model("tiny-moe", seed=3)(ids).logits)
    assert shared_preset_dir(target, preset="tiny-moe", seed=3) == target and weights.stat().st_mtime_ns == written
    broken = tmp_path / "presets" / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="broken exists but holds no model .no config.json.: remove it"):
        shared_preset_dir(broken, preset="tiny-moe")


def test_tokenizer_roundtrip_and_errors():
    tok = load_tokenizer("tiny-moe")
    text = "987 + 12 = 999, <>*-"
    ids = tok(text).input_ids
    assert ids == toy_tok.encode(text)
    assert tok.decode(ids) == text == toy_tok.decode(ids)
    assert toy_tok.decode([toy_tok.BOS_ID, *toy_tok.encode("42"), toy_tok.EOS_ID]) == "42"
    with pytest.raises(ValueError, match="outside the toy vocabulary"):
        toy_tok.encode("12a")
    with pytest.raises(ValueError, match="outside the toy vocabulary"):
        toy_tok.decode([toy_tok.VOCAB_SIZE])


def test_model_config_validation(tmp_path):
    assert from_dict(ModelConfig, {"name": "tiny-dense", "dtype": "bfloat16"}).dtype == "bfloat16"
    with pytest.raises(ValueError, match="model.name"):
        ModelConfig(name=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="model.dtype"):
        from_dict(ModelConfig, {"dtype": "float8"})
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(tmp_path)
    assert tiny_moe_config(num_experts=8).num_experts == 8


@pytest.mark.slow
async def test_tiny_moe_learns_copy_from_scratch():
    """Plain on-policy GRPO through the torch engine (weights swapped in every step) lifts copy reward 0.05 -> >0.3."""
    import numpy as np

    from actors.generator.config import TorchEngineConfig
    from actors.generator.engine import SamplingParams
    from actors.generator.torch_engine import TorchEngine
    from async_rl.tasks import TaskConfig, build_task

    task = build_task(TaskConfig(name="copy"))
    policy = build_model("tiny-moe", seed=0).train()
    engine = TorchEngine(TorchEngineConfig(), model=build_model("tiny-moe", seed=0))
    opt = torch.optim.Adam(policy.parameters(), lr=2e-3)
    params = SamplingParams(n=8, max_new_tokens=task.max_new_tokens, temperature=1.0, seed=0)
    curve = []
    for step in range(70):
        prompts = [task.prompt(step * 32 + i) for i in range(32)]
        groups = await engine.generate([p.prompt_ids for p in prompts], params)
        ids = torch.zeros(256, 7 + task.max_new_tokens, dtype=torch.long)
        weight = torch.zeros(ids.shape)
        rewards = []
        for b, (p, c) in enumerate((p, c) for p, g in zip(prompts, groups, strict=True) for c in g):
            ids[b, : p.prompt_ids.size + c.token_ids.size] = torch.from_numpy(
                np.concatenate([p.prompt_ids, c.token_ids])
            )
            weight[b, p.prompt_ids.size : p.prompt_ids.size + c.token_ids.size] = 1.0
            rewards.append(task.score(p.metadata, c.token_ids).reward)
        r = torch.tensor(rewards).view(32, 8)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        logp = torch.log_softmax(policy(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * adv * weight[:, 1:]).sum() / weight[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        engine.stage_weights({k: v.detach().clone() for k, v in policy.state_dict().items()}, step)
        assert await engine.wait_applied(step, timeout_s=30)
        curve.append(float(r.mean()))
    assert np.mean(curve[:5]) < 0.1
    assert np.mean(curve[-10:]) > 0.3, curve
    await engine.close()


@pytest.mark.parametrize(("name", "low", "high"), [("moe-1.6b", 1.60e9, 1.70e9), ("moe-5b", 4.0e9, 6.0e9)])
def test_big_presets_parameter_counts_on_the_meta_device(name: str, low: float, high: float) -> None:
    """The GPU presets' sizes as their docstrings state them, counted without allocating a weight: moe-5b's
    training state (18 bytes a parameter under Megatron's mixed precision) does not fit one 80 GB GPU."""
    from transformers import AutoModelForCausalLM

    from async_rl.model.config import PRESET_NAMES
    from async_rl.model.presets import PRESETS, preset_config

    assert tuple(PRESETS) == PRESET_NAMES and name in PRESET_NAMES
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name))
    assert all(p.is_meta for p in model.parameters())
    num_params = sum(p.numel() for p in model.parameters())
    assert low < num_params < high, num_params
    if name == "moe-5b":
        assert num_params == 5_061_669_888
        assert num_params * 18 > 80e9
        cfg = model.config
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok) == (24, 2048, 64, 8)
        assert num_moe_layers(cfg) == 24 and cfg.num_experts % 2 == 0  # EP=2 splits the experts evenly
