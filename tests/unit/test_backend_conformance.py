"""The training-backend contract (``actors/learner/backend.py``), one suite for every backend.

Runs against the torch backend on the CPU everywhere, and against the torch backend on CUDA and the Megatron
backend where a GPU (and, for Megatron, megatron-core) is present: the device run is
``python -m pytest -q tests/unit/test_backend_conformance.py`` on the GPU machine. Each check is a property
of the contract, not of one implementation: shapes and zeros of forward outputs, the loss-scaling rule
(any split into micro-batches gives the same update), the skipped step on non-finite gradients, the
metrics every backend reports, weights exported in HF names, save/load, the rank roles.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from actors.learner.backend import REQUIRED_STEP_METRICS, TrainingBackend
from actors.learner.batching import make_micro_batches
from actors.learner.config import BatchingConfig
from async_rl.algorithms.batch import ForwardOutput, MicroBatch, TrainSample
from async_rl.model.moe import moe_facts

VOCAB = 64


def _hf_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, max_position_embeddings=128, norm_topk_prob=True,
                          router_aux_loss_coef=0.0, tie_word_embeddings=False, mlp_only_layers=[0])  # fmt: skip


def _hf_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_hf_config(), attn_implementation="eager")


def _torch(device: str) -> Callable[[torch.nn.Module], TrainingBackend]:
    def build(model: torch.nn.Module) -> TrainingBackend:
        from actors.learner.config import TorchBackendConfig
        from actors.learner.torch_backend import TorchBackend

        return TorchBackend(copy.deepcopy(model), TorchBackendConfig(lr=1e-2, device=device, grad_clip=0.0))

    return build


def _megatron(model: torch.nn.Module) -> TrainingBackend:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.config import MegatronConfig

    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    return MegatronBackend(MegatronConfig(dtype="float32", recompute=False, lr=1e-2, clip_grad=0.0), model.config, sd)


BACKENDS = [
    pytest.param(_torch("cpu"), id="torch-cpu"),
    pytest.param(_torch("cuda"), id="torch-cuda", marks=pytest.mark.gpu),
    pytest.param(_megatron, id="megatron", marks=pytest.mark.gpu),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[TrainingBackend]:
    b = request.param(_hf_model())
    yield b
    b.close()


def _samples(n: int = 6, seed: int = 0) -> list[TrainSample]:
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


def _batches(micro_batch_tokens: int) -> list[MicroBatch]:
    return make_micro_batches(_samples(), BatchingConfig(micro_batch_tokens=micro_batch_tokens, sort_by_length=False))


def pg_loss(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean policy gradient with the step-global denominator (the loss-scaling contract)."""
    mask = mb.loss_mask.to(out.logprobs.dtype)
    return -(out.logprobs * mb.advantages * mask).sum() / mb.step_num_tokens, {"tokens": float(mask.sum())}


def _logprobs(backend: TrainingBackend, mbs: list[MicroBatch]) -> list[torch.Tensor]:
    return [backend.forward_logprobs(mb, replay_routes=False).logprobs for mb in mbs]


def test_forward_outputs_are_cpu_float32_with_zeros_at_the_start_and_on_padding(backend: TrainingBackend) -> None:
    mb = _batches(10_000)[0]
    out = backend.forward_logprobs(mb, replay_routes=False, with_entropy=True)
    for t in (out.logprobs, out.entropy):
        assert t is not None and t.device.type == "cpu" and t.dtype == torch.float32
        assert t.shape == mb.input_ids.shape
        assert bool((t[:, 0] == 0).all()) and bool((t[~mb.attention_mask] == 0).all())
    assert bool((out.logprobs[mb.loss_mask] < 0).all()) and bool((out.entropy[mb.loss_mask] > 0).all())


def test_rank_roles_and_moe_shape(backend: TrainingBackend) -> None:
    assert backend.is_main_rank  # one process: the main rank
    with pytest.raises(RuntimeError, match="follow"):
        backend.follow()
    assert backend.num_moe_layers == moe_facts(_hf_config()).num_moe_layers == 2


