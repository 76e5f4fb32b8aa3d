"""Megatron backend on one GPU: parity with the torch backend, router replay, training, export.

Run on the device (megatron-core wheel on PYTHONPATH): ``python -m pytest -q -m gpu tests/gpu/test_megatron_backend.py``.

Tolerances. Logprob comparisons between the two backends run in float32 with TF32 off and with
the *same* expert routes (the HF model's, replayed in both), so the only difference is the order of
floating-point reductions (fused QKV vs three GEMMs, per-expert loops, softmax placement): float32
rounding through a 4-layer model moves a logprob by ~1e-6..1e-5; we allow 2e-4 (20x the typical
error, far below the 1e-2..1 changes a wrong weight, layout or route produces). Replay equality is
exact (0.0): the same kernels run on the same inputs.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

LP_TOL = 2e-4


def _mcore_or_skip() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pytest.skip("megatron-core is not installed")


@pytest.fixture(scope="module", autouse=True)
def _setup():  # type: ignore[no-untyped-def]
    _mcore_or_skip()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


def _backend(hf, **kw):  # type: ignore[no-untyped-def]
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.config import MegatronConfig

    cfg = MegatronConfig(**{"dtype": "float32", "recompute": False, "lr": 1e-3, **kw})
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    return MegatronBackend(cfg, hf.config, sd)


def _torch_backend(hf, dtype: str = "float32", lr: float = 1e-3, **kw):  # type: ignore[no-untyped-def]
    from actors.learner.config import TorchBackendConfig
    from actors.learner.torch_backend import TorchBackend

    return TorchBackend(copy.deepcopy(hf), TorchBackendConfig(dtype=dtype, device="cuda", lr=lr, **kw))


def _valid_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.clone()
    m[:, 0] = False
    return float((a - b).abs()[m].max())


def test_pipeline_split_matches_megatron_core() -> None:
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from actors.learner.megatron.routes import PipelineSplit

    cases = [(8, 2, None, None, False, False), (7, 2, 3, None, False, False), (7, 2, None, 3, False, False),
             (27, 2, 13, None, False, False), (10, 4, 1, 1, False, False), (9, 3, 3, None, False, False),
             (6, 4, None, None, True, True), (7, 2, None, None, True, False), (12, 3, None, None, False, False)]  # fmt: skip
    for n, pp, first, last, emb, loss in cases:
        ours = PipelineSplit(num_layers=n, pp_size=pp, first_stage_layers=first, last_stage_layers=last,
                             account_for_embedding=emb, account_for_loss=loss)  # fmt: skip
        cfg = SimpleNamespace(num_layers=n, pipeline_model_parallel_size=pp, num_layers_in_first_pipeline_stage=first,
                              num_layers_in_last_pipeline_stage=last, account_for_embedding_in_pipeline_split=emb,
                              account_for_loss_in_pipeline_split=loss, pipeline_model_parallel_layout=None,
                              virtual_pipeline_model_parallel_size=None, mtp_num_layers=None)  # fmt: skip
        for r in range(pp):
            assert get_transformer_layer_offset(cfg, pp_rank=r) == ours.offset(r), (n, pp, first, last, r)
            assert get_num_layers_to_build(cfg, pp_rank=r) == ours.num_layers_on(r), (n, pp, first, last, r)


@pytest.mark.parametrize("attention, experts", [("sdpa", "grouped"), ("unfused", "sequential")])
def test_logprobs_match_torch_backend_fp32(attention: str, experts: str) -> None:
    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, toy_config, with_routes

    cfg = toy_config()
    hf = build_hf(cfg)
    mb = make_batch(cfg, [48, 33, 17], seed=3)
    mb_r = with_routes(mb, hf_routes(hf, mb))
    meg, tb = _backend(hf, attention=attention, experts=experts), _torch_backend(hf)
    try:
        m_rep = meg.forward_logprobs(mb_r, replay_routes=True, with_entropy=True)
        t_rep = tb.forward_logprobs(mb_r, replay_routes=True, with_entropy=True)
        m_free = meg.forward_logprobs(mb, replay_routes=False)
        t_free = tb.forward_logprobs(mb, replay_routes=False)
    finally:
        meg.close()
    d_rep = _valid_diff(m_rep.logprobs, t_rep.logprobs, mb.attention_mask)
    d_ent = _valid_diff(m_rep.entropy, t_rep.entropy, mb.attention_mask)
    d_free = (m_free.logprobs - t_free.logprobs).abs()[mb.attention_mask]
    print(f"megatron ({attention}, {experts}) vs torch fp32: replayed max|dlp|={d_rep:.3e} entropy {d_ent:.3e}; "
          f"free routing median {float(d_free.median()):.3e} max {float(d_free.max()):.3e}")  # fmt: skip
    assert d_rep < LP_TOL and d_ent < LP_TOL
    # Free routing: same maths, so routes agree except at exact near-ties; nearly every token matches.
    assert float((d_free < LP_TOL).float().mean()) > 0.99
    assert (m_rep.logprobs[~mb.attention_mask] == 0).all() and (m_rep.logprobs[:, 0] == 0).all()


def test_token_mask_matches_torch_backend_and_generator() -> None:
    """The sampling mask (async_rl/model/token_mask.py) on Megatron's logits: same logprobs and entropy as the torch
    backend with the same mask, and the masked ids hold no probability (a sampled-then-masked token would be -1e9)."""
    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, toy_config, with_routes

    cfg = toy_config()
    hf = build_hf(cfg)
    mb = with_routes(make_batch(cfg, [40, 25], seed=5), hf_routes(hf, make_batch(cfg, [40, 25], seed=5)))
    present = set(mb.input_ids[mb.attention_mask].tolist())  # a masked id as a label would be a -1e9 logprob
    ids = tuple(i for i in range(cfg.vocab_size) if i not in present)[:40]
    assert len(ids) >= 10
    meg, tb = _backend(hf, masked_token_ids=ids), _torch_backend(hf, masked_token_ids=ids)
    plain = _torch_backend(hf)
    try:
        m = meg.forward_logprobs(mb, replay_routes=True, with_entropy=True)
        t = tb.forward_logprobs(mb, replay_routes=True, with_entropy=True)
        u = plain.forward_logprobs(mb, replay_routes=True, with_entropy=True)
    finally:
        meg.close()
    d_lp = _valid_diff(m.logprobs, t.logprobs, mb.attention_mask)
    d_ent = _valid_diff(m.entropy, t.entropy, mb.attention_mask)
    shift = _valid_diff(u.logprobs, t.logprobs, mb.attention_mask)
    print(f"masked megatron vs torch: max|dlp|={d_lp:.3e} entropy {d_ent:.3e}; mask moves logprobs by {shift:.3e}")
    assert d_lp < LP_TOL and d_ent < LP_TOL and bool(torch.isfinite(m.entropy).all())
    assert shift > 10 * LP_TOL  # the mask changes the distribution: the comparison above is not vacuous


def test_bf16_grouped_experts_close_to_torch_backend() -> None:
    """bf16 (grouped_mm experts, SDPA): same routes replayed in both backends, differences at bf16 noise level."""
    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, toy_config, with_routes

    cfg = toy_config()
    hf = build_hf(cfg, dtype=torch.bfloat16)
    mb = make_batch(cfg, [64, 40, 23], seed=9)
    mb = with_routes(mb, hf_routes(hf, mb))
    meg = _backend(hf, dtype="bfloat16")
    try:
        m = meg.forward_logprobs(mb, replay_routes=True).logprobs
    finally:
        meg.close()
    t = _torch_backend(hf, dtype="bfloat16").forward_logprobs(mb, replay_routes=True).logprobs
    mask = mb.attention_mask.clone()
    mask[:, 0] = False
    d = (m - t).abs()[mask]
    print(f"bf16 megatron (grouped, sdpa) vs torch: mean|dlp|={float(d.mean()):.2e} max {float(d.max()):.2e}")
    # bf16 keeps 8 bits of mantissa: activations carry ~4e-3 relative error per rounding; through 4 layers
    # logprobs (|lp| ~ 6) move by a few 1e-2 at most. A wrong expert layout moves them by ~1.
    assert float(d.mean()) < 2e-2 and float(d.max()) < 0.25


def test_replay_reproduces_recorded_forward_exactly_bf16_with_recompute() -> None:
    from actors.learner.megatron.toy import build_hf, make_batch, random_routes, toy_config, with_routes

    cfg = toy_config()
    hf = build_hf(cfg)
    meg = _backend(hf, dtype="bfloat16", recompute=True)
    try:
        mb = make_batch(cfg, [64, 40, 23, 9], seed=4)
        rec = meg.record_routes(mb)
        assert len(rec) == 4 and rec[0].shape == (64, meg.num_moe_layers, 2) and rec[0].dtype == np.uint8
        free = meg.forward_logprobs(mb, replay_routes=False).logprobs
        replayed = meg.forward_logprobs(with_routes(mb, rec), replay_routes=True).logprobs
        rand = random_routes(mb, meg.num_moe_layers, 2, 8)
        other = meg.forward_logprobs(with_routes(mb, rand), replay_routes=True).logprobs
        again = meg.forward_logprobs(with_routes(mb, rand), replay_routes=True).logprobs
    finally:
        meg.close()
    d_same = float((free - replayed).abs().max())
    d_other = _valid_diff(free, other, mb.attention_mask)
    print(f"bf16 replay of recorded routes: max|dlp|={d_same}; random routes: max|dlp|={d_other:.3f}")
    assert d_same == 0.0
    assert d_other > 0.05
    assert torch.equal(other, again)


def test_backward_replay_with_recompute_matches_no_recompute_and_torch() -> None:
    """Gradients with full recompute (REPLAY_BACKWARD) equal those without recompute and the torch backend's."""
    from actors.learner.megatron.toy import build_hf, make_batch, nll_loss, random_routes, toy_config, with_routes

    cfg = toy_config()
    hf = build_hf(cfg)
    mb = make_batch(cfg, [40, 31, 12], seed=5)
    mb = with_routes(mb, random_routes(mb, 3, 2, 8, seed=7))  # far from the learned routing: errors show
    norms = {}
    cases = {"plain": ({"recompute": False}, [mb]), "recompute": ({"recompute": True}, [mb]),
             "recompute_two_micro_batches": ({"recompute": True}, _split(mb, 2))}  # fmt: skip
    for name, (kw, mbs) in cases.items():
        meg = _backend(hf, **kw)
        try:
            norms[name] = meg.train_step(mbs, nll_loss, replay_routes=True).grad_norm
        finally:
            meg.close()
    tb = _torch_backend(hf)
    norms["torch"] = tb.train_step([mb], nll_loss, replay_routes=True).grad_norm
    print("grad norms:", norms)
    ref = norms["plain"]
    for k, v in norms.items():
        assert abs(v - ref) / ref < 1e-4, (k, v, ref)


