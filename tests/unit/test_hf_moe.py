"""Route recording and replay on real (tiny, random-init) Hugging Face MoE models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from async_rl.model.hf_routes import NO_ROUTE, find_moe_layers, pack_routes, record_routes, replay_routes
from async_rl.model.moe import route_dtype


def _qwen3_moe(seed: int = 0, **kw: object) -> torch.nn.Module:
    cfg = dict(vocab_size=32, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
               max_position_embeddings=128, norm_topk_prob=True, router_aux_loss_coef=0.0)  # fmt: skip
    cfg.update(kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg), attn_implementation="eager")
    with torch.no_grad():  # the default init makes routers near-uniform; spread them so routes are decisive
        for layer in find_moe_layers(model):
            layer.router.weight.normal_(0.0, 0.5)
    return model.eval()


def test_find_layers_skips_dense_layers_and_reads_shape() -> None:
    model = _qwen3_moe(mlp_only_layers=[1])
    layers = find_moe_layers(model)
    assert [x.name for x in layers] == ["model.layers.0.mlp", "model.layers.2.mlp"]
    assert [x.index for x in layers] == [0, 1]
    assert {(x.num_experts, x.top_k) for x in layers} == {(8, 2)}
    dense = AutoModelForCausalLM.from_config(
        Qwen3Config(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )  # fmt: skip
    )
    assert find_moe_layers(dense) == []
    with pytest.raises(ValueError, match="no MoE router"):
        record_routes(dense)


def test_record_matches_router_choice_and_decode_steps() -> None:
    model = _qwen3_moe()
    ids = torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(1))
    with record_routes(model) as rec:
        model(ids)
    (routes,) = rec.take()
    assert routes.shape == (3, 6, 3, 2)
    # Layer 0's router sees the embeddings after the first attention block: check against a direct computation.
    layer0 = find_moe_layers(model)[0]
    seen: list[torch.Tensor] = []
    h = layer0.block.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    model(ids)
    h.remove()
    logits = seen[0].reshape(-1, 64) @ layer0.router.weight.T
    want = logits.softmax(-1).topk(2, dim=-1).indices.reshape(3, 6, 2)
    assert torch.equal(routes[:, :, 0], want)
    assert rec.take() == []

    # Generation with a KV cache: one forward per step, prefill then seq == 1; the prefix matches a full forward.
    with record_routes(model) as rec:
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    steps = rec.take()
    assert [tuple(s.shape) for s in steps] == [(3, 6, 3, 2)] + [(3, 1, 3, 2)] * 3
    decoded = torch.cat(steps, dim=1)
    with record_routes(model) as rec:
        model(out[:, :-1])
    (full,) = rec.take()
    assert torch.equal(decoded, full)
    # Hooks are gone after the context.
    with record_routes(model) as rec:
        pass
    model(ids)
    assert rec.take() == []


def test_replay_own_routes_is_exact_and_other_routes_change_output() -> None:
    model = _qwen3_moe()
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), record_routes(model) as rec:
        base = model(ids).logits
    (routes,) = rec.take()
    with torch.no_grad(), replay_routes(model, routes):
        again = model(ids).logits
    assert torch.equal(base, again)

    other = routes.clone()
    other[:, 4:, 1, :] = (other[:, 4:, 1, :] + 3) % 8  # shift layer 1's experts from position 4 on
    with torch.no_grad(), replay_routes(model, other) as rep, record_routes(model) as rec:
        changed = model(ids).logits
    assert rep is not None
    (seen,) = rec.take()
    assert torch.equal(seen, other)  # the experts actually run are the replayed ones
    # Causal: earlier positions unaffected (up to matmul batching order inside the experts).
    torch.testing.assert_close(changed[:, :4], base[:, :4], rtol=0, atol=1e-5)
    assert (changed[:, 4:] - base[:, 4:]).abs().max() > 1e-3


def test_replay_with_padding_rows_and_unrun_positions() -> None:
    model = _qwen3_moe()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), record_routes(model) as rec:
        base = model(ids).logits
    (routes,) = rec.take()
    # Sequence 0 replays only its first 5 positions, sequence 1 nothing: the rest keeps the model's own routing.
    packed = pack_routes([routes[0, :5].numpy().astype(np.uint8), None], 8, 3, 2)
    assert (packed[0, 5:] == NO_ROUTE).all() and (packed[1] == NO_ROUTE).all()
    with torch.no_grad(), replay_routes(model, packed):
        out = model(ids).logits
    assert torch.equal(out, base)
    # Right padding with garbage-free -1 rows leaves the real tokens exactly as without padding.
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[:, 8:] = 0
    padded = torch.cat([ids, torch.zeros(2, 2, dtype=torch.long)], dim=1)
    with torch.no_grad(), replay_routes(model, pack_routes([routes[0].numpy(), routes[1].numpy()], 10, 3, 2)):
        out_pad = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(out_pad[:, :8], base, rtol=0, atol=1e-5)


def test_replay_gradients_reach_router() -> None:
    model = _qwen3_moe().train()
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    (routes,) = rec.take()
    routers = [x.router.weight for x in find_moe_layers(model)]

    def grads(r: torch.Tensor | None) -> list[torch.Tensor]:
        model.zero_grad()
        with replay_routes(model, r):
            model(ids).logits.logsumexp(-1).mean().backward()
        return [w.grad.clone() for w in routers]

    own = grads(None)
    replayed = grads(routes)
    for a, b in zip(own, replayed, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    shifted = routes.clone()
    shifted[..., 0, :] = (shifted[..., 0, :] + 1) % 8
    moved = grads(shifted)
    assert moved[0].abs().sum() > 0 and not torch.allclose(moved[0], own[0])


def test_replay_validates_routes() -> None:
    model = _qwen3_moe()
    with pytest.raises(ValueError, match=r"\[batch, seq, 3 moe_layers, 2 top_k\]"):
        replay_routes(model, torch.zeros(1, 4, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="allowed are -1"):
        replay_routes(model, torch.full((1, 4, 3, 2), 8, dtype=torch.long))
    bad = torch.zeros(1, 4, 3, 2, dtype=torch.long)
    bad[..., 1] = 1
    bad[0, 0, 0] = torch.tensor([-1, 3])
    with pytest.raises(ValueError, match="mixed row"):
        replay_routes(model, bad)
    bad[0, 0, 0] = torch.tensor([2, 2])
    with pytest.raises(ValueError, match="distinct"):
        replay_routes(model, bad)
    ok = torch.stack([torch.zeros(1, 4, 3), torch.ones(1, 4, 3)], dim=-1).long()
    with replay_routes(model, ok), pytest.raises(ValueError, match="cover 1x4 tokens"):
        model(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="more than the sequence length"):
        pack_routes([np.zeros((6, 3, 2), np.uint8)], 5, 3, 2)
    assert route_dtype(128) == np.uint8 and route_dtype(257) == np.int16


def test_mixtral_router_replay() -> None:
    cfg = MixtralConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), record_routes(model) as rec:
        base = model(ids).logits
    (routes,) = rec.take()
    assert routes.shape == (2, 5, 2, 2)
    with torch.no_grad(), replay_routes(model, routes):
        assert torch.equal(model(ids).logits, base)


def test_qwen2_moe_unnormalised_weights_and_shared_expert() -> None:
    cfg = Qwen2MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in find_moe_layers(model):
            layer.router.weight.normal_(0.0, 0.5)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), record_routes(model) as rec:
        base = model(ids).logits
    (routes,) = rec.take()
    with torch.no_grad(), replay_routes(model, routes):
        assert torch.equal(model(ids).logits, base)
    swapped = routes.flip(-1)  # same experts, other order: weights follow the experts, so the output is the same
    with torch.no_grad(), replay_routes(model, swapped):
        torch.testing.assert_close(model(ids).logits, base, rtol=0, atol=1e-5)
