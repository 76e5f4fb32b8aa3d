"""A real (tiny) torch policy trained with make_loss_fn on stale samples learns the rewarded token.

Per-position logits over 8 tokens; reward = fraction of sampled tokens equal to TARGET. Samples come
from the weights of two steps ago (off-policy, as in a fully async run), advantages from GRPO groups.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from _alg_batches import micro_batch

from async_rl.algorithms import AlgorithmConfig, compute_advantages, make_loss_fn, reduce_metrics
from async_rl.algorithms.batch import ForwardOutput
from async_rl.config.configurable import from_dict

VOCAB, LENGTH, TARGET = 8, 6, 3
GROUPS, N = 4, 8
STALENESS = 2
STEPS = 25


class TinyPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(LENGTH, VOCAB))

    def logprobs(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp_all = torch.log_softmax(self.logits, dim=-1).expand(tokens.shape[0], -1, -1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), ent


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"loss": {"type": "ppo"}, "correction": {"token_mask": True}},
        {"loss": {"type": "regular", "reduction": "seq_mean_token_mean"}, "correction": {"tis": "token"}},
        {"loss": {"type": "rollout_is", "clip_eps_low": 0.5, "clip_eps_high": 1.0}},
        {"loss": {"type": "cispo", "cispo_anchor": "old"}, "correction": {"tis": "sequence", "sequence_tis_cap": 5.0}},
        {"advantage": {"estimator": "rloo"}, "loss": {"kl_coef": 0.001, "entropy_coef": 0.001}},
    ],
)
def test_stale_policy_gradient_learns_the_rewarded_token(sections: dict) -> None:
    torch.manual_seed(0)
    cfg: AlgorithmConfig = from_dict(AlgorithmConfig, sections)
    policy = TinyPolicy()
    reference = TinyPolicy()
    opt = torch.optim.Adam(policy.parameters(), lr=0.1)
    history = collections.deque([(0, policy.logits.detach().clone())], maxlen=STALENESS + 1)
    version = [0]
    loss_fn = make_loss_fn(cfg, learner_version=lambda: version[0])
    rewards_seen = []
    for _step in range(STEPS):
        behaviour_version, behaviour = history[0]  # weights up to STALENESS versions old
        probs = torch.softmax(behaviour, -1)
        tokens = torch.multinomial(probs, GROUPS * N, replacement=True).T  # [B, LENGTH]
        mu = torch.log(probs).gather(-1, tokens.T).T
        rewards = (tokens == TARGET).float().mean(-1).view(GROUPS, N).numpy().astype(np.float64)
        rewards_seen.append(rewards.mean())
        adv, _ = compute_advantages(rewards, cfg)
        adv_tok = torch.from_numpy(np.asarray(adv)).reshape(-1, 1).expand(-1, LENGTH).contiguous()
        mask = torch.ones(GROUPS * N, LENGTH, dtype=torch.bool)
        with torch.no_grad():
            prox = policy.logprobs(tokens)[0] if cfg.needs_proximal_logprobs else None
            ref = reference.logprobs(tokens)[0] if cfg.needs_reference_logprobs else None
        versions = torch.full(mask.shape, behaviour_version, dtype=torch.long)
        mb = micro_batch(mask, mu, adv_tok, proximal=prox, reference=ref, versions=versions)
        opt.zero_grad()
        metrics = []
        for lo in range(0, GROUPS * N, 8):  # four micro-batches, step-global denominators
            part = slice(lo, lo + 8)
            logp, ent = policy.logprobs(tokens[part])
            sub = micro_batch(mask[part], mu[part], adv_tok[part], step_num_tokens=mb.step_num_tokens,
                              step_num_sequences=mb.step_num_sequences,
                              proximal=None if prox is None else prox[part],
                              reference=None if ref is None else ref[part], versions=versions[part])  # fmt: skip
            loss, m = loss_fn(ForwardOutput(logprobs=logp, entropy=ent), sub)
            loss.backward()
            metrics.append(m)
        opt.step()
        agg = reduce_metrics(metrics)
        assert agg["loss_tokens_count"] == GROUPS * N * LENGTH
        assert agg["staleness_max"] == min(version[0], STALENESS)
        assert agg[f"staleness_hist_{min(version[0], STALENESS)}_count"] == GROUPS * N * LENGTH
        version[0] += 1
        history.append((version[0], policy.logits.detach().clone()))
    p_target = torch.softmax(policy.logits, -1)[:, TARGET].mean().item()
    assert rewards_seen[0] < 0.3
    assert p_target > 0.7, f"p(target) {p_target:.3f}, rewards {rewards_seen[::5]}"