def _split(mb, parts: int):  # type: ignore[no-untyped-def]
    from async_rl.algorithms.batch import MicroBatch

    out = []
    for rows in np.array_split(np.arange(mb.num_sequences), parts):
        idx = torch.from_numpy(rows)
        out.append(MicroBatch(
            input_ids=mb.input_ids[idx], attention_mask=mb.attention_mask[idx], loss_mask=mb.loss_mask[idx],
            behaviour_logprobs=mb.behaviour_logprobs[idx], advantages=mb.advantages[idx],
            token_versions=mb.token_versions[idx], routes=[mb.routes[i] for i in rows],
            step_num_tokens=mb.step_num_tokens, step_num_sequences=mb.step_num_sequences,
        ))  # fmt: skip
    return out


def test_training_reduces_loss_bf16_with_replay_and_recompute() -> None:
    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, nll_loss, toy_config, with_routes

    cfg = toy_config()
    hf = build_hf(cfg)
    mb = make_batch(cfg, [64, 57, 40, 33], seed=6)
    mb = with_routes(mb, hf_routes(hf, mb))
    meg = _backend(hf, dtype="bfloat16", recompute=True, lr=3e-4)
    try:
        losses = [meg.train_step(_split(mb, 2), nll_loss, replay_routes=True).metrics["nll_per_token"]
                  for _ in range(6)]  # fmt: skip
    finally:
        meg.close()
    print("nll per token over 6 steps:", [round(x, 4) for x in losses])
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.1
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))


