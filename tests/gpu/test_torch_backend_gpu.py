"""TorchBackend and route replay on one CUDA GPU (skipped without one)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from actors.generator.config import TorchEngineConfig
from actors.generator.engine import SamplingParams
from actors.generator.torch_engine import TorchEngine
from actors.learner.batching import collate, make_micro_batches
from actors.learner.config import BatchingConfig, TorchBackendConfig
from actors.learner.torch_backend import TorchBackend
from async_rl.algorithms.batch import ForwardOutput, MicroBatch, TrainSample
from async_rl.model.presets import ModelConfig, build_model, small_moe_config

pytestmark = pytest.mark.gpu


def _pg_loss(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mb.loss_mask.float()
    return -(out.logprobs * mb.advantages * mask).sum() / mb.step_num_tokens, {}


async def _behaviour_samples(model: torch.nn.Module, device: str) -> list[TrainSample]:
    engine = TorchEngine(
        TorchEngineConfig(model=ModelConfig(name="small-moe", dtype="bfloat16"), device=device, stop_on_eos=False),
        model=model,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 20, 8).astype(np.int32) for _ in range(16)]
    try:
        comps = await engine.generate(prompts, SamplingParams(n=4, max_new_tokens=32, temperature=1.0))
    finally:
        await engine.close()
    return [
        TrainSample(
            input_ids=np.concatenate([p, c.token_ids]).astype(np.int32), prompt_len=p.size,
            behaviour_logprobs=c.logprobs, versions=c.versions,
            advantages=rng.standard_normal(c.token_ids.size).astype(np.float32), routes=c.routes,
        )
        for p, cs in zip(prompts, comps, strict=True)
        for c in cs
    ]  # fmt: skip


async def test_r3_and_training_on_gpu() -> None:
    learner_model = build_model(small_moe_config(), seed=0)
    samples = await _behaviour_samples(copy.deepcopy(learner_model).to(torch.bfloat16), "cuda")
    backend = TorchBackend(learner_model, TorchBackendConfig(device="cuda", lr=1e-3))
    assert next(backend.model.parameters()).device.type == "cuda"
    mb = collate(samples, step_num_tokens=1, step_num_sequences=1)
    rep = backend.forward_logprobs(mb, with_entropy=True)
    plain = backend.forward_logprobs(mb, replay_routes=False)
    assert rep.logprobs.device.type == "cpu" and rep.entropy is not None
    m, mu = mb.loss_mask, mb.behaviour_logprobs
    gap_r, gap_p = float((rep.logprobs - mu)[m].abs().mean()), float((plain.logprobs - mu)[m].abs().mean())
    print(f"\nGPU R3: mean|logpi-logmu| replay {gap_r:.5f} vs no replay {gap_p:.5f}")
    assert gap_r <= gap_p

    mbs = make_micro_batches(samples, BatchingConfig(micro_batch_tokens=512))
    res = backend.train_step(mbs, _pg_loss, with_entropy=True)
    assert res.metrics["step_skipped"] == 0.0 and 0 < res.grad_norm < float("inf")
    exported = dict(backend.export_weights())
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in exported.values())

    bf16 = TorchBackend(build_model(small_moe_config(), seed=0), TorchBackendConfig(device="cuda", dtype="bfloat16"))
    res = bf16.train_step(mbs, _pg_loss, with_entropy=True)
    assert res.metrics["step_skipped"] == 0.0 and bf16.forward_logprobs(mb).logprobs.dtype == torch.float32
