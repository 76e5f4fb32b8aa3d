"""TorchEngine against separate full forward passes of real transformers models (no mocks).

Tolerance: logprobs agree with a full, unpadded, uncached forward within LOGPROB_ATOL (float32;
the engine's batched, left-padded, KV-cached path differs only by float reassociation).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from actors.generator.config import TorchEngineConfig
from actors.generator.engine import SamplingParams
from actors.generator.sampling import sample_tokens
from actors.generator.torch_engine import TorchEngine
from async_rl.model import toy_tokenizer as tt
from async_rl.model.presets import build_model, cache_kwarg, save_pretrained_dir, tiny_moe_config
from async_rl.model.token_mask import mask_logits, masked_token_ids

LOGPROB_ATOL = 1e-4
"""float32: observed differences are ~1e-6; 1e-4 leaves room for other CPUs' kernels."""
TIE_ATOL = 1e-5
"""Two router probabilities closer than this are a tie: either expert is a correct top-k choice."""
PROMPTS = ["12345=", "9=", "31+47=", "0123456789<"]


def prompt_ids() -> list[np.ndarray]:
    return [np.array([tt.BOS_ID, *tt.encode(t)], dtype=np.int32) for t in PROMPTS]


def peaked_model(preset: str = "tiny-moe", seed: int = 0, config=None):
    """A random-init model with a sharpened output layer, so greedy choices are far from ties."""
    model = build_model(config if config is not None else preset, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


def make_engine(model, **kw) -> TorchEngine:
    return TorchEngine(TorchEngineConfig(**kw), model=model)


def reference_logprobs(model, prompt: np.ndarray, response: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Logprob of each response token under the processed distribution, from one full forward pass."""
    full = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None].to(model.device)
    with torch.inference_mode():
        logits = model(full).logits[0, prompt.size - 1 : prompt.size - 1 + response.size].double().cpu()
    if params.mask_special_tokens:
        logits = logits.index_fill(-1, torch.tensor(masked_token_ids("tiny-moe")), float("-inf"))
    if params.temperature == 0:
        lp = torch.log_softmax(logits, -1)
    else:
        logits = logits / params.temperature
        rows = []
        for row in logits:
            keep = torch.ones_like(row, dtype=torch.bool)
            if params.top_k:
                keep &= row >= row.topk(params.top_k).values[-1]
            if params.top_p < 1:
                order = row.argsort(descending=True)
                probs = torch.softmax(row, -1)[order]
                before = torch.cumsum(probs, 0) - probs
                keep_sorted = before < params.top_p
                keep &= torch.zeros_like(keep).scatter(0, order, keep_sorted)
            rows.append(torch.log_softmax(row.masked_fill(~keep, float("-inf")), -1))
        lp = torch.stack(rows)
    return lp.gather(-1, torch.from_numpy(response.astype(np.int64))[:, None]).squeeze(-1).float().numpy()


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, max_new_tokens=12, temperature=1.0, seed=1),
        SamplingParams(n=3, max_new_tokens=12, temperature=0.7, top_k=5, seed=2),
        SamplingParams(n=3, max_new_tokens=12, temperature=1.3, top_p=0.9, seed=3),
    ],
    ids=["t1", "t0.7-topk5", "t1.3-topp0.9"],
)
async def test_logprobs_match_full_forward(preset, params):
    engine = make_engine(build_model(preset, seed=0))
    prompts = prompt_ids()
    groups = await engine.generate(prompts, params)
    assert len(groups) == len(prompts) and all(len(g) == params.n for g in groups)
    worst = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32 and c.versions.dtype == np.int32
            assert 1 <= c.token_ids.size <= params.max_new_tokens
            assert c.finish_reason == ("stop" if c.token_ids[-1] == tt.EOS_ID else "length")
            assert tt.EOS_ID not in c.token_ids[:-1].tolist()
            ref = reference_logprobs(engine.model, prompt, c.token_ids, params)
            assert np.isfinite(ref).all(), "a token outside the truncated distribution was sampled"
            worst = max(worst, float(np.abs(ref - c.logprobs).max()))
            assert (c.versions == -1).all()
            assert (c.routes is None) == (preset == "tiny-dense")
    assert worst < LOGPROB_ATOL, worst


async def test_greedy_is_deterministic_and_matches_hf_generate():
    engine = make_engine(peaked_model())
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0.0)
    a = await engine.generate(prompt_ids(), params)
    b = await engine.generate(prompt_ids()[::-1], params)
    for ga, gb in zip(a, b[::-1], strict=True):
        for ca, cb in zip(ga + gb, gb + ga, strict=True):
            assert np.array_equal(ca.token_ids, cb.token_ids)
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=LOGPROB_ATOL)
    for prompt, group in zip(prompt_ids(), a, strict=True):
        c = group[0]
        hf = engine.model.generate(
            torch.from_numpy(prompt.astype(np.int64))[None], do_sample=False, max_new_tokens=10,
            eos_token_id=tt.EOS_ID, pad_token_id=tt.PAD_ID, suppress_tokens=list(masked_token_ids("tiny-moe")),
        )[0, prompt.size :].numpy()  # fmt: skip
        assert np.array_equal(hf[: c.token_ids.size], c.token_ids)
        np.testing.assert_allclose(
            c.logprobs, reference_logprobs(engine.model, prompt, c.token_ids, params), atol=LOGPROB_ATOL
        )


def router_topk(model, tokens: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The routers' own choices on a full re-run: (sorted top-k ids [T, L, K], probs [T, L, E])."""
    with torch.inference_mode():
        out = model(torch.from_numpy(tokens.astype(np.int64))[None].to(model.device), output_router_logits=True)
    probs = torch.stack([torch.softmax(r.float().cpu(), -1) for r in out.router_logits], dim=1)  # [T, L, E]
    return probs.topk(top_k, dim=-1).indices.sort(-1).values.numpy(), probs.numpy()


def assert_routes_match(routes: np.ndarray, expected: np.ndarray, probs: np.ndarray) -> int:
    """Sorted route rows equal the routers' top-k, except where the boundary experts tie. Returns mismatches."""
    got = np.sort(routes.astype(np.int64), axis=-1)
    mismatches = 0
    for t, layer in zip(*np.nonzero((got != expected).any(-1)), strict=True):
        p = probs[t, layer]
        k = expected.shape[-1]
        kth, next_ = np.sort(p)[::-1][k - 1], np.sort(p)[::-1][k]
        assert kth - next_ < TIE_ATOL, f"route mismatch at token {t}, layer {layer}: {got[t, layer]} vs top-k"
        assert set(got[t, layer]) - set(expected[t, layer]) <= set(np.nonzero(np.abs(p - kth) < TIE_ATOL)[0])
        mismatches += 1
    return mismatches


@pytest.mark.parametrize("preset", ["tiny-moe", "small-moe"])
async def test_routes_match_router_topk_on_rerun(preset):
    engine = make_engine(build_model(preset, seed=5))
    cfg = engine.model.config
    params = SamplingParams(n=2, max_new_tokens=9, temperature=1.0, seed=4)
    groups = await engine.generate(prompt_ids(), params)
    ties = 0
    for prompt, group in zip(prompt_ids(), groups, strict=True):
        for c in group:
            run = np.concatenate([prompt, c.token_ids[:-1]])  # the last sampled token is never run
            assert c.routes.dtype == np.uint8
            assert c.routes.shape == (run.size, cfg.num_hidden_layers, cfg.num_experts_per_tok)
            expected, probs = router_topk(engine.model, run, cfg.num_experts_per_tok)
            ties += assert_routes_match(c.routes, expected, probs)
    assert ties <= 2


async def generate_with_midswap(engine, prompts, params, tensors, version, at_forward):
    """Generate while ``tensors`` get staged from this event loop once the model ran ``at_forward + 1`` forwards.

    The model's forward hook pauses the decode thread at that forward until the new version is
    loaded in the standby, so the swap lands at a known step boundary.
    """
    reached, go = threading.Event(), threading.Event()
    count = [0]

    def hook(module, args, output):
        if count[0] == at_forward:
            reached.set()
            assert go.wait(30), "test timed out staging weights"
        count[0] += 1

    handle = engine.model.register_forward_hook(hook)
    try:
        task = asyncio.create_task(engine.generate(prompts, params), name="generate")
        assert await asyncio.to_thread(reached.wait, 30)
        engine.stage_weights(tensors, version)  # from the event loop's thread, while decoding
        assert await asyncio.to_thread(engine.wait_staged, version, 30)
        assert engine.version < version, "the swap must wait for the decode step boundary"
        go.set()
        return await task
    finally:
        go.set()
        handle.remove()


async def test_versions_and_outputs_across_a_midsequence_swap():
    old_model, new_model = peaked_model(seed=0), peaked_model(seed=1)
    new_sd = {k: v.clone() for k, v in new_model.state_dict().items()}
    engine = make_engine(peaked_model(seed=0), stop_on_eos=False)
    engine.stage_weights({k: v.clone() for k, v in old_model.state_dict().items()}, 0)
    assert await engine.wait_applied(0, timeout_s=30)
    assert engine.version == 0

    max_new, at = 10, 2
    params = SamplingParams(n=2, max_new_tokens=max_new, temperature=0.0)
    prompts = prompt_ids()
    before = engine.model
    groups = await generate_with_midswap(engine, prompts, params, new_sd, 1, at)
    assert engine.version == 1 and await engine.wait_applied(1, timeout_s=0)
    assert engine.model is not before  # the standby swapped in by reference: the pause copies nothing
    # Forwards 0..at ran on version 0 and sampled tokens 0..at; every later token came from version 1.
    expected_versions = np.array([0] * (at + 1) + [1] * (max_new - at - 1), dtype=np.int32)
    cfg = new_model.config
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            assert c.finish_reason == "length" and np.array_equal(c.versions, expected_versions)
            # Reference: the old weights fill the KV cache up to token `at - 1`, the new weights continue it.
            cache = DynamicCache(config=cfg)
            prefix = torch.from_numpy(np.concatenate([prompt, c.token_ids[:at]]).astype(np.int64))[None]
            with torch.inference_mode():
                kw = cache_kwarg(old_model)  # ``cache`` in this transformers (``past_key_values`` is deprecated)
                old_model(prefix, use_cache=True, **{kw: cache})
                for j in range(at, max_new - 1):
                    out = new_model(
                        torch.tensor([[int(c.token_ids[j])]]), use_cache=True, output_router_logits=True, **{kw: cache},
                    )  # fmt: skip
                    masked = torch.tensor(masked_token_ids("tiny-moe"))
                    lp = torch.log_softmax(mask_logits(out.logits[0, -1].float(), masked), -1)
                    assert int(lp.argmax()) == int(c.token_ids[j + 1]), f"token {j + 1} after the swap"
                    assert abs(float(lp.max()) - float(c.logprobs[j + 1])) < LOGPROB_ATOL
                    probs = torch.stack([torch.softmax(r.float(), -1) for r in out.router_logits], dim=1)
                    top = probs.topk(cfg.num_experts_per_tok, -1).indices.sort(-1).values.numpy()
                    assert_routes_match(c.routes[prompt.size + j][None], top, probs.numpy())

    # A request started after the swap is exactly what a fresh engine on the new weights generates.
    after = await engine.generate(prompts, params)
    fresh = await make_engine(new_model, stop_on_eos=False).generate(prompts, params)
    for ga, gf in zip(after, fresh, strict=True):
        for ca, cf in zip(ga, gf, strict=True):
            assert np.array_equal(ca.token_ids, cf.token_ids)
            np.testing.assert_allclose(ca.logprobs, cf.logprobs, atol=LOGPROB_ATOL)
            assert (ca.versions == 1).all() and np.array_equal(ca.routes, cf.routes)


async def test_swap_pause_does_not_grow_with_model_size():
    pauses = {}
    for name, config in {
        "tiny": tiny_moe_config(),
        "larger": tiny_moe_config(hidden_size=256, moe_intermediate_size=512, num_experts=8, num_hidden_layers=4),
    }.items():
        engine = make_engine(build_model(config, seed=0))
        new = {k: v.clone() for k, v in build_model(config, seed=1).state_dict().items()}
        params = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=0)
        groups = await generate_with_midswap(engine, prompt_ids(), params, new, 3, at_forward=1)
        assert engine.version == 3
        assert all(c.versions.tolist() == [-1, -1, 3, 3, 3, 3][: c.versions.size] for g in groups for c in g)
        pauses[name] = engine.last_swap_pause_s
        ((load_s, wait_s),) = engine.take_swap_timings()  # the heartbeat's standby_load_s and swap_wait_s
        assert load_s == engine.last_load_s > 0 and wait_s >= 0
        assert engine.take_swap_timings() == []
        num_params = sum(p.numel() for p in engine.model.parameters())
        assert name == "tiny" or num_params > 20 * 224_000
        await engine.close()
    assert max(pauses.values()) < 0.01, pauses


async def test_stage_weights_checks_and_checkpoint_names(tmp_path):
    engine = make_engine(peaked_model(seed=0))
    good = {k: v.clone() for k, v in peaked_model(seed=2).state_dict().items()}
    with pytest.raises(ValueError, match="unknown weight name"):
        engine.stage_weights({**good, "model.extra.weight": torch.zeros(1)}, 1)
    bad_shape = dict(good, **{"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(3, 3\)"):
        engine.stage_weights(bad_shape, 1)
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="incomplete .*model.norm.weight"):
        engine.stage_weights(missing, 1)
    assert engine.version == -1

    # The per-expert names save_pretrained writes (and vLLM loads) are accepted too.
    src = peaked_model(seed=2)
    path = save_pretrained_dir(tmp_path / "m", src)
    checkpoint = load_file(str(path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in checkpoint
    engine.stage_weights(checkpoint, 4)
    assert await engine.wait_applied(4, timeout_s=30)
    sd = engine.model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in src.state_dict().items())
    with pytest.raises(ValueError, match="not newer"):
        engine.stage_weights(good, 4)
    assert not await engine.wait_applied(5, timeout_s=0.05)
    await engine.close()


async def _stage_error(engine: TorchEngine, says: str, timeout_s: float = 10.0) -> bool:
    """True once the loader reported a staged version refused for a reason containing ``says``."""
    for _ in range(int(timeout_s / 0.02)):
        if says in (engine.last_stage_error or ""):
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_version_staged_in_parts_swaps_in_only_once_complete():
    engine = make_engine(peaked_model(seed=0), load_threads=2)
    versions = {v: {k: t.clone() for k, t in peaked_model(seed=v).state_dict().items()} for v in (1, 2, 3)}
    layout = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in versions[1].items()}
    names = sorted(layout)
    half = len(names) // 2

    def part(v: int, which: list[str]) -> dict[str, torch.Tensor]:
        return {k: versions[v][k] for k in which}

    stream = engine.open_stage(1, layout)
    stream.put(part(1, names[:half]))
    assert not await engine.wait_applied(1, timeout_s=0.3)  # half a version is never used
    stream.put(part(1, names[half:]))
    stream.finish()
    assert await engine.wait_applied(1, timeout_s=30)
    assert all(torch.equal(engine.model.state_dict()[k], t) for k, t in versions[1].items())

    # Abandoned half-way (a bucket failed its checksum): the weights in use stay, nothing is reported as an error.
    stream = engine.open_stage(2, layout)
    stream.put(part(2, names[:half]))
    stream.abort()
    assert not await engine.wait_applied(2, timeout_s=0.3)
    assert engine.version == 1 and engine.last_stage_error is None
    # Ended short, or with a name twice: refused with what was wrong; then a complete one still loads.
    stream = engine.open_stage(2, layout)
    stream.put(part(2, names[:half]))
    stream.finish()
    assert await _stage_error(engine, "ended without")
    stream = engine.open_stage(2, layout)
    stream.put(part(2, names[:half]))
    stream.put(part(2, names[:1]))
    stream.finish()
    assert await _stage_error(engine, "sent twice") and engine.version == 1
    with pytest.raises(ValueError, match="unknown weight name"):
        engine.open_stage(3, {**layout, "model.extra.weight": torch.empty(1, device="meta")})
    stream = engine.open_stage(3, layout)
    stream.put(part(3, names))
    stream.finish()
    assert await engine.wait_applied(3, timeout_s=30)
    assert all(torch.equal(engine.model.state_dict()[k], t) for k, t in versions[3].items())

    # Closing while the loader waits for the rest of a version returns at once.
    stream = engine.open_stage(4, layout)
    stream.put(part(1, names[:half]))
    await asyncio.wait_for(engine.close(), timeout=10)
    assert engine.version == 3


async def test_bad_prompts_and_config_are_named():
    engine = make_engine(build_model("tiny-moe"))
    with pytest.raises(ValueError, match=r"prompts\[1\] has token ids outside"):
        await engine.generate([np.array([1, 5]), np.array([1, 999])], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a non-empty 1-D integer array"):
        await engine.generate([np.array([], dtype=np.int32)], SamplingParams())
    with pytest.raises(ValueError, match="engine.device"):
        TorchEngineConfig(device="tpu")
    with pytest.raises(ValueError, match="engine.max_batch_sequences"):
        TorchEngineConfig(max_batch_sequences=0)


def test_sample_tokens_truncation():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 2000)
    gen = torch.Generator().manual_seed(0)
    tokens, lps = sample_tokens(logits, SamplingParams(temperature=1.0, top_k=2), gen)
    assert set(tokens.tolist()) == {0, 1}
    p0 = 1 / (1 + np.exp(-1.0))
    np.testing.assert_allclose(lps[tokens == 0].numpy(), np.log(p0), atol=1e-6)
    tokens, lps = sample_tokens(logits, SamplingParams(temperature=0.5, top_p=0.5), gen)
    assert set(tokens.tolist()) == {0} and float(lps.abs().max()) < 1e-6  # one token holds > 0.5 of the mass
    tokens, lps = sample_tokens(logits[:1], SamplingParams(temperature=0.0), gen)
    assert int(tokens[0]) == 0 and float(lps[0]) == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))