def test_exported_weights_reload_into_torch_with_same_logprobs() -> None:
    from transformers import Qwen3MoeForCausalLM

    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, nll_loss, toy_config, with_routes

    cfg = toy_config()
    hf = build_hf(cfg)
    mb = make_batch(cfg, [48, 30], seed=8)
    mb = with_routes(mb, hf_routes(hf, mb))
    meg = _backend(hf, lr=1e-3)
    try:
        for _ in range(2):
            meg.train_step([mb], nll_loss, replay_routes=True)
        after = meg.forward_logprobs(mb, replay_routes=True).logprobs
        exported = dict(meg.export_weights())
        on_gpu = dict(meg.snapshot_source())  # what the learner's pinned snapshot copies: the same bits, on the GPU
    finally:
        meg.close()
    assert sorted(on_gpu) == sorted(exported) and all(t.is_cuda for t in on_gpu.values())
    assert all(torch.equal(on_gpu[k].cpu(), v) for k, v in exported.items())
    fresh = Qwen3MoeForCausalLM(cfg)
    missing, unexpected = fresh.load_state_dict(exported, strict=True)
    assert not missing and not unexpected
    changed = max(float((exported[k].float() - v.float().cpu()).abs().max()) for k, v in hf.state_dict().items())
    assert changed > 1e-4, "training did not change the exported weights"
    tb = _torch_backend(fresh.to("cuda").eval())
    reloaded = tb.forward_logprobs(mb, replay_routes=True).logprobs
    d = _valid_diff(after, reloaded, mb.attention_mask)
    print(f"export -> torch reload: max|dlp|={d:.3e} (weights moved by up to {changed:.3e})")
    assert d < LP_TOL


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_save_load_resumes_training(tmp_path, distributed_optimizer: bool) -> None:  # type: ignore[no-untyped-def]
    """A backend loaded from a checkpoint continues exactly where the saved one went on (model + Adam state), with
    the distributed optimizer too (one rank: its shard is the whole state, through the sharded save and load)."""
    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, nll_loss, toy_config, with_routes

    cfg = toy_config()
    hf = build_hf(cfg)
    mb = make_batch(cfg, [48, 30], seed=10)
    mb = with_routes(mb, hf_routes(hf, mb))
    a = _backend(hf, lr=1e-3, distributed_optimizer=distributed_optimizer)
    try:
        a.train_step([mb], nll_loss, replay_routes=True)
        a.save(tmp_path)
        a.train_step([mb], nll_loss, replay_routes=True)
        lp_a = a.forward_logprobs(mb, replay_routes=True).logprobs
    finally:
        a.close()
    other = _backend(hf, lr=1e-3, distributed_optimizer=not distributed_optimizer)
    try:  # the other optimizer setting is refused in one line, before anything is copied
        with pytest.raises(ValueError, match="distributed optimizer; this learner runs"):
            other.load(tmp_path)
    finally:
        other.close()
    b = _backend(hf, lr=1e-3, distributed_optimizer=distributed_optimizer)
    try:
        b.load(tmp_path)
        b.train_step([mb], nll_loss, replay_routes=True)
        lp_b = b.forward_logprobs(mb, replay_routes=True).logprobs
    finally:
        b.close()
    c = _backend(hf, lr=1e-3, distributed_optimizer=distributed_optimizer)  # no checkpoint: one step from the start
    try:
        c.train_step([mb], nll_loss, replay_routes=True)
        fresh_step = c.forward_logprobs(mb, replay_routes=True).logprobs
    finally:
        c.close()
    d_resume = _valid_diff(lp_a, lp_b, mb.attention_mask)
    d_fresh = _valid_diff(lp_a, fresh_step, mb.attention_mask)
    print(f"save/load: resumed vs uninterrupted max|dlp|={d_resume:.3e}; without the checkpoint {d_fresh:.3e}")
    assert d_resume < LP_TOL
    assert d_fresh > 100 * max(d_resume, 1e-6)


