"""HF <-> megatron-core weight conversion (pure torch, real transformers models, no megatron-core)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from actors.learner.megatron.convert import (
    ModelArch,
    RankNaming,
    expected_global_names,
    global_name,
    hf_to_mcore,
    local_name,
    local_state,
    mcore_to_hf,
    shard,
    unshard,
)
from actors.learner.megatron.routes import PipelineSplit

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _qwen3() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**SMALL, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         mlp_only_layers=[0], norm_topk_prob=True)  # fmt: skip
    return Qwen3MoeForCausalLM(cfg)


def _qwen2() -> Qwen2MoeForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(**SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
                         num_experts_per_tok=2, mlp_only_layers=[1])  # fmt: skip
    return Qwen2MoeForCausalLM(cfg)


def _mixtral() -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(
        MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)
    )


@pytest.mark.parametrize("build", [_qwen3, _qwen2, _mixtral])
def test_roundtrip_is_exact(build) -> None:  # type: ignore[no-untyped-def]
    model = build()
    arch = ModelArch.from_hf_config(model.config)
    hf = {k: v.clone() for k, v in model.state_dict().items()}
    mc = hf_to_mcore(hf, arch)
    assert sorted(mc) == expected_global_names(arch)
    back = mcore_to_hf(mc, arch)
    if arch.tie_embeddings:
        hf.pop("lm_head.weight")
    assert sorted(back) == sorted(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


def test_arch_reads_dense_first_layer_and_routing_flavour() -> None:
    arch = ModelArch.from_hf_config(_qwen3().config)
    assert arch.moe_layers == (False, True, True) and arch.num_moe_layers == 2
    assert arch.qk_norm and not arch.qkv_bias and arch.norm_topk_prob and arch.head_dim == 8
    arch2 = ModelArch.from_hf_config(_qwen2().config)
    assert arch2.moe_layers == (True, False, True) and arch2.shared_expert_size == 24 and arch2.qkv_bias
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        ModelArch.from_hf_config(type("C", (), {"model_type": "llama"})())


def test_qkv_is_grouped_per_kv_head() -> None:
    model = _qwen3()
    arch = ModelArch.from_hf_config(model.config)
    mc = hf_to_mcore(model.state_dict(), arch)
    qkv = mc["decoder.layers.1.self_attention.linear_qkv.weight"]
    a = model.model.layers[1].self_attn
    d, hpg = arch.head_dim, arch.heads_per_group
    blocks = qkv.reshape(arch.num_kv_heads, (hpg + 2) * d, -1)
    for g in range(arch.num_kv_heads):
        assert torch.equal(blocks[g, : hpg * d], a.q_proj.weight[g * hpg * d : (g + 1) * hpg * d])
        assert torch.equal(blocks[g, hpg * d : (hpg + 1) * d], a.k_proj.weight[g * d : (g + 1) * d])
        assert torch.equal(blocks[g, (hpg + 1) * d :], a.v_proj.weight[g * d : (g + 1) * d])


def test_expert_fc1_is_gate_then_up_and_matches_hf_expert() -> None:
    model = _qwen3()
    arch = ModelArch.from_hf_config(model.config)
    mc = hf_to_mcore(model.state_dict(), arch)
    x = torch.randn(5, arch.hidden_size)
    fc1, fc2 = (
        mc["decoder.layers.2.mlp.experts.3.linear_fc1.weight"],
        mc["decoder.layers.2.mlp.experts.3.linear_fc2.weight"],
    )
    gate, up = (x @ fc1.T).chunk(2, dim=-1)
    ours = (torch.nn.functional.silu(gate) * up) @ fc2.T
    experts = model.model.layers[2].mlp.experts
    ref = experts(x, torch.full((5, 1), 3), torch.ones(5, 1))
    torch.testing.assert_close(ours, ref)


def test_per_expert_checkpoint_names_load_and_export() -> None:
    model = _qwen3()
    arch = ModelArch.from_hf_config(model.config)
    mc = hf_to_mcore(model.state_dict(), arch)
    per = mcore_to_hf(mc, arch, fused_experts=False)
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in per
    assert not any("gate_up_proj" in k for k in per)
    mc2 = hf_to_mcore(per, arch)
    assert all(torch.equal(mc[k], mc2[k]) for k in mc)


def test_unknown_or_missing_weights_raise() -> None:
    model = _qwen3()
    arch = ModelArch.from_hf_config(model.config)
    sd = dict(model.state_dict())
    sd["model.layers.0.mystery.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="mystery"):
        hf_to_mcore(sd, arch)
    sd = dict(model.state_dict())
    sd.pop("model.layers.2.self_attn.k_norm.weight")
    with pytest.raises(ValueError, match="lacks 'model.layers.2.self_attn.k_norm.weight'"):
        hf_to_mcore(sd, arch)


@pytest.mark.parametrize("tp", [1, 2])
def test_shard_unshard_roundtrip(tp: int) -> None:
    model = _qwen3()
    arch = ModelArch.from_hf_config(model.config)
    mc = hf_to_mcore(model.state_dict(), arch)
    for name, t in mc.items():
        pieces = [shard(name, t, r, tp) for r in range(tp)]
        assert torch.equal(unshard(name, pieces), t), name
    # Gated fc1: each rank holds [gate slice; up slice].
    fc1 = mc["decoder.layers.0.mlp.linear_fc1.weight"]
    s1 = shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    f = arch.ffn_hidden_size
    assert torch.equal(s1[: f // 2], fc1[f // 2 : f]) and torch.equal(s1[f // 2 :], fc1[f + f // 2 :])
    with pytest.raises(ValueError, match="does not split over tp=5"):
        shard(
            "decoder.layers.0.self_attention.linear_proj.weight",
            mc["decoder.layers.0.self_attention.linear_proj.weight"],
            0,
            5,
        )


@pytest.mark.parametrize("te_spec, grouped", [(False, False), (True, True)])
def test_local_names_over_pp_and_ep_cover_every_weight_once(te_spec: bool, grouped: bool) -> None:
    model = _qwen3()
    arch = ModelArch.from_hf_config(model.config)
    mc = hf_to_mcore(model.state_dict(), arch)
    split = PipelineSplit(num_layers=3, pp_size=2, first_stage_layers=1)
    seen: dict[str, int] = {}
    for pp in range(2):
        for ep in range(2):
            naming = RankNaming(layer_offset=split.offset(pp), num_local_layers=split.num_layers_on(pp),
                                expert_offset=ep * 2, num_local_experts=2, te_spec=te_spec, grouped_experts=grouped,
                                has_embedding=pp == 0, has_output=pp == 1)  # fmt: skip
            local = local_state(mc, naming, arch, 0, 1)
            for ln, t in local.items():
                g = global_name(ln, naming, arch.moe_layers)
                assert g is not None and torch.equal(mc[g], t)
                if "experts" in g or ep == 0:
                    seen[g] = seen.get(g, 0) + 1
                assert local_name(g, naming, arch.moe_layers) == ln
    assert sorted(seen) == sorted(mc) and set(seen.values()) == {1}
    # TE spec fuses the dense layer's pre-MLP norm into fc1; MoE layers keep pre_mlp_layernorm.
    if te_spec:
        n0 = RankNaming(num_local_layers=3, num_local_experts=4, te_spec=True)
        assert local_name("decoder.layers.0.pre_mlp_layernorm.weight", n0, arch.moe_layers).endswith(
            "mlp.linear_fc1.layer_norm_weight"
        )
        assert local_name("decoder.layers.1.pre_mlp_layernorm.weight", n0, arch.moe_layers).endswith(
            "pre_mlp_layernorm.weight"
        )


def test_dense_first_layers_are_honoured() -> None:
    """DeepSeek-style ``first_k_dense_replace``: the first k layers have a dense MLP and no router, in the converter
    exactly as in :mod:`async_rl.model.moe` (which the engines and the learner's route checks ask too)."""
    from transformers import Qwen3MoeConfig

    from actors.learner.megatron.convert import ModelArch
    from async_rl.model.moe import moe_facts

    cfg = Qwen3MoeConfig(num_hidden_layers=5, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, vocab_size=64, mlp_only_layers=[3])  # fmt: skip
    cfg.first_k_dense_replace = 2
    arch = ModelArch.from_hf_config(cfg)
    assert arch.moe_layers == (False, False, True, False, True)
    facts = moe_facts(cfg)
    assert arch.moe_layers == facts.moe_mask and facts.moe_layer_ids == (2, 4) and arch.num_moe_layers == 2