def test_a_step_reports_the_required_metrics(backend: TrainingBackend) -> None:
    mbs = _batches(10_000)
    result = backend.train_step(mbs, pg_loss, replay_routes=False)
    missing = set(REQUIRED_STEP_METRICS) - set(result.metrics)
    assert not missing, f"{type(backend).__name__} does not report {sorted(missing)}"
    assert result.metrics["step_skipped"] == 0 and result.metrics["num_micro_batches"] == len(mbs)
    assert math.isfinite(result.metrics["loss"]) and result.grad_norm > 0
    assert result.metrics["grad_norm"] == pytest.approx(result.grad_norm)
    assert result.metrics["lr"] == pytest.approx(1e-2) and result.metrics["train_tokens_per_s"] > 0
    assert result.num_tokens == sum(mb.num_tokens for mb in mbs)


def test_any_split_into_micro_batches_gives_the_same_update() -> None:
    """Loss scaling: one micro-batch or several, the same gradient norm, step loss and parameters after."""
    results, after = [], []
    for tokens in (10_000, 40):
        backend = _torch("cpu")(_hf_model())
        mbs = _batches(tokens)
        results.append((len(mbs), backend.train_step(mbs, pg_loss, replay_routes=False)))
        after.append(dict(backend.export_weights()))
    (n_one, one), (n_many, many) = results
    assert n_one == 1 and n_many > 2
    assert many.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    assert many.metrics["loss"] == pytest.approx(one.metrics["loss"], rel=1e-5, abs=1e-7)
    # Adam's first step moves each weight by about lr·sign(g): where g is ~0, float32 rounding of the summed
    # micro-batch gradients can tip it, so parameters are compared to 1% of one step (lr 1e-2), not bit for bit.
    for name, t in after[0].items():
        torch.testing.assert_close(after[1][name], t, rtol=0, atol=1e-4)


def test_non_finite_gradients_skip_the_step_and_change_nothing(backend: TrainingBackend) -> None:
    mbs = _batches(10_000)
    before = {k: v.clone() for k, v in backend.export_weights()}
    lp_before = _logprobs(backend, mbs)

    def nan_loss(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        loss, m = pg_loss(out, mb)
        return loss * float("nan"), m

    result = backend.train_step(mbs, nan_loss, replay_routes=False)  # never raises for it
    assert result.metrics["step_skipped"] == 1 and not math.isfinite(result.grad_norm)
    for name, t in backend.export_weights():
        assert torch.equal(t, before[name]), name
    for a, b in zip(_logprobs(backend, mbs), lp_before, strict=True):
        assert torch.equal(a, b)
    # And the backend still trains afterwards.
    assert backend.train_step(mbs, pg_loss, replay_routes=False).metrics["step_skipped"] == 0


def test_export_is_hf_named_cpu_and_follows_training(backend: TrainingBackend) -> None:
    hf_names = set(_hf_model().state_dict())
    first = {k: v.clone() for k, v in backend.export_weights()}
    assert set(first) <= hf_names and "model.embed_tokens.weight" in first and "lm_head.weight" in first
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in first.values())
    backend.train_step(_batches(10_000), pg_loss, replay_routes=False)
    changed = [k for k, t in backend.export_weights() if not torch.equal(t, first[k])]
    assert "lm_head.weight" in changed


def test_save_then_load_continues_identically(backend: TrainingBackend, tmp_path: Path) -> None:
    mbs = _batches(10_000)
    backend.train_step(mbs, pg_loss, replay_routes=False)
    backend.save(tmp_path / "ckpt")
    a = backend.train_step(mbs, pg_loss, replay_routes=False)
    lp_a = _logprobs(backend, mbs)
    backend.load(tmp_path / "ckpt")  # optimizer state included: the same second step again
    b = backend.train_step(mbs, pg_loss, replay_routes=False)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-6)
    for x, y in zip(_logprobs(backend, mbs), lp_a, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
