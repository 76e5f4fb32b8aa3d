"""``bench backends`` shapes on the CPU: the 30B-A3B slice preset, RL-like lengths, padding and model FLOPs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.commands.bench.backend_shapes import (
    SHAPE_PRESETS,
    model_flops_per_token,
    padded_slots,
    padding_frac,
    sequence_lengths,
)
from actors.learner.batching import group_by_budget
from actors.learner.config import BatchingConfig
from actors.learner.megatron.toy import toy_config

SLICE = SHAPE_PRESETS["qwen3-30b-a3b-slice"]


def _slice_config(**overrides: int) -> object:
    p = {**SLICE, **overrides}
    return toy_config(num_layers=p["layers"], dense_first=p["dense_first"], vocab_size=p["vocab"],
                      hidden_size=p["hidden"], num_experts=p["experts"], top_k=p["top_k"], moe_ffn=p["moe_ffn"],
                      heads=p["heads"], kv_heads=p["kv_heads"], head_dim=p["head_dim"], max_len=p["seq"])  # fmt: skip


def test_slice_preset_is_qwen3_30b_a3b_layers_and_builds_on_the_meta_device() -> None:
    cfg = _slice_config()
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (2048, 128, 8, 768)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (32, 4, 128, 151936)
    assert cfg.mlp_only_layers == [] and 2 <= cfg.num_hidden_layers <= 4
    assert (SLICE["min_seq"], SLICE["seq"], SLICE["lengths"]) == (2048, 8192, "lognormal")
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    per_layer_experts = 128 * 3 * 2048 * 768
    assert 2 * per_layer_experts + 2 * 151936 * 2048 < n < 1.9e9  # 1.87B: fits one H100 with AdamW
    layers = model.model.layers
    assert all(hasattr(layer.mlp, "experts") for layer in layers)  # every layer MoE, as in Qwen3-30B-A3B
    # A tiny version of the same preset (the shape knobs are honoured) builds and runs on the CPU.
    tiny = _slice_config(layers=2, hidden=64, experts=8, top_k=2, moe_ffn=16, heads=4, kv_heads=2, head_dim=16,
                         vocab=96, seq=64)  # fmt: skip
    torch.manual_seed(0)
    small = Qwen3MoeForCausalLM(tiny).eval()
    with torch.no_grad():
        out = small(input_ids=torch.randint(0, 96, (2, 12)))
    assert out.logits.shape == (2, 12, 96)


@pytest.mark.parametrize("dist", ["uniform", "lognormal"])
def test_lengths_are_seeded_within_range_and_vary(dist: str) -> None:
    a = sequence_lengths(64, distribution=dist, min_len=2048, max_len=8192, seed=3)
    assert a == sequence_lengths(64, distribution=dist, min_len=2048, max_len=8192, seed=3)
    assert a != sequence_lengths(64, distribution=dist, min_len=2048, max_len=8192, seed=4)
    assert all(2048 <= n <= 8192 for n in a) and len(set(a)) > 32
    assert sequence_lengths(3, distribution="fixed", min_len=10, max_len=20) == [20, 20, 20]
    if dist == "lognormal":  # centred on the geometric mean (4096), a tail both ways
        med = sorted(sequence_lengths(2001, distribution=dist, min_len=2048, max_len=8192))[1000]
        assert 3500 < med < 4700
    with pytest.raises(ValueError, match="--lengths"):
        sequence_lengths(4, distribution="normal", min_len=1, max_len=2)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        sequence_lengths(4, distribution=dist, min_len=5, max_len=2)


def test_padding_frac_counts_the_slots_of_right_padded_micro_batches() -> None:
    groups = [[8, 6], [5], [3, 3, 2]]
    assert padded_slots(groups) == 2 * 8 + 5 + 3 * 3
    assert padding_frac(groups) == pytest.approx(1 - 27 / 30)
    assert padded_slots([[5, 3]], multiple=4) == 16  # a CP/SP multiple rounds every row up
    assert padding_frac([[4, 4], [7]]) == 0.0 and padding_frac([]) == 0.0
    # The learner's own cut: longest first under a padded-token budget; sorting leaves less padding.
    lengths = sequence_lengths(32, distribution="lognormal", min_len=2048, max_len=8192, seed=1)
    cut = [[lengths[i] for i in g] for g in group_by_budget(lengths, BatchingConfig(micro_batch_tokens=8192))]
    assert sorted(n for g in cut for n in g) == sorted(lengths)
    assert all(len(g) * max(g) <= 8192 for g in cut)
    unsorted = BatchingConfig(micro_batch_tokens=8192, sort_by_length=False)
    cut_unsorted = [[lengths[i] for i in g] for g in group_by_budget(lengths, unsorted)]
    assert 0.0 < padding_frac(cut) < padding_frac(cut_unsorted)


def test_model_flops_per_token_by_hand_with_variable_lengths() -> None:
    cfg = SimpleNamespace(hidden_size=8, head_dim=2, num_attention_heads=4, num_key_value_heads=2, mlp_only_layers=[],
                          num_hidden_layers=2, intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=3, vocab_size=10)  # fmt: skip
    attn = 8 * 8 + 2 * 8 * 4 + 8 * 8  # q, k+v, o
    moe = 8 * 4 + 2 * 3 * 8 * 3  # router, top-2 experts of 3 matmuls
    n = 2 * (attn + moe) + 8 * 10
    assert model_flops_per_token(cfg, seq_len=5) == 6 * n + 6 * 2 * 5 * 8
    # Sequences of 2 and 6 tokens: attention FLOPs of the step are 6 * L * q * (2^2 + 6^2), over 8 tokens.
    step = 8 * 6 * n + 6 * 2 * 8 * (2 * 2 + 6 * 6)
    assert model_flops_per_token(cfg, [2, 6]) == pytest.approx(step / 8)
    assert model_flops_per_token(cfg, [5, 5, 5]) == pytest.approx(model_flops_per_token(cfg, 5))
    with pytest.raises(ValueError, match="positive"):
        model_flops_per_token(cfg, [3, 0])
    # The slice by hand: 2 layers of attention, router and 8 active experts, and the LM head.
    big = _slice_config()
    h, q, kv = 2048, 32 * 128, 4 * 128
    active = 2 * (2 * h * q + 2 * h * kv + h * 128 + 8 * 3 * h * 768) + h * 151936
    assert model_flops_per_token(big, [2048, 8192]) == pytest.approx(
        6 * active + 6 * 2 * q * (2048**2 + 8192**2) / (2048 + 8192)
    )


def test_bench_flags_are_checked_before_the_gpu_is_asked_for() -> None:
    from actors.commands.bench.backends import main

    with pytest.raises(SystemExit, match="--min-seq must be in"):
        main(["--preset", "qwen3-30b-a3b-slice", "--min-seq", "9000"])
    with pytest.raises(SystemExit, match="--layers must be > 0"):
        main(["--preset", "qwen3-30b-a3b-slice", "--layers", "0"])
    with pytest.raises(SystemExit, match="--logprob-chunk-tokens takes integers"):
        main(["--preset", "qwen3-30b-a3b-slice", "--logprob-chunk-tokens", "0,big"])
    with pytest.raises(SystemExit, match="--expert-parallel must divide the 1 process"):
        main(["--preset", "qwen3-30b-a3b-slice", "--expert-parallel", "2"])


def test_under_torchrun_only_megatron_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from actors.commands.bench.backends import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="only --backends megatron runs"):
        main(["--preset", "qwen3-30b-a3b-slice", "--expert-parallel", "2"])
    with pytest.raises(SystemExit, match="--expert-parallel must divide the 2 process"):
        main(["--preset", "qwen3-30b-a3b-slice", "--backends", "megatron", "--expert-parallel", "3"])


def test_a_tiny_slice_step_is_cut_counted_and_trains_on_the_cpu() -> None:
    """The bench's step on a tiny config of the preset's kind: the micro-batches' padding is padding_frac's, the
    routes are the model's, and the torch backend trains on them with chunked and full logits alike."""
    from actors.commands.bench.backends import step_micro_batches
    from actors.learner.config import TorchBackendConfig
    from actors.learner.megatron.toy import build_hf, nll_loss
    from actors.learner.torch_backend import TorchBackend

    cfg = _slice_config(layers=2, hidden=64, experts=8, top_k=2, moe_ffn=16, heads=4, kv_heads=2, head_dim=16,
                        vocab=96, seq=64)  # fmt: skip
    lengths = sequence_lengths(7, distribution="lognormal", min_len=12, max_len=48, seed=0)
    hf = build_hf(cfg, device="cpu")
    groups, mbs = step_micro_batches(hf, lengths, micro_batch_tokens=96)
    assert len(mbs) > 1 and sorted(n for g in groups for n in g) == sorted(lengths)
    slots = sum(m.attention_mask.numel() for m in mbs)
    real = sum(int(m.attention_mask.sum()) for m in mbs)
    assert real == sum(lengths) and padding_frac(groups) == pytest.approx(1 - real / slots)
    assert all(r is not None and r.shape[1:] == (2, 2) for m in mbs for r in m.routes)
    updates = []
    for chunk in (0, 16):
        model = build_hf(cfg, device="cpu")
        tb = TorchBackend(model, TorchBackendConfig(device="cpu", lr=1e-3, logprob_chunk_tokens=chunk))
        before = model.lm_head.weight.detach().clone()
        res = tb.train_step(mbs, nll_loss, replay_routes=True)
        assert res.num_tokens == real and res.metrics["step_skipped"] == 0.0
        updates.append(model.lm_head.weight.detach() - before)
    torch.testing.assert_close(updates[0], updates[1], rtol=1e-4, atol=1e-7)
