"""KV reuse across the turns of an episode: with prefix caching on, a turn's request (the whole context so far) is
served the previous turns' KV from vLLM's prefix cache, and never KV of older weights (the cache salt holds the
version). Prefix caching needs routes other than ``hooks``: here ``routes="off"`` on the CPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from safetensors.torch import load_file

from actors.generator.config import VLLMEngineConfig
from actors.generator.engine import SamplingParams
from actors.generator.vllm_engine import VLLMEngine
from async_rl.model.presets import ModelConfig, build_model, save_pretrained_dir, small_moe_config

pytestmark = pytest.mark.vllm
shared_loop = pytest.mark.asyncio(loop_scope="module")

BLOCK = 32
"""KV block size the engine is started with (vLLM caches whole blocks; its CPU attention takes multiples of 32)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model_dir = save_pretrained_dir(tmp_path_factory.mktemp("prefix") / "m", build_model(small_moe_config(), seed=0))
    cfg = VLLMEngineConfig(model=ModelConfig(name=str(model_dir)), stop_on_eos=False, max_model_len=256,
                           kv_cache_mib=64, max_num_seqs=8, version_labels="front", routes="off",
                           enable_prefix_caching=True, engine_args={"block_size": BLOCK})  # fmt: skip
    eng = await asyncio.to_thread(VLLMEngine, cfg)
    yield eng, model_dir
    await eng.close()


@shared_loop
async def test_a_turn_reuses_the_kv_of_the_turns_before_it(engine) -> None:  # type: ignore[no-untyped-def]
    eng, model_dir = engine
    assert eng.prefix_caching
    rng = np.random.default_rng(0)
    vocab = eng.facts.vocab_size
    prompt = rng.integers(4, vocab, size=60).astype(np.int32)
    greedy = SamplingParams(n=1, max_new_tokens=12, temperature=0.0, mask_special_tokens=False)
    [[turn1]] = await eng.generate([prompt], greedy)
    env_reply = rng.integers(4, vocab, size=10).astype(np.int32)
    context = np.concatenate([prompt, turn1.token_ids, env_reply])  # what an episode sends for its second turn

    def served(before: tuple[int, int]) -> tuple[int, int]:
        return eng.prompt_tokens - before[0], eng.cached_prompt_tokens - before[1]

    before = (eng.prompt_tokens, eng.cached_prompt_tokens)
    [[turn2]] = await eng.generate([context], greedy)
    asked, cached = served(before)
    run_before = prompt.size + turn1.token_ids.size - 1  # the last sampled token was never run
    assert asked == context.size and cached == run_before // BLOCK * BLOCK > 0, (asked, cached)

    # A new weight version (the same weights, version 1): nothing computed under version 0 is reused.
    eng.stage_weights(load_file(str(Path(model_dir) / "model.safetensors")), 1)
    assert await eng.wait_applied(1, 60.0), eng.last_stage_error
    before = (eng.prompt_tokens, eng.cached_prompt_tokens)
    [[again]] = await eng.generate([context], greedy)
    assert served(before) == (context.size, 0)
    assert again.token_ids.tolist() == turn2.token_ids.tolist()  # same weights, KV recomputed: the same turn
    np.testing.assert_allclose(again.logprobs, turn2.logprobs, atol=1e-5)
