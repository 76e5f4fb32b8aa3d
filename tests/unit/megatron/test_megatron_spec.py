"""Spec surgery and stacked-expert naming of the Megatron backend (CPU, no megatron-core import)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from actors.learner.megatron.convert import RankNaming, global_name
from actors.learner.megatron.spec import _swap
from actors.learner.megatron.weights import expand_stacked


class SequentialMLP:  # stands in for megatron's class of the same name (matched by name)
    pass


class DotProductAttention:
    pass


class GroupedExperts:
    pass


@dataclasses.dataclass
class Inner:
    experts: object = None
    other: object = None


@dataclasses.dataclass
class Layer:
    core_attention: object = None
    mlp: object = None
    layers: list = dataclasses.field(default_factory=list)


def test_swap_reaches_partials_nested_dataclasses_and_lists() -> None:
    inner = Inner(experts=functools.partial(SequentialMLP, submodules="subs"), other=DotProductAttention)
    spec = Layer(core_attention=DotProductAttention, mlp=functools.partial(object, submodules=inner),
                 layers=[Layer(core_attention=DotProductAttention)])  # fmt: skip
    _swap(spec, set(), ("SequentialMLP",), GroupedExperts)
    assert isinstance(inner.experts, functools.partial) and inner.experts.func is GroupedExperts
    assert inner.experts.keywords == {"submodules": "subs"}
    assert spec.core_attention is DotProductAttention  # untouched: not asked for
    _swap(spec, set(), ("DotProductAttention",), GroupedExperts)
    assert spec.core_attention is GroupedExperts and spec.layers[0].core_attention is GroupedExperts
    assert inner.other is GroupedExperts


def test_stacked_expert_weights_expand_to_global_expert_names() -> None:
    w1 = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    w2 = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    named = [("decoder.layers.0.mlp.experts.weight1", w1), ("decoder.layers.0.mlp.experts.weight2", w2),
             ("decoder.layers.0.mlp.router.weight", torch.zeros(4, 4))]  # fmt: skip
    naming = RankNaming(layer_offset=3, num_local_layers=2, expert_offset=2, num_local_experts=2)
    moe = (True,) * 5
    out = {global_name(n, naming, moe): t for n, t in expand_stacked(iter(named))}
    assert sorted(out) == [
        "decoder.layers.3.mlp.experts.2.linear_fc1.weight", "decoder.layers.3.mlp.experts.2.linear_fc2.weight",
        "decoder.layers.3.mlp.experts.3.linear_fc1.weight", "decoder.layers.3.mlp.experts.3.linear_fc2.weight",
        "decoder.layers.3.mlp.router.weight",
    ]  # fmt: skip
    assert torch.equal(out["decoder.layers.3.mlp.experts.3.linear_fc1.weight"], w1[1])
    assert torch.equal(out["decoder.layers.3.mlp.experts.2.linear_fc2.weight"], w2[0])


def test_token_stats_single_rank_matches_log_softmax() -> None:
    from actors.learner.megatron.logits import token_stats

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    lp, ent = token_stats(logits, labels, True, None, 1)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert ent is not None
    torch.testing.assert_close(lp.double(), ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)
    lp2, ent2 = token_stats(logits, labels, False, None, 1)
    assert ent2 is None and torch.equal(lp2, lp)
