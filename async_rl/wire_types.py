"""In-memory types of the wire records (the encoding lives in :mod:`async_rl.wire`).

One stream entry carries one :class:`GroupRecord`: a prompt and the ``n`` samples a
generator drew for it. Arrays are numpy; on the wire they travel as raw little-endian
bytes with dtype and shape and are decoded zero-copy (read-only views).

Token alignment conventions (shared by the engines, the learner and the backends):

* the full sequence of sample ``i`` is ``concat(prompt_ids, samples[i].response_ids)``;
* ``logprobs[j]`` / ``versions[j]`` belong to ``response_ids[j]`` (the logprob under the
  distribution it was sampled from, temperature applied; the weight version that produced it);
* ``routes[t, l, k]`` is the k-th expert chosen by the l-th MoE layer (MoE layers only, in
  model order) for the token at position ``t`` of the full sequence. Only the tokens the
  engine actually ran through the model have routes, so ``routes.shape[0] <= len(prompt) +
  len(response)`` (typically one fewer: the last sampled token is never run). Positions past
  ``routes.shape[0]`` are not replayed (masked), never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 1

FINISH_REASONS = ("stop", "length", "abort")
"""``stop``: an end/stop token was sampled; ``length``: max_new_tokens reached; ``abort``: cut short."""


@dataclass(slots=True)
class Sample:
    """One sampled response of a group."""

    response_ids: np.ndarray
    """int32 ``[R]`` sampled token ids."""
    logprobs: np.ndarray
    """float32 ``[R]`` behaviour logprob of each sampled token."""
    versions: np.ndarray
    """int32 ``[R]`` weight version that produced each token."""
    reward: float
    """Scalar reward used for advantages."""
    finish_reason: str
    """One of :data:`FINISH_REASONS`."""
    routes: np.ndarray | None = None
    """uint8 / int16 ``[T_run, moe_layers, top_k]`` routed experts, or None for dense models."""
    reward_info: dict[str, float] = field(default_factory=dict)
    """Named reward components / task metrics (e.g. ``{"correct": 1.0}``), for logging."""


@dataclass(slots=True)
class GroupRecord:
    """A prompt and its ``n`` samples: one rollout stream entry."""

    group_id: str
    """Unique id of this group (the learner skips ids it already trained on)."""
    prompt_id: str
    """Id of the prompt (stable across retries of the same prompt)."""
    generator_id: str
    """Which generator produced it."""
    created_at: float
    """Unix time when the record was finished."""
    prompt_ids: np.ndarray
    """int32 ``[P]`` prompt token ids."""
    samples: list[Sample]
    """The samples, in sampling order."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Small msgpack-able extras: task name, prompt issue version, timings."""
    schema_version: int = SCHEMA_VERSION

    @property
    def min_version(self) -> int:
        """Oldest weight version of any token in the group (staleness is measured on it)."""
        return min(int(s.versions.min()) if s.versions.size else 0 for s in self.samples) if self.samples else 0

    @property
    def num_tokens(self) -> int:
        return sum(int(s.response_ids.size) for s in self.samples)
