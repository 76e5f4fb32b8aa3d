"""TorchBackend on tiny real HF models (CPU, fp32): logprobs, route replay, micro-batch gradients, export, save/load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from actors.learner.batching import collate, make_micro_batches
from actors.learner.config import BatchingConfig, TorchBackendConfig
from actors.learner.torch_backend import TorchBackend, aggregate_metrics, linear_head
from async_rl.algorithms.batch import ForwardOutput, MicroBatch, TrainSample
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.algorithms.loss import make_loss_fn
from async_rl.model.hf_routes import find_moe_layers, record_routes

VOCAB = 32


def _moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, max_position_embeddings=128, norm_topk_prob=True,
                          router_aux_loss_coef=0.0, tie_word_embeddings=False)  # fmt: skip


def _moe_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_moe_config(), attn_implementation="eager")
    with torch.no_grad():  # decisive routers, so that different routes give visibly different outputs
        for layer in find_moe_layers(model):
            layer.router.weight.normal_(0.0, 0.5)
    return model


def _dense_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def _samples(n: int, seed: int = 0) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 6)), int(rng.integers(3, 12))
        out.append(TrainSample(
            input_ids=rng.integers(1, VOCAB, p + r).astype(np.int32), prompt_len=p,
            behaviour_logprobs=(-rng.random(r) * 3).astype(np.float32), versions=np.zeros(r, np.int32),
            advantages=rng.standard_normal(r).astype(np.float32), group_id=f"g{i}",
        ))  # fmt: skip
    return out


def pg_loss(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean policy gradient with a step-global denominator (the backend.py contract)."""
    mask = mb.loss_mask.float()
    loss = -(out.logprobs * mb.advantages * mask).sum() / mb.step_num_tokens
    n = mask.sum().clamp(min=1)
    logp = out.logprobs.detach()[mb.loss_mask]
    return loss, {"logp_mean": float(logp.sum() / n), "logp_min": float(logp.min()), "logp_max": float(logp.max())}


def _backend(model: torch.nn.Module, **kw: object) -> TorchBackend:
    cfg = dict(lr=1e-2, device="cpu", grad_clip=0.0)
    cfg.update(kw)
    return TorchBackend(model, TorchBackendConfig(**cfg))


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="learner.torch.lr must be > 0"):
        TorchBackendConfig(lr=0)
    with pytest.raises(ValueError, match="learner.torch.dtype"):
        TorchBackendConfig(dtype="int8")
    with pytest.raises(ValueError, match="learner.torch.betas"):
        TorchBackendConfig(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="learner.torch.device"):
        TorchBackendConfig(device="tpu")
    with pytest.raises(ValueError, match="learner.torch.export_format"):
        TorchBackendConfig(export_format="gguf")
    with pytest.raises(ValueError, match="learner.torch.logprob_chunk_tokens must be >= 0"):
        TorchBackendConfig(logprob_chunk_tokens=-1)


