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
* ``loss_mask[j]`` (episodes of several turns) is 1 where ``response_ids[j]`` was sampled by the
  model and 0 where the environment wrote it (a tool's output, a user's reply): environment tokens
  are in the sequence (the model reads them) but never in the loss. Their ``logprobs`` are 0 and
  meaningless; their ``versions`` are the weight version that ran their prefill. ``None`` means
  every response token is the model's (a single-turn sample).

Schema versions: 1 is the single-turn record; 2 adds the optional per-sample loss mask. Writers
always write :data:`SCHEMA_VERSION`; readers accept every version in :data:`READ_SCHEMA_VERSIONS`
(a version-1 record decodes with ``loss_mask=None``), and an older reader refuses a version-2
record by its version number, never by misreading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 2
READ_SCHEMA_VERSIONS = (1, 2)
"""Group-record schema versions this code decodes (see the module docstring)."""

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
    loss_mask: np.ndarray | None = None
    """uint8 ``[R]``: 1 on the model's tokens, 0 on the environment's (never trained on); None: all the model's."""

    def model_token_mask(self) -> np.ndarray:
        """bool ``[R]``: True on the tokens the model sampled (every token when ``loss_mask`` is None)."""
        if self.loss_mask is None:
            return np.ones(self.response_ids.shape[0], dtype=bool)
        return np.asarray(self.loss_mask, dtype=bool)


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
        """Oldest weight version of any token in the group (staleness is measured on it); an empty response (an
        episode that could not open) has no token and no say; a group of empty responses counts as version 0."""
        return min((int(s.versions.min()) for s in self.samples if s.versions.size), default=0)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.response_ids.size) for s in self.samples)