def test_sample_tokens_never_samples_masked_ids():
    # The masked ids hold almost all the mass, as a pad token can in a young policy.
    logits = torch.tensor([[9.0, 0.0, 9.0, 1.0, 9.0]] * 4000)
    masked = torch.tensor([0, 2, 4])
    gen = torch.Generator().manual_seed(0)
    tokens, lps = sample_tokens(logits, SamplingParams(temperature=1.0), gen, masked)
    assert set(tokens.tolist()) == {1, 3}
    want = torch.log_softmax(torch.tensor([0.0, 1.0]), -1)
    np.testing.assert_allclose(lps[tokens == 3].numpy(), float(want[1]), atol=1e-6)
    tokens, _ = sample_tokens(logits, SamplingParams(temperature=0.0), gen, masked)
    assert set(tokens.tolist()) == {3}
    tokens, _ = sample_tokens(logits, SamplingParams(temperature=1.0), gen, None)
    assert {0, 2, 4} <= set(tokens.tolist())


async def test_engine_masks_special_tokens_unless_asked_not_to():
    model = build_model("tiny-moe", seed=0)
    with torch.no_grad():  # the pad and bos rows of the output layer dominate every position
        model.lm_head.weight[tt.PAD_ID].fill_(0.0)
        model.lm_head.weight[tt.BOS_ID].fill_(0.0)
        model.lm_head.bias = None
        model.lm_head.weight.mul_(0.01)
        model.lm_head.weight[tt.PAD_ID, :] = 5.0
        model.lm_head.weight[tt.BOS_ID, :] = 5.0
    engine = make_engine(model)
    prompts = prompt_ids()
    masked = set(masked_token_ids("tiny-moe"))
    assert masked == {tt.PAD_ID, tt.BOS_ID, tt.UNK_ID}
    params = SamplingParams(n=4, max_new_tokens=8, seed=0)
    for prompt, group in zip(prompts, await engine.generate(prompts, params), strict=True):
        for c in group:
            assert not masked & set(c.token_ids.tolist())
            ref = reference_logprobs(engine.model, prompt, c.token_ids, params)
            assert float(np.abs(ref - c.logprobs).max()) < LOGPROB_ATOL
    off = SamplingParams(n=4, max_new_tokens=8, seed=0, mask_special_tokens=False)
    sampled = {t for g in await engine.generate(prompts, off) for c in g for t in c.token_ids.tolist()}
    assert {tt.PAD_ID, tt.BOS_ID} & sampled


