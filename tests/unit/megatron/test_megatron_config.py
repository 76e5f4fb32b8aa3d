"""Megatron backend config validation, lazy imports and benchmark arithmetic (CPU, no megatron-core)."""

from __future__ import annotations

import sys

import pytest

from actors.commands.bench.backends import model_flops_per_token, peak_flops
from actors.learner.megatron.config import MegatronConfig


def test_defaults_valid_and_layout_sizes() -> None:
    c = MegatronConfig(tensor_parallel=2, pipeline_parallel=2, expert_parallel=2, sequence_parallel=True)
    assert c.model_parallel_size == 4
    assert c.data_parallel_size(8) == 2
    with pytest.raises(ValueError, match="world size 6 is not a multiple of TP\\*PP\\*CP = 4"):
        c.data_parallel_size(6)
    with pytest.raises(ValueError, match="ETP\\*EP\\*PP = 8"):
        MegatronConfig(tensor_parallel=2, pipeline_parallel=2, expert_parallel=2).data_parallel_size(4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"moe_router_fusion": True}, "moe_router_fusion=True skips router replay"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "sinkhorn"),
        ({"tensor_parallel": 0}, "learner.megatron.tensor_parallel must be >= 1"),
        ({"sequence_parallel": True}, "sequence_parallel needs"),
        ({"first_stage_layers": 3}, "first_stage_layers must be >= 0 and needs"),
        ({"dtype": "float16"}, "learner.megatron.dtype"),
        ({"spec": "fast"}, "learner.megatron.spec"),
        ({"temperature": 0.0}, "learner.megatron.temperature must be > 0"),
        ({"adam_beta2": 1.0}, "adam_beta1/adam_beta2"),
    ],
)
def test_bad_configs_raise_naming_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MegatronConfig(**kwargs)


def test_replay_refusals_off_without_replay() -> None:
    MegatronConfig(router_replay=False, moe_router_fusion=True)
    MegatronConfig(router_replay=False, moe_router_load_balancing_type="sinkhorn")


def test_backend_module_imports_without_megatron_core() -> None:
    import actors.learner.megatron.backend  # noqa: F401
    import actors.learner.megatron.replay  # noqa: F401

    assert "megatron" not in sys.modules or "megatron.core" not in sys.modules


def test_model_flops_per_token_by_hand() -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=8, head_dim=2, num_attention_heads=4, num_key_value_heads=2, mlp_only_layers=[0],
                          num_hidden_layers=2, intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=3, vocab_size=10)  # fmt: skip
    attn = 8 * 8 + 2 * 8 * 4 + 8 * 8  # q, k+v, o
    dense = 3 * 8 * 16
    moe = 8 * 4 + 2 * 3 * 8 * 3
    n = 2 * attn + dense + moe + 8 * 10
    assert model_flops_per_token(cfg, seq_len=5) == 6 * n + 6 * 2 * 5 * 8
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("Some GPU") is None
