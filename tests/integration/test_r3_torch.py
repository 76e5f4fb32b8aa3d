"""R3 on CPU (issue 6, "Done when"): a bf16 generator and an fp32 learner route some tokens differently;
replaying the generator's routes brings the learner's logprobs closer to the behaviour logprobs.

Real parts end to end: the torch engine samples with a KV cache in bf16 and records routes through its
hooks; the learner's TorchBackend (fp32, same weights) recomputes the response logprobs with and without
replay. Figures measured on the dev machine (2 CPU cores, small-moe preset, 32 samples x 24 tokens): about
1.7% of (token, layer) routes differ; mean |logπ - logμ| 0.0014 with replay vs 0.0024 without, mean
½(logπ - logμ)² 1.4e-6 vs 1.0e-5.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from actors.generator.config import TorchEngineConfig
from actors.generator.engine import SamplingParams
from actors.generator.torch_engine import TorchEngine
from actors.learner.batching import collate
from actors.learner.config import TorchBackendConfig
from actors.learner.torch_backend import TorchBackend
from async_rl.algorithms.batch import TrainSample
from async_rl.model.hf_routes import record_routes
from async_rl.model.presets import ModelConfig, build_model, small_moe_config
from async_rl.model.token_mask import masked_token_ids

NUM_PROMPTS = 8
SAMPLES_PER_PROMPT = 4
NEW_TOKENS = 24


async def test_replay_brings_learner_logprobs_closer_to_low_precision_behaviour() -> None:
    learner_model = build_model(small_moe_config(), seed=0)
    behaviour_model = copy.deepcopy(learner_model).to(torch.bfloat16)
    engine = TorchEngine(
        TorchEngineConfig(model=ModelConfig(name="small-moe", dtype="bfloat16"), stop_on_eos=False, seed=1),
        model=behaviour_model,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 20, 8).astype(np.int32) for _ in range(NUM_PROMPTS)]
    try:
        completions = await engine.generate(
            prompts, SamplingParams(n=SAMPLES_PER_PROMPT, max_new_tokens=NEW_TOKENS, temperature=1.0)
        )
    finally:
        await engine.close()
    samples = [
        TrainSample(
            input_ids=np.concatenate([p, c.token_ids]).astype(np.int32), prompt_len=p.size,
            behaviour_logprobs=c.logprobs, versions=c.versions, advantages=np.zeros(c.token_ids.size, np.float32),
            routes=c.routes, group_id=f"p{i}",
        )
        for i, (p, cs) in enumerate(zip(prompts, completions, strict=True))
        for c in cs
    ]  # fmt: skip
    assert all(s.routes is not None and s.routes.shape[0] == s.input_ids.size - 1 for s in samples)

    backend = TorchBackend(learner_model, TorchBackendConfig(device="cpu", dtype="float32",
                                                             masked_token_ids=masked_token_ids("small-moe")))  # fmt: skip
    mb = collate(samples, step_num_tokens=1, step_num_sequences=1)
    with_replay = backend.forward_logprobs(mb, replay_routes=True).logprobs
    without = backend.forward_logprobs(mb, replay_routes=False).logprobs

    # The learner's own fp32 routes differ from the generator's bf16 ones on some (token, layer) pairs.
    with torch.no_grad(), record_routes(backend.model) as rec:
        backend.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask.long())
    own = rec.take()[0].numpy()
    flipped_pairs, pairs = 0, 0
    for b, s in enumerate(samples):
        t = s.routes.shape[0]
        differs = (np.sort(s.routes.astype(np.int64), -1) != np.sort(own[b, :t], -1)).any(-1)  # [t, layers]
        flipped_pairs += int(differs.sum())
        pairs += differs.size
        # Alignment: before the first flipped position f both forwards route identically, and the logprob at
        # position j only depends on positions < j, so logprobs 1..f agree (a shifted replay would break this).
        flips = np.nonzero(differs.any(-1))[0]
        f = int(flips[0]) if flips.size else t
        torch.testing.assert_close(with_replay[b, 1 : f + 1], without[b, 1 : f + 1], rtol=0, atol=1e-5)
    flip_rate = flipped_pairs / pairs
    assert flip_rate > 0.002, f"routes barely differ ({flip_rate:.4f}); the test would not test replay"

    mask = mb.loss_mask
    mu = mb.behaviour_logprobs
    gap_replay = (with_replay - mu)[mask]
    gap_plain = (without - mu)[mask]
    abs_r, abs_p = float(gap_replay.abs().mean()), float(gap_plain.abs().mean())
    sq_r, sq_p = float((0.5 * gap_replay**2).mean()), float((0.5 * gap_plain**2).mean())
    print(
        f"\nR3: {flip_rate:.2%} of {pairs} (token, layer) routes differ bf16 vs fp32; over {int(mask.sum())} response "
        f"tokens mean|logpi-logmu| replay {abs_r:.5f} vs no replay {abs_p:.5f}; mean sq/2 {sq_r:.2e} vs {sq_p:.2e}; "
        f"max|.| {float(gap_replay.abs().max()):.4f} vs {float(gap_plain.abs().max()):.4f}"
    )
    assert abs_r < 0.8 * abs_p
    assert sq_r < 0.5 * sq_p


async def test_learner_masks_the_tokens_the_generator_masks() -> None:
    # On-policy in fp32, the learner's logprobs equal the behaviour ones only when it applies the generator's mask.
    model = build_model("tiny-moe", seed=3)
    engine = TorchEngine(TorchEngineConfig(stop_on_eos=False, seed=2), model=copy.deepcopy(model))
    prompts = [np.array([1, *range(4, 10)], np.int32) for _ in range(4)]
    try:
        completions = await engine.generate(prompts, SamplingParams(n=4, max_new_tokens=16, temperature=1.0))
    finally:
        await engine.close()
    samples = [
        TrainSample(input_ids=np.concatenate([p, c.token_ids]).astype(np.int32), prompt_len=p.size,
                    behaviour_logprobs=c.logprobs, versions=c.versions,
                    advantages=np.zeros(c.token_ids.size, np.float32), routes=c.routes, group_id=f"p{i}")
        for i, (p, cs) in enumerate(zip(prompts, completions, strict=True)) for c in cs
    ]  # fmt: skip
    mb = collate(samples, step_num_tokens=1, step_num_sequences=1)
    behaviour = torch.zeros_like(mb.loss_mask, dtype=torch.float32)
    for b, s in enumerate(samples):
        behaviour[b, s.prompt_len : s.input_ids.size] = torch.from_numpy(s.behaviour_logprobs)
    gaps = {}
    for name, ids in (("masked", masked_token_ids("tiny-moe")), ("unmasked", ())):
        backend = TorchBackend(copy.deepcopy(model), TorchBackendConfig(device="cpu", masked_token_ids=ids))
        lp = backend.forward_logprobs(mb, replay_routes=True).logprobs
        gaps[name] = float((lp - behaviour)[mb.loss_mask].abs().max())
    assert gaps["masked"] < 1e-4, gaps
    assert gaps["unmasked"] > 1e-3, gaps  # the masked mass (pad, bos, unk of a random policy) is not negligible