def test_forward_logprobs_match_reference_and_ignore_padding() -> None:
    backend = _backend(_moe_model())
    samples = _samples(4)
    mb = collate(samples, step_num_tokens=1, step_num_sequences=1)
    out = backend.forward_logprobs(mb, with_entropy=True, replay_routes=False)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == mb.input_ids.shape
    assert float(out.logprobs[:, 0].abs().sum()) == 0.0
    assert float(out.logprobs[~mb.attention_mask].abs().sum()) == 0.0
    for i, s in enumerate(samples):
        ids = torch.from_numpy(s.input_ids).long()[None]
        with torch.no_grad():
            logits = backend.model(ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        t = ids.shape[1]
        torch.testing.assert_close(out.logprobs[i, 1:t], lp, rtol=0, atol=2e-5)
        p = torch.softmax(logits[:-1], -1)
        ent = -(p * torch.log_softmax(logits[:-1], -1)).sum(-1)
        torch.testing.assert_close(out.entropy[i, 1:t], ent, rtol=0, atol=2e-5)
    hot = _backend(_moe_model(), temperature=0.5).forward_logprobs(mb, replay_routes=False)
    assert float((hot.logprobs - out.logprobs)[mb.loss_mask].abs().max()) > 1e-3


def test_route_replay_in_forward_prefix_and_changed_routes() -> None:
    backend = _backend(_moe_model())
    samples = _samples(3, seed=1)
    mb = collate(samples, step_num_tokens=1, step_num_sequences=1)
    base = backend.forward_logprobs(mb, replay_routes=False).logprobs
    own = []
    for s in samples:
        with torch.no_grad(), record_routes(backend.model) as rec:
            backend.model(torch.from_numpy(s.input_ids).long()[None])
        own.append(rec.take()[0][0].numpy().astype(np.uint8))
    # Own routes, cut to the tokens "the engine ran" (all but the last): same logprobs as no replay.
    for s, r in zip(samples, own, strict=True):
        s.routes = r[:-1]
    mb = collate(samples, step_num_tokens=1, step_num_sequences=1)
    torch.testing.assert_close(backend.forward_logprobs(mb).logprobs, base, rtol=0, atol=1e-5)
    # Different experts from position 3 of sequence 0 on: only its later logprobs move, and only with replay on.
    samples[0].routes = samples[0].routes.copy()
    samples[0].routes[3:, 0] = (samples[0].routes[3:, 0] + 4) % 8
    mb = collate(samples, step_num_tokens=1, step_num_sequences=1)
    moved = backend.forward_logprobs(mb).logprobs
    torch.testing.assert_close(moved[1:], base[1:], rtol=0, atol=1e-5)
    torch.testing.assert_close(moved[0, :4], base[0, :4], rtol=0, atol=1e-5)
    assert float((moved[0, 4:] - base[0, 4:]).abs().max()) > 1e-3
    torch.testing.assert_close(backend.forward_logprobs(mb, replay_routes=False).logprobs, base, rtol=0, atol=1e-5)


def _grads_and_step(micro_batch_tokens: int, replay: bool, **cfg: object) -> tuple[dict, float, dict]:
    """One step; returns the parameter updates, which with AdamW eps=1, lr=1 are g / (|g| + 1): a smooth function
    of the summed gradient g (a plain Adam first step is ~sign(g) and would hide scaling errors)."""
    samples = _samples(6, seed=2)
    if replay:
        rng = np.random.default_rng(3)
        for s in samples:  # arbitrary (distinct) experts for the first tokens: not the model's own choice
            t = s.input_ids.shape[0] - 1
            s.routes = np.stack([rng.permutation(8)[:2] for _ in range(t * 2)]).reshape(t, 2, 2).astype(np.uint8)
    backend = _backend(_moe_model(), lr=1.0, eps=1.0, **cfg)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    mbs = make_micro_batches(samples, BatchingConfig(micro_batch_tokens=micro_batch_tokens))
    res = backend.train_step(mbs, pg_loss, replay_routes=replay)
    delta = {n: p.detach() - before[n] for n, p in backend.model.named_parameters()}
    return delta, res.grad_norm, res.metrics | {"_num_mbs": len(mbs), "_tokens": res.num_tokens}


def _assert_same_updates(a: dict, b: dict) -> None:
    scale = max(float(v.abs().max()) for v in a.values())
    assert scale > 1e-4
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-6 * scale, msg=n)


@pytest.mark.parametrize("replay", [False, True])
def test_micro_batches_sum_to_one_big_batch(replay: bool) -> None:
    one, g1, m1 = _grads_and_step(10_000, replay)
    many, g2, m2 = _grads_and_step(24, replay)
    assert m1["_num_mbs"] == 1 and m2["_num_mbs"] >= 4
    assert m1["_tokens"] == m2["_tokens"]
    assert g1 > 0 and abs(g1 - g2) <= 1e-5 * g1
    _assert_same_updates(one, many)
    for k in ("logp_mean", "logp_min", "logp_max", "loss"):
        assert abs(m1[k] - m2[k]) <= 1e-5 * max(1.0, abs(m1[k])), k
    assert m1["logp_min"] < m1["logp_mean"] < m1["logp_max"]


def test_replay_matters_for_gradients_and_checkpointing_replays_in_recompute() -> None:
    _, g_own, _ = _grads_and_step(24, replay=False)
    plain, g_rep, _ = _grads_and_step(24, replay=True)
    assert abs(g_own - g_rep) > 1e-4 * g_own  # the forced routes changed the step
    ckpt, g_ckpt, _ = _grads_and_step(24, replay=True, gradient_checkpointing=True)
    assert abs(g_ckpt - g_rep) <= 1e-5 * g_rep
    _assert_same_updates(plain, ckpt)


