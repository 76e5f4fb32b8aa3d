"""The project's vLLM engine on a GPU (vLLM 0.25.1 on the GPU machines): logprobs and native routes against a full
forward, a swap against a freshly started engine, versions across a swap, weights over CUDA IPC bit for bit (also
versions copied while a swap runs, versions the engine core follows by itself), TP=2.

Model: the ``moe-107m`` preset in bf16 (8 layers, 32 experts top-4). References run the same checkpoint in
transformers, in fp32 (from the bf16 weights), so the gaps below are vLLM's bf16 compute and kernels. Figures the
tests measure are written to ``$ARL_GPU_REPORT`` (a JSON file) when it is set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
vllm = pytest.importorskip("vllm")
shared_loop = pytest.mark.asyncio(loop_scope="module")

from actors.generator.config import VLLMEngineConfig  # noqa: E402
from actors.generator.engine import SamplingParams  # noqa: E402
from actors.generator.vllm_engine import VLLMEngine  # noqa: E402
from async_rl.model.config import ModelConfig  # noqa: E402
from async_rl.model.hf_routes import find_moe_layers, record_routes  # noqa: E402
from async_rl.model.presets import load_model, save_pretrained_dir  # noqa: E402

PRESET = "moe-107m"
SWAP_TIMEOUT_S = 120.0
LOGPROB_MEAN_TOL = 0.05
"""Mean |Δ logprob| of vLLM (bf16) against an fp32 forward of the same bf16 weights."""
ROUTE_AGREEMENT_MIN = 0.9
"""Share of (token, layer, slot) route entries vLLM and the fp32 forward agree on (bf16 flips near-ties)."""


def _report(key: str, value: object) -> None:
    path = os.environ.get("ARL_GPU_REPORT")
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.is_file() else {}
    data[key] = value
    p.write_text(json.dumps(data, indent=1))


def _config(model_dir: Path, **kw: object) -> VLLMEngineConfig:
    args: dict = dict(model=ModelConfig(name=str(model_dir), dtype="bfloat16"), stop_on_eos=False, max_model_len=256,
                      max_num_seqs=64, gpu_memory_utilization=0.15, kv_cache_mib=2048,
                      enforce_eager=True)  # fmt: skip  # eager: four engine starts without graph captures
    return VLLMEngineConfig(**{**args, **kw})


def _prompts(n: int, seed: int = 0, length: int = 12) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)  # the presets' character vocabulary: 22 ids, the first 4 special
    return [rng.integers(4, 22, length).astype(np.int32) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vllm-gpu")
    return (save_pretrained_dir(root / "a", preset=PRESET, seed=0, dtype="bfloat16"),
            save_pretrained_dir(root / "b", preset=PRESET, seed=1, dtype="bfloat16"))  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dirs: tuple[Path, Path]):  # type: ignore[no-untyped-def]
    eng = await asyncio.to_thread(VLLMEngine, _config(model_dirs[0]))
    yield eng
    await eng.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine_b(model_dirs: tuple[Path, Path]):  # type: ignore[no-untyped-def]
    """An engine started on weights B: what a swap to B must equal."""
    eng = await asyncio.to_thread(VLLMEngine, _config(model_dirs[1]))
    yield eng
    await eng.close()


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _source(model_dir: Path, mode: str) -> list:
    """What a learner offers its GPU slots, on cuda:0: the checkpoint's tensors (``checkpoint``), transformers'
    in-memory names (``fused``: fused experts), or those as pieces each covering its tensor (``pieces``)."""
    from async_rl.weights.snapshot import Piece

    if mode == "checkpoint":
        return [(k, v.cuda()) for k, v in _weights(model_dir).items()]
    state = {k: v.detach() for k, v in load_model(model_dir, dtype="bfloat16", device="cuda:0").state_dict().items()}
    if mode == "fused":
        return list(state.items())
    return [Piece(k, v, full_shape=tuple(v.shape)) if v.dim() else Piece(k, v) for k, v in state.items()]


async def _digest(engine: VLLMEngine) -> list[dict[str, str]]:
    return await engine._llm.collective_rpc("arl_param_digest")


async def _drop(redis, *runs) -> None:  # type: ignore[no-untyped-def]
    """The tests' own keys deleted (each run's prefix), the client closed."""
    for n in runs:
        keys = [k async for k in redis.scan_iter(match=n.all_key_pattern())]
        if keys:
            await redis.delete(*keys)
    await redis.aclose()


@shared_loop
async def test_logprobs_and_routes_match_a_full_forward(engine: VLLMEngine, model_dirs: tuple[Path, Path]) -> None:
    assert engine.route_mode == "native"
    prompts = _prompts(16)
    params = SamplingParams(n=2, max_new_tokens=48, temperature=1.0, seed=3, mask_special_tokens=False)
    out = await engine.generate(prompts, params)
    ref = load_model(model_dirs[0], dtype="float32").to("cuda").eval()
    layers = find_moe_layers(ref)
    diffs, agree, entries = [], 0, 0
    for prompt, comps in zip(prompts, out, strict=True):
        for c in comps:
            full = torch.from_numpy(np.concatenate([prompt, c.token_ids]).astype(np.int64))[None].cuda()
            with torch.no_grad(), record_routes(ref) as rec:
                logits = ref(input_ids=full).logits[0, prompt.size - 1 : -1].float()
                own = rec.take()[0][0].cpu().numpy()  # [S, L, K]
            lp = torch.log_softmax(logits, -1).gather(-1, full[0, prompt.size:, None]).squeeze(-1).cpu().numpy()
            diffs.append(np.abs(lp - c.logprobs))
            assert c.routes is not None and c.routes.shape == (full.shape[1] - 1, len(layers), layers[0].top_k)
            for t in range(c.routes.shape[0]):
                for layer in range(len(layers)):
                    got, want = set(c.routes[t, layer].tolist()), set(own[t, layer].tolist())
                    agree += len(got & want)
                    entries += len(want)
    d = np.concatenate(diffs)
    agreement = agree / entries
    _report("logprobs_vs_fp32_forward", {"mean_abs": float(d.mean()), "p99_abs": float(np.quantile(d, 0.99)),
                                         "max_abs": float(d.max()), "tokens": int(d.size)})  # fmt: skip
    _report("route_agreement_vs_fp32_forward", {"fraction": agreement, "entries": entries})
    assert d.mean() < LOGPROB_MEAN_TOL, d.mean()
    assert agreement >= ROUTE_AGREEMENT_MIN, agreement


@shared_loop
async def test_a_swap_matches_a_freshly_started_engine(engine: VLLMEngine, engine_b: VLLMEngine,
                                                       model_dirs: tuple[Path, Path]) -> None:  # fmt: skip
    engine.stage_weights(_weights(model_dirs[1]), 1)
    assert await engine.wait_applied(1, SWAP_TIMEOUT_S), engine.last_stage_error
    assert engine.swap_load == "replay"  # proven at start: the swap is a replay of vLLM's loaders
    assert await _digest(engine) == await _digest(engine_b)  # the same bytes in every parameter
    prompts = _prompts(8, seed=1)
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0, mask_special_tokens=False)
    got, want = await engine.generate(prompts, greedy), await engine_b.generate(prompts, greedy)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g[0].token_ids, w[0].token_ids)
        assert (g[0].versions == 1).all()
    _report("swap_pause_s", engine.last_swap_pause_s)
    _report("swap_load_s", engine.last_load_s)


@shared_loop
@pytest.mark.parametrize("swap", ["pause", "core", "boundary"])
async def test_versions_across_a_swap_in_the_middle_of_a_sequence(engine: VLLMEngine, model_dirs: tuple[Path, Path],
                                                                  swap: str) -> None:  # fmt: skip
    """Each way a version goes into use (vllm.swap): with vLLM's asynchronous scheduling on the GPU, ``boundary``
    labels the steps launched before the swap with the old version though their outputs come after it."""
    kept = engine.config
    engine.config = dataclasses.replace(kept, swap=swap)
    try:
        await _check_versions_across_a_swap(engine, model_dirs)
    finally:
        engine.config = kept


async def _check_versions_across_a_swap(engine: VLLMEngine, model_dirs: tuple[Path, Path]) -> None:
    # A version in use by this mode first (the scheduler's labels follow swaps at the core, not a pause's).
    start = engine.version + 1
    engine.stage_weights(_weights(model_dirs[1]), start)
    assert await engine.wait_applied(start, SWAP_TIMEOUT_S), engine.last_stage_error
    params = SamplingParams(max_new_tokens=200, temperature=1.0, mask_special_tokens=False)
    task = asyncio.ensure_future(engine.generate(_prompts(8, seed=2, length=8), params))
    await asyncio.sleep(0.15)
    engine.stage_weights(_weights(model_dirs[0]), start + 1)
    out = await task
    assert await engine.wait_applied(start + 1, SWAP_TIMEOUT_S)
    spanning = 0
    for (c,) in out:
        v = c.versions
        assert set(np.unique(v)) <= {start, start + 1}
        assert (np.diff(v) >= 0).all()  # old weights first, then the new ones, never back
        spanning += int(v[0] == start and v[-1] == start + 1)
    assert spanning > 0, "no sequence spanned the swap: it came before or after every one"


@shared_loop
async def test_weights_over_cuda_ipc_arrive_bit_for_bit(engine: VLLMEngine, engine_b: VLLMEngine, servers,
                                                        model_dirs: tuple[Path, Path]) -> None:  # fmt: skip
    """The learner's side publishes B into GPU slots (this process, cuda:0); the engine's worker maps them."""
    import redis.asyncio as aioredis

    from async_rl.run.names import Names
    from async_rl.weights.config import PublisherConfig
    from async_rl.weights.gpu.publisher import GpuPublisher, local_slots
    from async_rl.weights.gpu.reader import GpuReader

    names = Names(prefix=f"t-vllm-{uuid.uuid4().hex[:8]}")
    prefixes = [names]
    redis = aioredis.Redis.from_url(servers.redis_url)
    cfg = PublisherConfig(gpu_dtype="bfloat16", gpu_bucket_bytes=64 << 20)
    pub = GpuPublisher(redis, names, cfg, local_slots("cuda:0", cfg))
    try:
        await pub.clean()
        digest_a = await _digest(engine)  # the versions test left weights A in use
        version = max(engine.version, 10) + 1  # past any version an earlier test staged
        copier = engine.gpu_copier()
        assert copier is not None
        reader = GpuReader(redis, names, None)
        digest_b = await _digest(engine_b)
        # B, A, then B again: the third lands in the first's staging slot and reuses its buffers and views. Then
        # the same under transformers' in-memory names (fused experts, what the learners publish): the worker
        # converts them into views of its slot, so the third of them reuses the first's slot and must not keep its
        # values. Then fused names published as pieces (each a piece covering its tensor, as a rank of a learner
        # in several ranks publishes its slice): received into shared buckets and assembled into the slots.
        plan = [(w, want, mode) for mode in ("checkpoint", "fused", "pieces")
                for w, want in ((1, digest_b), (0, digest_a), (1, digest_b))]  # fmt: skip
        for i, (weights, want, mode) in enumerate(plan):
            source = _source(model_dirs[weights], mode)
            if i and mode != plan[i - 1][2]:  # a publisher's GPU slots keep the first version's layout: a new run
                names = Names(prefix=f"t-vllm-{uuid.uuid4().hex[:8]}")
                prefixes.append(names)
                pub = GpuPublisher(redis, names, cfg, local_slots("cuda:0", cfg))
                await pub.clean()
                reader = GpuReader(redis, names, None)
            assert await pub.offer(version + i, lambda s=source: s)
            await pub.wait_idle()
            fetched = await reader.fetch(version + i, copy=copier)
            assert fetched.tensors == {}
            engine.stage_copied(version + i)
            assert await engine.wait_applied(version + i, SWAP_TIMEOUT_S), engine.last_stage_error
            assert await _digest(engine) == want, f"IPC version {i} ({mode})"
        _report("ipc_copy_s", engine.last_stage_s)
        _report("ipc_swap_pause_s", engine.last_swap_pause_s)
        _report("ipc_swap_load_s", engine.last_load_s)
    finally:
        await _drop(redis, *prefixes)


@shared_loop
@pytest.mark.parametrize("swap", ["pause", "boundary"])
async def test_versions_copied_while_a_swap_runs_are_all_loaded(engine: VLLMEngine, engine_b: VLLMEngine, servers,
                                                                model_dirs: tuple[Path, Path], swap: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """The node's asynchronous run (issue 39, four H200s) logged "could not apply weight version": the swap task had
    taken a version and waited for a step boundary while two newer ones were copied, the second into the taken one's
    staging slot (a worker keeps two). Versions published and copied back to back while sequences generate, each
    handed over at once: no swap fails, and the last version (B) is in use. With ``boundary`` each load is only
    queued on the GPU: a copy into its slot must wait for it there."""
    kept = engine.config
    engine.config = dataclasses.replace(kept, swap=swap)
    try:
        await _check_copies_during_swaps(engine, engine_b, servers, model_dirs, caplog)
    finally:
        engine.config = kept


async def _check_copies_during_swaps(engine: VLLMEngine, engine_b: VLLMEngine, servers, model_dirs: tuple[Path, Path],
                                     caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    import logging

    import redis.asyncio as aioredis

    from async_rl.run.names import Names
    from async_rl.weights.config import PublisherConfig
    from async_rl.weights.gpu.publisher import GpuPublisher, local_slots
    from async_rl.weights.gpu.reader import GpuReader

    names = Names(prefix=f"t-vllm-{uuid.uuid4().hex[:8]}")
    redis = aioredis.Redis.from_url(servers.redis_url)
    cfg = PublisherConfig(gpu_dtype="bfloat16", gpu_bucket_bytes=64 << 20)
    pub = GpuPublisher(redis, names, cfg, local_slots("cuda:0", cfg))
    sources = [_source(d, "fused") for d in model_dirs]
    params = SamplingParams(max_new_tokens=200, temperature=1.0, mask_special_tokens=False)
    caplog.set_level(logging.INFO, logger="actors.generator.vllm_engine")  # a failure shows each copy's breakdown
    try:
        await pub.clean()
        reader, copier = GpuReader(redis, names, None), engine.gpu_copier()
        assert copier is not None
        await engine.ready()  # as a generator does before its first copy: the set-up must not run inside a lease
        first = max(engine.version, 30) + 1
        busy = asyncio.ensure_future(engine.generate(_prompts(32, seed=3, length=8), params))
        for i in range(12):  # A, B, A, ..., B
            assert await pub.offer(first + i, lambda s=sources[i % 2]: s)
            await pub.wait_idle()
            await reader.fetch(first + i, copy=copier)
            engine.stage_copied(first + i)  # no wait: the next copy may come while this one is being swapped in
        await busy
        assert await engine.wait_applied(first + 11, SWAP_TIMEOUT_S), engine.last_stage_error
        failed = [r.getMessage() for r in caplog.records if "could not apply" in r.getMessage()]
        assert not failed, failed
        assert await _digest(engine) == await _digest(engine_b)
    finally:
        await _drop(redis, names)


@shared_loop
async def test_the_engine_core_follows_versions_bit_for_bit(engine: VLLMEngine, engine_b: VLLMEngine, servers,
                                                          model_dirs: tuple[Path, Path]) -> None:  # fmt: skip
    """``vllm.follow="core"``: versions announced on NATS are fetched over CUDA IPC, checked and loaded by the
    engine core's own thread while sequences generate; this process only reads its report. B, A, B: each in use bit
    for bit, every output's versions among those published and never going back. Last on ``engine``: the follower
    stays its own once started."""
    import redis.asyncio as aioredis

    from actors.generator.config import GeneratorConfig, WeightSyncConfig
    from actors.generator.core_follow import CoreFollow
    from async_rl.run.config import RunConfig
    from async_rl.run.names import Names
    from async_rl.servers.control import ControlPlane
    from async_rl.weights.config import PublisherConfig
    from async_rl.weights.gpu.publisher import GpuPublisher, local_slots

    names = Names(prefix=f"t-vllm-{uuid.uuid4().hex[:8]}")
    redis = aioredis.Redis.from_url(servers.redis_url)
    control = await ControlPlane(servers.nats_url, name="test-vllm-follow").connect()
    cfg = PublisherConfig(gpu_dtype="bfloat16", gpu_bucket_bytes=64 << 20)
    pub = GpuPublisher(redis, names, cfg, local_slots("cuda:0", cfg), control=control)
    engine.config = dataclasses.replace(engine.config, swap="boundary", follow="core")
    follow = CoreFollow(engine, GeneratorConfig(
        engine="vllm", generator_id="test-vllm-follow", vllm=engine.config,
        run=RunConfig(prefix=names.prefix, redis_url=servers.redis_url, nats_url=servers.nats_url),
        weight_sync=WeightSyncConfig(first_version_timeout_s=0)))  # fmt: skip
    params = SamplingParams(max_new_tokens=200, temperature=1.0, mask_special_tokens=False)
    try:
        await pub.clean()
        assert await follow.start()
        want_b = await _digest(engine_b)
        before = engine.version
        first = max(before, 60) + 1
        busy = asyncio.ensure_future(engine.generate(_prompts(16, seed=4, length=8), params))
        for i, weights in enumerate((1, 0, 1)):
            assert await pub.offer(first + i, lambda s=_source(model_dirs[weights], "fused"): s)
            await pub.wait_idle()
            for _ in range(int(SWAP_TIMEOUT_S / 0.01)):
                await follow.poll()
                if engine.version >= first + i:
                    break
                await asyncio.sleep(0.01)
            assert engine.version == first + i, f"version {first + i} not in use: {engine.last_stage_error}"
            got = await _digest(engine)
            assert (got == want_b) == (weights == 1), f"version {first + i}: {'A' if weights == 0 else 'B'} wanted"
        assert follow.num_failures == 0 and not follow.refused
        for (c,) in await busy:
            assert set(np.unique(c.versions)) <= {before, first, first + 1, first + 2}
            assert (np.diff(c.versions) >= 0).all()
    finally:
        await follow.close()
        await control.close()
        await _drop(redis, names)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
async def test_tensor_parallel_2_takes_host_and_ipc_versions(model_dirs: tuple[Path, Path], servers) -> None:
    import redis.asyncio as aioredis

    from async_rl.run.names import Names
    from async_rl.weights.config import PublisherConfig
    from async_rl.weights.gpu.publisher import GpuPublisher, local_slots
    from async_rl.weights.gpu.reader import GpuReader

    tp = await asyncio.to_thread(VLLMEngine, _config(model_dirs[0], tensor_parallel_size=2))
    fresh_b = await asyncio.to_thread(VLLMEngine, _config(model_dirs[1], tensor_parallel_size=2))
    names = Names(prefix=f"t-vllm-tp-{uuid.uuid4().hex[:8]}")
    redis = aioredis.Redis.from_url(servers.redis_url)
    try:
        prompts = _prompts(4, seed=5)
        greedy = SamplingParams(max_new_tokens=24, temperature=0.0, mask_special_tokens=False)
        tp.stage_weights(_weights(model_dirs[1]), 1)  # host path: every rank maps the packed version
        assert await tp.wait_applied(1, SWAP_TIMEOUT_S), tp.last_stage_error
        want = await _digest(fresh_b)
        assert len(want) == 2 and await _digest(tp) == want
        assert tp.swap_load == "replay", tp.swap_load
        cfg = PublisherConfig(gpu_dtype="bfloat16", gpu_bucket_bytes=64 << 20)
        pub = GpuPublisher(redis, names, cfg, local_slots("cuda:0", cfg))
        await pub.clean()
        tensors = {k: v.cuda() for k, v in _weights(model_dirs[0]).items()}
        assert await pub.offer(2, lambda: tensors.items())
        await pub.wait_idle()
        copier = tp.gpu_copier()
        assert copier is not None
        await GpuReader(redis, names, None).fetch(2, copy=copier)  # both ranks copy; their checksums must agree
        tp.stage_copied(2)
        assert await tp.wait_applied(2, SWAP_TIMEOUT_S), tp.last_stage_error
        tensors = {k: v.cuda() for k, v in _weights(model_dirs[1]).items()}
        assert await pub.offer(3, lambda: tensors.items())
        await pub.wait_idle()
        await GpuReader(redis, names, None).fetch(3, copy=copier)
        tp.stage_copied(3)
        assert await tp.wait_applied(3, SWAP_TIMEOUT_S), tp.last_stage_error
        assert await _digest(tp) == want
        got, ref = await tp.generate(prompts, greedy), await fresh_b.generate(prompts, greedy)
        for g, w in zip(got, ref, strict=True):
            assert np.array_equal(g[0].token_ids, w[0].token_ids)
        _report("tp2_swap_pause_s", tp.last_swap_pause_s)
    finally:
        await tp.close()
        await fresh_b.close()
        await _drop(redis, names)