def test_masked_token_ids_of_a_model_directory(tmp_path):
    # A directory whose embedding has rows past the tokenizer's vocabulary, as Qwen's do: they are masked too,
    # and every eos id (config and generation config) stays sampleable.
    cfg = tiny_moe_config(vocab_size=tt.VOCAB_SIZE + 6)
    path = save_pretrained_dir(tmp_path / "m", build_model(cfg, seed=0))
    ids = masked_token_ids(path)
    assert ids == (tt.PAD_ID, tt.BOS_ID, tt.UNK_ID, *range(tt.VOCAB_SIZE, tt.VOCAB_SIZE + 6))
    assert tt.EOS_ID not in ids


@pytest.mark.gpu
async def test_cuda_engine_logprobs_routes_and_midswap():
    engine = make_engine(build_model("small-moe", seed=5), device="cuda")
    assert engine.model.device.type == "cuda"
    params = SamplingParams(n=4, max_new_tokens=12, temperature=0.8, top_k=8, seed=1)
    groups = await engine.generate(prompt_ids(), params)
    cfg = engine.model.config
    worst = 0.0
    for prompt, group in zip(prompt_ids(), groups, strict=True):
        for c in group:
            worst = max(
                worst, float(np.abs(reference_logprobs(engine.model, prompt, c.token_ids, params) - c.logprobs).max())
            )
            run = np.concatenate([prompt, c.token_ids[:-1]])
            expected, probs = router_topk(engine.model, run, cfg.num_experts_per_tok)
            assert_routes_match(c.routes, expected, probs)
    assert worst < LOGPROB_ATOL, worst
    new = {k: v.clone() for k, v in build_model("small-moe", seed=6).state_dict().items()}  # CPU tensors
    sampling = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=0)
    before = engine.model
    groups = await generate_with_midswap(engine, prompt_ids(), sampling, new, 1, at_forward=2)
    assert all(c.versions.tolist() == [-1, -1, -1, 1, 1, 1, 1, 1][: c.versions.size] for g in groups for c in g)
    assert engine.version == 1 and engine.model is not before  # swapped by reference, not copied in the pause
    sd = engine.model.state_dict()
    assert all(torch.equal(sd[k].cpu(), v) for k, v in new.items())
    await engine.close()