def test_pad_inside_responses_gives_torch_s_gradient_norm() -> None:
    """HF pad semantics: the pad row of the word embedding gets no gradient in either backend, so a batch with pad
    tokens inside responses (a random policy samples them) gives the same step-1 gradient norm (within 1%), and
    the pad row stays exactly as loaded (zero) in the exported weights."""
    from actors.learner.megatron.toy import build_hf, make_batch, nll_loss, toy_config

    cfg = toy_config(num_layers=3)
    cfg.pad_token_id = 0
    hf = build_hf(cfg, dtype=torch.float32)
    with torch.no_grad():
        hf.model.embed_tokens.weight[0].zero_()  # as HF's init does for padding_idx
    assert hf.model.embed_tokens.padding_idx == 0
    mb = make_batch(cfg, [40, 33, 28], prompt_len=8, seed=3)
    mb.input_ids[mb.loss_mask & (torch.rand(mb.input_ids.shape, generator=torch.Generator().manual_seed(1)) < 0.15)] = 0
    assert int((mb.input_ids[mb.loss_mask] == 0).sum()) > 5
    tb = _torch_backend(hf)
    mg = _backend(hf, clip_grad=0.0)
    tb.config.grad_clip = 0.0
    t_norm = tb.train_step([mb], nll_loss, replay_routes=False).grad_norm
    m_norm = mg.train_step([mb], nll_loss, replay_routes=False).grad_norm
    assert m_norm == pytest.approx(t_norm, rel=0.01), (m_norm, t_norm)
    exported = dict(mg.export_weights())
    assert torch.equal(exported["model.embed_tokens.weight"][0], torch.zeros_like(exported["model.embed_tokens.weight"][0]))
    mg.close()


