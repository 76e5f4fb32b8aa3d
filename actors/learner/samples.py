"""A batch of rollout groups -> training samples: advantages per group, one sample per non-empty response.

An episode's environment tokens stay in the sequence and leave the loss through the sample's loss mask.
:func:`response_metrics` says how long the batch's responses are (a policy that rambles into ``max_new_tokens``, or
collapses to a few tokens, shows there before it shows in the reward).

Shared by the learner loop and what drives the same training outside it (the staleness simulation, ``bench
publish``), so that they train on exactly what the learner would. A mixture's groups (``task.mix``) carry their
source: :func:`source_metrics` reports the step's rewards per source.
"""

from __future__ import annotations

import numpy as np

from actors.learner.config import LearnerConfig
from async_rl.algorithms import broadcast_to_tokens, compute_advantages
from async_rl.algorithms.batch import TrainSample
from async_rl.tasks.mixture import SOURCE_KEY
from async_rl.wire.types import GroupRecord


def build_samples(
    groups: list[GroupRecord], cfg: LearnerConfig
) -> tuple[list[TrainSample], dict[str, float], list[float]]:
    """TrainSamples of ``groups`` with their advantages; also advantage metrics and per-sample rewards."""
    rewards = [np.array([s.reward for s in g.samples], dtype=np.float64) for g in groups]
    advantages, metrics = compute_advantages(rewards, cfg.algorithm)
    samples: list[TrainSample] = []
    num_empty = 0
    for g, adv in zip(groups, advantages, strict=True):
        prompt = np.asarray(g.prompt_ids, dtype=np.int32)
        for s, a in zip(g.samples, adv, strict=True):
            r = int(s.response_ids.size)
            if r == 0:
                num_empty += 1
                continue
            samples.append(TrainSample(
                input_ids=np.concatenate([prompt, np.asarray(s.response_ids, dtype=np.int32)]),
                prompt_len=int(prompt.size), behaviour_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                versions=np.asarray(s.versions, dtype=np.int32), advantages=broadcast_to_tokens(float(a), r),
                routes=s.routes if cfg.replay_routes else None, group_id=g.group_id,
                loss_mask=None if s.loss_mask is None else np.asarray(s.loss_mask, dtype=bool),
            ))  # fmt: skip
    metrics["empty_responses_count"] = float(num_empty)
    return samples, metrics, [float(x) for r in rewards for x in r]


def response_metrics(groups: list[GroupRecord]) -> dict[str, float]:
    """Lengths of every response of ``groups`` in tokens (an episode's: the model's and the environment's together,
    what ``episode.max_tokens`` bounds): mean, max, median and 90th percentile, and the fraction cut at the token
    budget (``finish_reason`` ``length``)."""
    lengths = np.array([s.response_ids.size for g in groups for s in g.samples], dtype=np.float64)
    if not lengths.size:
        return {}
    truncated = sum(s.finish_reason == "length" for g in groups for s in g.samples)
    return {"response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/length_p50": float(np.percentile(lengths, 50)),
            "response/length_p90": float(np.percentile(lengths, 90)),
            "response/truncated_frac": truncated / lengths.size}  # fmt: skip


def source_metrics(groups: list[GroupRecord]) -> dict[str, float]:
    """Per source of a mixture's groups (none for a task that is not one): ``train/<source>/reward`` (the mean reward
    of its samples), ``train/<source>/reward/<component>`` (each component any of them reports, 0 where one does not)
    and ``train/<source>/groups``, named as the step's own ``reward`` and ``reward/<component>``."""
    by_source: dict[str, list[GroupRecord]] = {}
    for g in groups:
        source = g.metadata.get(SOURCE_KEY)
        if source:
            by_source.setdefault(str(source), []).append(g)
    out: dict[str, float] = {}
    for source, members in sorted(by_source.items()):
        samples = [s for g in members for s in g.samples]
        out[f"train/{source}/reward"] = float(np.mean([s.reward for s in samples])) if samples else 0.0
        out[f"train/{source}/groups"] = float(len(members))
        for key in dict.fromkeys(k for s in samples for k in s.reward_info):
            out[f"train/{source}/reward/{key}"] = float(np.mean([s.reward_info.get(key, 0.0) for s in samples]))
    return out
