"""Cut a step's :class:`TrainSample` s into right-padded :class:`MicroBatch` es under a token budget.

The budget counts padded tokens (``sequences x longest sequence`` of the micro-batch), which is
what a forward pass costs. Sequences are sorted by length (longest first) before packing so
that similar lengths share a micro-batch; a sequence longer than the budget gets a micro-batch
of its own. Every micro-batch carries the step-global denominators (response tokens and
sequences of the whole step, all data-parallel ranks together) that the loss functions divide by.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from actors.learner.config import BatchingConfig
from async_rl.algorithms.batch import MicroBatch, TrainSample

PAD_ID = 0
"""Token id written past each sequence (masked out everywhere, so its value never matters)."""


def validate_sample(s: TrainSample, where: str = "sample") -> None:
    """Raise ValueError naming the field when ``s`` is inconsistent."""
    t = int(s.input_ids.shape[0]) if s.input_ids.ndim == 1 else -1
    if t < 0:
        raise ValueError(f"{where} ({s.group_id}): input_ids must be 1-D, got shape {s.input_ids.shape}")
    if not 1 <= s.prompt_len < t:
        raise ValueError(f"{where} ({s.group_id}): prompt_len must be in [1, {t}), got {s.prompt_len}")
    r = t - s.prompt_len
    for field_name in ("behaviour_logprobs", "versions", "advantages", "loss_mask"):
        arr = getattr(s, field_name)
        if arr is not None and arr.shape != (r,):
            raise ValueError(f"{where} ({s.group_id}): {field_name} must have shape ({r},), got {arr.shape}")
    if s.routes is not None:
        if s.routes.ndim != 3:
            raise ValueError(
                f"{where} ({s.group_id}): routes must be [tokens, moe_layers, top_k], got {s.routes.shape}"
            )
        if s.routes.shape[0] > t:
            raise ValueError(f"{where} ({s.group_id}): routes cover {s.routes.shape[0]} tokens, sequence has {t}")


def collate(
    samples: Sequence[TrainSample], *, step_num_tokens: int, step_num_sequences: int, pad_to: int | None = None
) -> MicroBatch:
    """One right-padded micro-batch of ``samples`` (length ``pad_to`` or the longest sequence)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    for i, s in enumerate(samples):
        validate_sample(s, f"samples[{i}]")
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    width = max(lengths) if pad_to is None else pad_to
    if width < max(lengths):
        raise ValueError(f"pad_to={pad_to} is shorter than the longest sequence ({max(lengths)})")
    b = len(samples)
    input_ids = np.full((b, width), PAD_ID, dtype=np.int64)
    attention = np.zeros((b, width), dtype=bool)
    loss_mask = np.zeros((b, width), dtype=bool)
    behaviour = np.zeros((b, width), dtype=np.float32)
    advantages = np.zeros((b, width), dtype=np.float32)
    versions = np.zeros((b, width), dtype=np.int64)
    for i, (s, t) in enumerate(zip(samples, lengths, strict=True)):
        p = s.prompt_len
        input_ids[i, :t] = s.input_ids
        attention[i, :t] = True
        keep = True if s.loss_mask is None else np.asarray(s.loss_mask, dtype=bool)
        loss_mask[i, p:t] = keep
        # Zero outside the loss mask, as on padding: an environment token's logprob or advantage means nothing.
        behaviour[i, p:t] = np.where(keep, s.behaviour_logprobs, 0.0)
        advantages[i, p:t] = np.where(keep, s.advantages, 0.0)
        versions[i, p:t] = np.where(keep, s.versions, 0)
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(loss_mask), behaviour_logprobs=torch.from_numpy(behaviour),
        advantages=torch.from_numpy(advantages), token_versions=torch.from_numpy(versions),
        routes=[s.routes for s in samples], step_num_tokens=step_num_tokens, step_num_sequences=step_num_sequences,
        group_ids=[s.group_id for s in samples],
    )  # fmt: skip


def response_tokens(samples: Sequence[TrainSample]) -> int:
    """Response tokens the loss sees (an episode's environment tokens excluded) of ``samples``."""
    return sum(s.num_loss_tokens for s in samples)


def make_micro_batches(
    samples: Sequence[TrainSample],
    config: BatchingConfig,
    *,
    step_num_tokens: int | None = None,
    step_num_sequences: int | None = None,
) -> list[MicroBatch]:
    """Micro-batches covering every sample once.

    ``step_num_tokens`` / ``step_num_sequences`` default to this rank's own totals; with data
    parallelism the learner passes the totals over all ranks.
    """
    if not samples:
        return []
    for i, s in enumerate(samples):
        validate_sample(s, f"samples[{i}]")
    num_tokens = response_tokens(samples) if step_num_tokens is None else step_num_tokens
    num_sequences = len(samples) if step_num_sequences is None else step_num_sequences
    if num_tokens <= 0 or num_sequences <= 0:
        raise ValueError(f"step_num_tokens and step_num_sequences must be > 0, got {num_tokens}, {num_sequences}")
    groups = group_by_budget([int(s.input_ids.shape[0]) for s in samples], config)
    return [
        collate([samples[i] for i in g], step_num_tokens=num_tokens, step_num_sequences=num_sequences) for g in groups
    ]


def group_by_budget(lengths: Sequence[int], config: BatchingConfig) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches: longest first when ``config.sort_by_length``, a group
    closed when one more sequence would pass ``micro_batch_tokens`` padded tokens or ``max_micro_batch_sequences``."""
    order = list(range(len(lengths)))
    if config.sort_by_length:
        order.sort(key=lambda i: -int(lengths[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        t = int(lengths[i])
        new_longest = max(longest, t)
        full = config.max_micro_batch_sequences and len(current) >= config.max_micro_batch_sequences
        if current and (full or new_longest * (len(current) + 1) > config.micro_batch_tokens):
            groups.append(current)
            current, new_longest = [], t
        current.append(i)
        longest = new_longest
    if current:
        groups.append(current)
    return groups
