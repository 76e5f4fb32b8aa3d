"""Checks of a decoded group record against the learner's model and the run, before it reaches a batch.

The wire codec (:mod:`async_rl.wire`) guarantees a record is well formed: dtypes, shapes that agree
with each other, finite numbers. It cannot know the model. This module refuses what is well formed
but would crash the backend or train on garbage, each with a :class:`EntryError` naming the field:

* token ids outside ``[0, vocab_size)`` (an embedding lookup out of range);
* a sequence (prompt + response) longer than the model's context, or an empty prompt;
* MoE routes of a dense model, with the wrong number of MoE layers or the wrong ``top_k``, an expert
  id ``>= num_experts``, or the same expert twice in one token's row (replay would pick it twice);
* token weight versions newer than the learner has published (``max_version``), or a group with a
  different number of samples than the run samples per prompt;
* a loss mask (episodes of several turns) that leaves none of a non-empty response's tokens to the
  model: nothing of it could be trained on, so a generator wrote it wrong. (Its length and values
  are the codec's to check.)

Whether the prompt id was issued and is still in flight is the run's other fact; the reader asks
:mod:`buffer.audit` (one round trip per read). Nothing here imports torch: facts come from a
transformers config through :mod:`async_rl.model.moe`, or are given directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from async_rl.model.moe import moe_facts
from async_rl.wire.types import GroupRecord


class EntryError(ValueError):
    """A well-formed record the learner must not train on; the message names the field."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What an entry is checked against: the learner's model."""

    vocab_size: int
    """Token ids must be in ``[0, vocab_size)``."""
    max_seq_len: int
    """Prompt + response tokens at most this many (the model's context, ``max_position_embeddings``)."""
    num_moe_layers: int = 0
    """Middle dimension of routes (0: dense model, routes refused)."""
    top_k: int = 0
    """Last dimension of routes."""
    num_experts: int = 0
    """Expert ids must be in ``[0, num_experts)``."""

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"ModelFacts.vocab_size must be >= 1, got {self.vocab_size}")
        if self.max_seq_len < 2:
            raise ValueError(f"ModelFacts.max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.num_moe_layers and (self.top_k < 1 or self.num_experts < self.top_k):
            raise ValueError(f"ModelFacts: {self.num_moe_layers} MoE layers need 1 <= top_k <= num_experts, "
                             f"got top_k={self.top_k}, num_experts={self.num_experts}")  # fmt: skip

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelFacts:
        """Facts of a transformers config (``vocab_size``, ``max_position_embeddings``, MoE via :mod:`async_rl.model.moe`)."""
        text = getattr(config, "text_config", None) or config
        moe = moe_facts(config)
        return cls(vocab_size=int(text.vocab_size), max_seq_len=int(text.max_position_embeddings),
                   num_moe_layers=moe.num_moe_layers, top_k=moe.top_k, num_experts=moe.num_experts)  # fmt: skip


class EntryChecker:
    """Applies :class:`ModelFacts` and the run's facts to decoded records (see the module docstring)."""

    facts: ModelFacts
    num_samples: int | None
    max_version: int | None
    """Newest weight version a token may carry (the learner moves it forward as it publishes); None: unchecked."""

    def __init__(self, facts: ModelFacts, *, num_samples: int | None = None, max_version: int | None = None) -> None:
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.facts = facts
        self.num_samples = num_samples
        self.max_version = max_version

    def check(self, rec: GroupRecord) -> None:
        """Raise :class:`EntryError` naming the first field the model or the run cannot take."""
        f = self.facts
        num_prompt = int(rec.prompt_ids.shape[0])
        if num_prompt < 1:
            raise EntryError("prompt_ids is empty (the first response token would have no context)")
        _check_ids(rec.prompt_ids, "prompt_ids", f.vocab_size)
        if self.num_samples is not None and len(rec.samples) != self.num_samples:
            raise EntryError(f"samples: {len(rec.samples)} samples, the run samples {self.num_samples} per prompt")
        for i, s in enumerate(rec.samples):
            path = f"samples[{i}]"
            n = int(s.response_ids.shape[0])
            if num_prompt + n > f.max_seq_len:
                raise EntryError(f"{path}: {num_prompt} prompt + {n} response tokens exceed the model's context "
                                 f"of {f.max_seq_len}")  # fmt: skip
            _check_ids(s.response_ids, f"{path}.response_ids", f.vocab_size)
            if self.max_version is not None and n and int(s.versions.max()) > self.max_version:
                raise EntryError(f"{path}.versions: version {int(s.versions.max())} is newer than the newest "
                                 f"published version {self.max_version}")  # fmt: skip
            if s.loss_mask is not None and n and not s.loss_mask.any():
                raise EntryError(f"{path}.loss_mask: none of the {n} response tokens is the model's "
                                 "(an episode's response starts with a model turn)")  # fmt: skip
            if s.routes is not None:
                self._check_routes(s.routes, f"{path}.routes")

    def _check_routes(self, routes: np.ndarray, path: str) -> None:
        f = self.facts
        if not f.num_moe_layers:
            raise EntryError(f"{path}: the learner's model is dense, but the sample carries MoE routes")
        _, layers, top_k = routes.shape
        if layers != f.num_moe_layers:
            raise EntryError(f"{path}: routes for {layers} MoE layers, the model has {f.num_moe_layers}")
        if top_k != f.top_k:
            raise EntryError(f"{path}: routes with top_k {top_k}, the model routes to {f.top_k} experts per token")
        if not routes.size:
            return
        hi = int(routes.max())
        if hi >= f.num_experts:
            t, layer, _ = np.unravel_index(int(routes.argmax()), routes.shape)
            raise EntryError(f"{path}[{t}, {layer}]: expert id {hi} is not below the model's {f.num_experts} experts")
        # Pairwise column comparisons: top_k is small (2-8), far cheaper than sorting every row.
        for a in range(top_k):
            for b in range(a + 1, top_k):
                same = routes[:, :, a] == routes[:, :, b]
                if same.any():
                    t, layer = np.unravel_index(int(same.argmax()), same.shape)
                    raise EntryError(f"{path}[{t}, {layer}]: expert {int(routes[t, layer, a])} appears twice in one "
                                     "token's row")  # fmt: skip


def _check_ids(ids: np.ndarray, path: str, vocab_size: int) -> None:
    if not ids.size:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        index = int(np.flatnonzero(ids == bad)[0])
        raise EntryError(f"{path}[{index}] = {bad} is not in the model's vocabulary [0, {vocab_size})")