async def test_concurrent_calls_share_batches():
    engine = make_engine(peaked_model())
    prefill_rows: list[int] = []
    reached, go = threading.Event(), threading.Event()

    def pre_hook(module, args, kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1:  # a prefill
            prefill_rows.append(int(ids.shape[0]))
            if len(prefill_rows) == 1:
                reached.set()
                assert go.wait(30)

    handle = engine.model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    prompts = prompt_ids()
    try:
        first = asyncio.create_task(engine.generate(prompts[:1], SamplingParams(n=2, temperature=1.0)))
        assert await asyncio.to_thread(reached.wait, 30)
        # Queued while the decode thread is busy: the two alike calls merge, the greedy one runs on its own.
        a = asyncio.create_task(engine.generate(prompts[1:3], SamplingParams(n=3, max_new_tokens=4)))
        b = asyncio.create_task(engine.generate(prompts[3:], SamplingParams(n=2, max_new_tokens=9)))
        greedy = asyncio.create_task(engine.generate(prompts[:2], SamplingParams(n=1, temperature=0.0)))
        cancelled = asyncio.create_task(engine.generate(prompts[:1], SamplingParams(n=1)))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        go.set()
        results = await asyncio.gather(first, a, b, greedy)
    finally:
        go.set()
        handle.remove()
    assert prefill_rows == [2, 2 * 3 + 2, 2], prefill_rows  # a and b merged; the cancelled call never ran
    (r_first,), r_a, r_b, r_greedy = results[0], results[1], results[2], results[3]
    assert len(r_first) == 2 and [len(g) for g in r_a] == [3, 3] and [len(g) for g in r_b] == [2]
    assert all(c.token_ids.size <= 4 for g in r_a for c in g) and any(c.token_ids.size > 4 for g in r_b for c in g)
    cases = [(prompts[1:3], r_a, SamplingParams(max_new_tokens=4)), (prompts[3:], r_b, SamplingParams()),
             (prompts[:2], r_greedy, SamplingParams(temperature=0.0))]  # fmt: skip
    for ps, groups, params in cases:
        for prompt, group in zip(ps, groups, strict=True):
            for c in group:
                ref = reference_logprobs(engine.model, prompt, c.token_ids, params)
                assert np.abs(ref - c.logprobs).max() < LOGPROB_ATOL
    await engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        await engine.generate(prompts[:1], SamplingParams())


async def test_tied_embeddings_load_under_either_name():
    from async_rl.model.presets import tiny_dense_config

    config = tiny_dense_config(tie_word_embeddings=True)
    engine = make_engine(build_model(config, seed=0))
    src = build_model(config, seed=3).state_dict()
    engine.stage_weights({k: v for k, v in src.items() if k != "lm_head.weight"}, 1)  # as save_pretrained writes it
    assert await engine.wait_applied(1, timeout_s=30)
    assert torch.equal(engine.model.lm_head.weight, src["model.embed_tokens.weight"])
    engine.stage_weights(src, 2)  # both names (a state_dict export)
    assert await engine.wait_applied(2, timeout_s=30)
    with pytest.raises(ValueError, match="incomplete"):
        engine.stage_weights({k: v for k, v in src.items() if "embed_tokens" not in k and k != "lm_head.weight"}, 3)
    await engine.close()


def test_generation_logs_no_deprecation_warning() -> None:
    """The KV cache goes by the keyword this transformers names it (``cache``): the ``past_key_values ... deprecated``
    line no longer lands in every generator's log (a fresh process: transformers warns once per process)."""
    import subprocess
    import sys

    code = ("import asyncio, numpy as np\n"
            "from actors.generator.config import TorchEngineConfig\n"
            "from actors.generator.engine import SamplingParams\n"
            "from actors.generator.torch_engine import TorchEngine\n"
            "e = TorchEngine(TorchEngineConfig())\n"
            "out = asyncio.run(e.generate([np.array([1, 5, 6], dtype=np.int32)], SamplingParams(n=2, max_new_tokens=4)))\n"
            "assert len(out[0]) == 2\n"
            "e.close() if not asyncio.iscoroutinefunction(e.close) else asyncio.run(e.close())\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "deprecated" not in out.stderr.lower(), out.stderr
