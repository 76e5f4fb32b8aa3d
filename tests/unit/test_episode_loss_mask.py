"""Environment tokens of an episode never enter the loss: the loss mask carried on the wire reaches the micro-batch,
and the gradient with respect to the logits that predict an environment token is exactly zero under every policy
loss, correction, reduction, KL and entropy term, while the model's own tokens do get gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.learner.batching import make_micro_batches, response_tokens
from actors.learner.config import BatchingConfig, LearnerConfig
from actors.learner.samples import build_samples
from actors.learner.torch_backend import token_logprobs
from async_rl.algorithms import AlgorithmConfig, make_loss_fn
from async_rl.algorithms.config import CorrectionConfig, LossConfig
from async_rl.wire import decode_group, encode_group
from async_rl.wire.sampling import Sampling
from async_rl.wire.types import GroupRecord, Sample

PROMPT = np.array([1, 5, 6, 7], dtype=np.int32)
# Model turn (2 tokens), environment reply (3 tokens), model turn (3 tokens): 8 response tokens.
MASK = np.array([1, 1, 0, 0, 0, 1, 1, 1], dtype=np.uint8)


def _group() -> GroupRecord:
    rng = np.random.default_rng(0)
    samples = []
    for i, mask in enumerate((MASK, None, MASK)):
        n = 8 if mask is not None else 5
        lp = -rng.random(n).astype(np.float32) - 0.5
        if mask is not None:
            lp[mask == 0] = 0.0  # the generator writes 0 there: meaningless, never read
        samples.append(Sample(response_ids=rng.integers(4, 22, n).astype(np.int32), logprobs=lp,
                              versions=np.full(n, 3, np.int32), reward=float(i * i), finish_reason="stop",
                              loss_mask=mask))  # fmt: skip
    return GroupRecord(group_id="g", prompt_id="g", generator_id="gen", created_at=1.0, prompt_ids=PROMPT,
                       samples=samples)  # fmt: skip


def test_loss_mask_reaches_the_micro_batch():
    rec = decode_group(encode_group(_group()))
    samples, _, _ = build_samples([rec], LearnerConfig(batch_groups=1, sampling=Sampling(n=3)))
    assert response_tokens(samples) == 5 + 5 + 5  # environment tokens are not counted
    (mb,) = make_micro_batches(samples, BatchingConfig(sort_by_length=False))
    p = PROMPT.size
    expect = np.zeros((3, p + 8), dtype=bool)
    expect[0, p:] = expect[2, p:] = MASK.astype(bool)
    expect[1, p : p + 5] = True
    np.testing.assert_array_equal(mb.loss_mask.numpy(), expect)
    assert mb.step_num_tokens == 15
    env = torch.from_numpy(~expect & mb.attention_mask.numpy())
    env[:, :p] = False
    for t in (mb.behaviour_logprobs, mb.advantages, mb.token_versions):
        assert not t[env].any()  # zero on environment tokens, like padding


LOSSES = [
    AlgorithmConfig(),
    AlgorithmConfig(loss=LossConfig(type="ppo", reduction="seq_mean_token_mean", entropy_coef=0.01)),
    AlgorithmConfig(loss=LossConfig(type="regular", kl_coef=0.1, reduction="seq_mean_token_sum"),
                    correction=CorrectionConfig(tis="token", token_mask=True, token_mask_low=0.01,
                                                token_mask_high=100.0)),  # fmt: skip
    AlgorithmConfig(loss=LossConfig(type="rollout_is", reduction="token_sum_norm", max_tokens=16),
                    correction=CorrectionConfig(outlier_mask=True, m2_mask=True, m2_threshold=10.0)),  # fmt: skip
]


@pytest.mark.parametrize("algorithm", LOSSES, ids=["cispo", "ppo_entropy", "regular_kl_tis", "rollout_is_masks"])
def test_no_gradient_reaches_environment_tokens(algorithm: AlgorithmConfig):
    from async_rl.model.presets import load_model

    torch.manual_seed(0)
    model = load_model("tiny-dense", seed=0)
    rec = decode_group(encode_group(_group()))
    samples, _, _ = build_samples([rec], LearnerConfig(batch_groups=1, sampling=Sampling(n=3)))
    (mb,) = make_micro_batches(samples, BatchingConfig(sort_by_length=False))
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask.long()).logits
    logits.retain_grad()
    need_entropy = algorithm.needs_entropy
    logprobs, entropy = token_logprobs(logits, mb.input_ids, mb.attention_mask, with_entropy=need_entropy)
    # μ near π on the model's tokens (no clip or correction drops them), 0 elsewhere as the batching writes it.
    mb.behaviour_logprobs = torch.where(mb.loss_mask, logprobs.detach() - 0.02, 0.0)
    if algorithm.needs_proximal_logprobs:
        mb.proximal_logprobs = logprobs.detach() + 0.05
    if algorithm.needs_reference_logprobs:
        mb.reference_logprobs = logprobs.detach() - 0.2
    from async_rl.algorithms.batch import ForwardOutput

    loss, metrics = make_loss_fn(algorithm)(ForwardOutput(logprobs=logprobs, entropy=entropy), mb)
    loss.backward()
    assert metrics["loss_tokens_count"] == 15
    grad = logits.grad
    assert grad is not None
    # logits[:, t - 1] predict token t: the gradient there is the loss's dependence on token t's logprob.
    predicts = torch.zeros_like(mb.loss_mask)
    predicts[:, :-1] = mb.loss_mask[:, 1:]
    per_position = grad.abs().sum(-1)
    env = torch.zeros_like(mb.loss_mask)
    env[:, :-1] = mb.attention_mask[:, 1:] & ~mb.loss_mask[:, 1:]
    env[:, : PROMPT.size - 1] = False  # prompt tokens (also outside the loss)
    assert env.sum() == 6  # the two episodes' environment replies
    assert torch.equal(per_position[env], torch.zeros_like(per_position[env]))
    assert (per_position[predicts] > 0).all()  # and every model token does get gradient