def test_reference_model_gives_the_initial_policy_after_training() -> None:
    """KL with backend=megatron: the reference forward returns the initial weights' logprobs (as the torch backend's
    frozen reference does) after training has moved the live weights, and the live weights stay as trained."""
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.config import MegatronConfig
    from actors.learner.megatron.toy import build_hf, make_batch, nll_loss, toy_config

    cfg = toy_config(num_layers=3)
    hf = build_hf(cfg, dtype=torch.float32)
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    mg = MegatronBackend(MegatronConfig(dtype="float32", recompute=False, lr=1e-2), hf.config, sd, reference_model=True)
    mb = make_batch(cfg, [40, 33, 28], prompt_len=8, seed=5)
    initial = _torch_backend(hf).forward_logprobs(mb, replay_routes=False).logprobs
    for _ in range(3):
        mg.train_step([mb], nll_loss, replay_routes=False)
    live = mg.forward_logprobs(mb, replay_routes=False).logprobs
    ref = mg.forward_logprobs(mb, replay_routes=False, reference=True).logprobs
    assert _valid_diff(ref, initial, mb.loss_mask) < LP_TOL
    assert _valid_diff(live, initial, mb.loss_mask) > 1e-2  # training moved the live policy
    assert torch.equal(mg.forward_logprobs(mb, replay_routes=False).logprobs, live)  # swapped back exactly
    mg.close()


def test_host_counts_reach_the_gpu_without_a_host_wait() -> None:
    """Under expert parallelism megatron's dispatcher gives the experts their counts on the host: the copy back to the
    GPU for the grouped GEMM's offsets must not wait for the GPU to drain (a plain copy does: torch raises here)."""
    from actors.learner.megatron.spec import device_counts

    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int64)
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            counts.to(device=dev, dtype=torch.int32)
        got = device_counts(counts, dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.dtype == torch.int32 and got.device == dev and got.tolist() == [3, 0, 5, 1]


def test_the_clipping_norm_is_megatron_s_own_without_a_host_wait() -> None:
    from megatron.core.utils import local_multi_tensor_l2_norm

    from actors.learner.megatron.grad_norm import device_l2_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(n, 257, device="cuda", generator=g) for n in (1, 64, 300)]
    theirs, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours, _ = device_l2_norm(2048 * 32, None, [grads], False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ours.device.type == "cuda" and torch.allclose(ours, theirs, rtol=1e-6, atol=0)