@pytest.mark.parametrize("dense", [False, True])
def test_chunked_logprobs_equal_the_full_logits_in_forward_and_training(dense: bool) -> None:
    """learner.torch.logprob_chunk_tokens: the same logprobs, entropy and update as the model's full logits (with a
    sampling mask, a temperature and an entropy term in the loss), padding included."""

    def loss(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        assert out.entropy is not None
        pg, metrics = pg_loss(out, mb)
        return pg - 0.3 * (out.entropy * mb.loss_mask).sum() / mb.step_num_tokens, metrics

    samples = _samples(5, seed=4)
    backends = {}
    for chunk in (0, 4):
        model = _dense_model() if dense else _moe_model()
        backends[chunk] = _backend(model, lr=1.0, eps=1.0, temperature=0.7, masked_token_ids=(0,),
                                   logprob_chunk_tokens=chunk)  # fmt: skip
    assert linear_head(backends[4].model) is not None  # the chunked path runs, not the fallback
    capped = _dense_model()
    capped.config.final_logit_softcapping = 30.0  # logits that are more than the head's matmul: full logits
    assert linear_head(capped) is None
    mb = collate(samples, step_num_tokens=40, step_num_sequences=5)
    full, chunked = (backends[c].forward_logprobs(mb, with_entropy=True, replay_routes=False) for c in (0, 4))
    torch.testing.assert_close(chunked.logprobs, full.logprobs, rtol=0, atol=2e-5)
    torch.testing.assert_close(chunked.entropy, full.entropy, rtol=0, atol=2e-5)
    assert float(chunked.logprobs[~mb.attention_mask].abs().sum()) == 0.0
    updates, norms = [], []
    for c in (0, 4):
        before = {n: p.detach().clone() for n, p in backends[c].model.named_parameters()}
        mbs = make_micro_batches(samples, BatchingConfig(micro_batch_tokens=24))
        res = backends[c].train_step(mbs, loss, replay_routes=False, with_entropy=True)
        updates.append({n: p.detach() - before[n] for n, p in backends[c].model.named_parameters()})
        norms.append(res.grad_norm)
    assert norms[0] > 0 and abs(norms[0] - norms[1]) <= 1e-5 * norms[0]
    _assert_same_updates(updates[0], updates[1])


def test_aggregate_metrics_conventions() -> None:
    agg = aggregate_metrics([({"a": 1.0, "x_max": 3.0, "x_min": -1.0, "n_count": 2}, 1.0),
                             ({"a": 4.0, "x_max": 2.0, "x_min": -5.0, "n_count": 3}, 3.0)])  # fmt: skip
    assert agg["a"] == pytest.approx(3.25) and agg["x_max"] == 3.0 and agg["x_min"] == -5.0 and agg["n_count"] == 5


def test_export_loads_into_fresh_model_with_identical_logprobs(tmp_path: Path) -> None:
    backend = _backend(_moe_model(seed=0))
    backend.train_step(make_micro_batches(_samples(4), BatchingConfig()), pg_loss)
    mb = collate(_samples(3, seed=5), step_num_tokens=1, step_num_sequences=1)
    want = backend.forward_logprobs(mb).logprobs
    exported = dict(backend.export_weights())
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in exported.values())
    assert "model.layers.0.mlp.gate.weight" in exported
    fresh = _moe_model(seed=1)
    fresh.load_state_dict(exported, strict=True)
    got = _backend(fresh).forward_logprobs(mb).logprobs
    assert torch.equal(got, want)

    # Checkpoint names (one tensor per expert, what vLLM loads): written as safetensors, read by from_pretrained.
    ckpt = _backend(_moe_model(seed=2), export_format="checkpoint")
    ckpt.model.load_state_dict(exported)
    names = dict(ckpt.export_weights())
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names and not any(k.endswith("gate_up_proj") for k in names)
    _moe_config().save_pretrained(tmp_path)
    save_file(names, str(tmp_path / "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True, attn_implementation="eager")
    assert torch.equal(_backend(loaded).forward_logprobs(mb).logprobs, want)


def test_save_load_round_trip_continues_identically(tmp_path: Path) -> None:
    steps = [make_micro_batches(_samples(4, seed=s), BatchingConfig()) for s in (10, 11)]
    a = _backend(_moe_model(seed=0), weight_decay=0.1, grad_clip=1.0)
    a.train_step(steps[0], pg_loss)
    a.save(tmp_path / "ckpt")
    b = _backend(_moe_model(seed=7), weight_decay=0.1, grad_clip=1.0)
    b.load(tmp_path / "ckpt")
    ra, rb = a.train_step(steps[1], pg_loss), b.train_step(steps[1], pg_loss)
    assert ra.grad_norm == rb.grad_norm
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(x, y), n
    with pytest.raises(ValueError, match="lacks model.pt"):
        b.load(tmp_path / "missing")


def test_reference_model_stays_frozen_and_dense_models_train() -> None:
    backend = TorchBackend(_dense_model(), TorchBackendConfig(lr=1e-2, device="cpu"), reference_model=True)
    assert backend.num_moe_layers == 0 and backend.is_main_rank
    mb = collate(_samples(3, seed=4), step_num_tokens=1, step_num_sequences=1)
    before = backend.forward_logprobs(mb).logprobs
    for _ in range(3):
        res = backend.train_step(make_micro_batches(_samples(4, seed=4), BatchingConfig()), pg_loss)
        assert np.isfinite(res.grad_norm) and res.metrics["step_skipped"] == 0.0
    after = backend.forward_logprobs(mb).logprobs
    ref = backend.forward_logprobs(mb, reference=True).logprobs
    assert torch.equal(ref, before)
    assert float((after - before)[mb.loss_mask].abs().max()) > 1e-3
    no_ref = _backend(_dense_model())
    with pytest.raises(ValueError, match="reference model"):
        no_ref.forward_logprobs(mb, reference=True)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        no_ref.train_step([], pg_loss)


def test_real_loss_fn_and_non_finite_steps_are_skipped() -> None:
    backend = _backend(_moe_model(), lr=1e-3, grad_clip=1.0)
    samples = _samples(6, seed=8)
    mbs = make_micro_batches(samples, BatchingConfig(micro_batch_tokens=32))
    res = backend.train_step(mbs, make_loss_fn(AlgorithmConfig(), learner_version=0), with_entropy=True)
    assert res.metrics["step_skipped"] == 0.0 and 0 < res.grad_norm < float("inf")
    assert res.metrics["loss_tokens_count"] == sum(s.input_ids.size - s.prompt_len for s in samples)
    assert "entropy_mean" in res.metrics and res.metrics["entropy_mean"] > 0
    assert res.num_tokens == sum(s.input_ids.size for s in samples)

    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}

    def nan_loss(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        loss, m = pg_loss(out, mb)
        return loss * float("nan"), m

    res = backend.train_step(mbs, nan_loss)
    assert res.metrics["step_skipped"] == 1.0 and not np.isfinite(res.grad_norm)
    assert all(torch.equal(p, before[n]) for n, p in backend.model.named_parameters())

    dense = _backend(_dense_model())
    samples[0].routes = np.zeros((samples[0].input_ids.size - 1, 2, 2), np.uint8)
    mb = collate(samples[:2], step_num_tokens=1, step_num_sequences=1)
    with pytest.raises(ValueError, match="no router"):
        dense.forward_logprobs(mb)
    assert dense.forward_logprobs(mb, replay_routes=False).logprobs.shape == mb.input_ids.shape


def test_lr_schedules_warm_up_decay_and_hold() -> None:
    from actors.learner.lr_schedule import lr_factor

    def f(step: int, schedule: str, **kw: float) -> float:
        args = {"warmup_steps": 0, "decay_steps": 100, "min_ratio": 0.1, **kw}
        return lr_factor(step, schedule=schedule, **args)  # type: ignore[arg-type]

    assert [f(s, "constant", warmup_steps=4) for s in (1, 2, 4, 5, 10_000)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert f(1, "cosine") == pytest.approx(1.0, abs=1e-3) and f(50, "cosine") == pytest.approx(0.55)
    assert f(100, "cosine") == pytest.approx(0.1) and f(10_000, "cosine") == pytest.approx(0.1)
    assert f(50, "linear") == pytest.approx(0.55) and f(100, "linear") == pytest.approx(0.1)
    assert f(15, "cosine", warmup_steps=10) == f(5, "cosine")  # the decay starts after the warm-up
    with pytest.raises(ValueError, match="learner.torch.lr_decay_steps must be > 0"):
        TorchBackendConfig(lr_schedule="cosine")
    with pytest.raises(ValueError, match="learner.torch.lr_min_ratio"):
        TorchBackendConfig(lr_min_ratio=1.5)


def test_lr_schedule_is_applied_and_continues_after_a_resume(tmp_path: Path) -> None:
    steps = [make_micro_batches(_samples(4, seed=s), BatchingConfig()) for s in range(4)]
    kw = dict(lr=1e-2, lr_schedule="cosine", lr_warmup_steps=1, lr_decay_steps=4, lr_min_ratio=0.1)
    a = _backend(_moe_model(seed=0), **kw)
    lrs = [a.train_step(steps[i], pg_loss).metrics["lr"] for i in range(2)]
    assert lrs == [pytest.approx(1e-2), pytest.approx(a.lr_at(2))] and a.lr_at(2) < 1e-2
    a.save(tmp_path / "ckpt")
    b = _backend(_moe_model(seed=7), **kw)
    b.load(tmp_path / "ckpt")
    assert b.optimizer_steps == 2
    ra, rb = a.train_step(steps[2], pg_loss), b.train_step(steps[2], pg_loss)
    assert ra.metrics["lr"] == rb.metrics["lr"] == pytest.approx(a.lr_at(3))
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(x, y), n
    # A checkpoint written before the schedule existed resumes from Adam's own step count.
    (tmp_path / "ckpt" / "schedule.json").unlink()
    c = _backend(_moe_model(seed=7), **kw)
    c.load(tmp_path / "ckpt")
    assert c.optimizer_steps == 2
