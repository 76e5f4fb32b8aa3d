"""The data a learner step trains on, shared by the loss functions and every training backend.

The learner turns group records into :class:`TrainSample` s, cuts a step batch into right-padded
:class:`MicroBatch` es by token budget and hands them, with a :data:`LossFn`, to a backend, which
returns a :class:`ForwardOutput` per forward pass and a :class:`StepResult` per optimizer step.
These types live here, below the actors, because the algorithms (``loss_fn``) and the backends
(``actors/learner``) both speak them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class TrainSample:
    """One sequence to train on, host side (see :mod:`async_rl.wire.types` for alignments)."""

    input_ids: np.ndarray
    """int32 ``[T]``: prompt followed by response."""
    prompt_len: int
    """Number of prompt tokens at the start of ``input_ids``."""
    behaviour_logprobs: np.ndarray
    """float32 ``[T - prompt_len]``: generator's logprob of each response token."""
    versions: np.ndarray
    """int32 ``[T - prompt_len]``: weight version of each response token."""
    advantages: np.ndarray
    """float32 ``[T - prompt_len]``: per-token advantage."""
    routes: np.ndarray | None = None
    """uint8/int16 ``[T_run, moe_layers, top_k]`` recorded routes for positions ``< T_run``, or None."""
    group_id: str = ""
    """Group this sample came from."""
    loss_mask: np.ndarray | None = None
    """bool ``[T - prompt_len]``: the response tokens trained on (the model's; False on an environment's reply in
    an episode of several turns). None: every response token."""

    @property
    def num_loss_tokens(self) -> int:
        """Response tokens the loss sees."""
        r = int(self.input_ids.shape[0]) - self.prompt_len
        return r if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))


@dataclass(slots=True)
class MicroBatch:
    """A right-padded batch of sequences; every ``[B, T]`` tensor lives on the CPU until a backend moves it.

    Position ``t`` of ``logprobs``-like tensors holds the value for token ``input_ids[b, t]``
    (predicted from ``input_ids[b, :t]``); ``loss_mask`` is True exactly on the response tokens the model
    sampled (an environment's tokens inside an episode are attended to, never trained on).
    """

    input_ids: torch.Tensor
    """int64 ``[B, T]``, pad id 0 past each sequence."""
    attention_mask: torch.Tensor
    """bool ``[B, T]``: True on real tokens."""
    loss_mask: torch.Tensor
    """bool ``[B, T]``: True on the model's response tokens (the ones trained on)."""
    behaviour_logprobs: torch.Tensor
    """float32 ``[B, T]`` (0 outside loss_mask)."""
    advantages: torch.Tensor
    """float32 ``[B, T]`` (0 outside loss_mask)."""
    token_versions: torch.Tensor
    """int64 ``[B, T]`` (0 outside loss_mask)."""
    routes: list[np.ndarray | None]
    """Ragged recorded routes per sequence (see :attr:`TrainSample.routes`); backends cut them per rank."""
    step_num_tokens: int
    """Loss-mask tokens in the whole step batch (all micro-batches, all DP ranks)."""
    step_num_sequences: int
    """Sequences in the whole step batch (all micro-batches, all DP ranks)."""
    proximal_logprobs: torch.Tensor | None = None
    """float32 ``[B, T]``: π_old, recomputed by the learner before the update (``AlgorithmConfig.needs_proximal_logprobs``:
    the losses on π_old and every off-policy correction read it)."""
    reference_logprobs: torch.Tensor | None = None
    """float32 ``[B, T]``: reference-policy logprobs for a KL penalty."""
    group_ids: list[str] = field(default_factory=list)

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on ``device`` (routes stay on the host)."""

        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        def mv_opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else mv(t)

        return MicroBatch(
            input_ids=mv(self.input_ids), attention_mask=mv(self.attention_mask), loss_mask=mv(self.loss_mask),
            behaviour_logprobs=mv(self.behaviour_logprobs), advantages=mv(self.advantages),
            token_versions=mv(self.token_versions), routes=self.routes, step_num_tokens=self.step_num_tokens,
            step_num_sequences=self.step_num_sequences, proximal_logprobs=mv_opt(self.proximal_logprobs),
            reference_logprobs=mv_opt(self.reference_logprobs), group_ids=self.group_ids,
        )  # fmt: skip


@dataclass(slots=True)
class ForwardOutput:
    """What a forward pass yields, aligned with the micro-batch's ``[B, T]`` layout."""

    logprobs: torch.Tensor
    """float32 ``[B, T]``: log π(input_ids[b, t] | input_ids[b, :t]); 0 at t = 0 and on padding."""
    entropy: torch.Tensor | None = None
    """float32 ``[B, T]``: entropy of the predictive distribution at t (when asked for)."""


LossFn = Callable[[ForwardOutput, MicroBatch], tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]]
"""``loss_fn(out, mb) -> (loss, metrics)``; ``out`` and ``mb`` on the backend's device, loss scaled as above."""


@dataclass(slots=True)
class StepResult:
    """Outcome of one optimizer step."""

    metrics: dict[str, float]
    """Loss-function metrics averaged over micro-batches (token-weighted) plus backend metrics."""
    grad_norm: float
    """Global gradient norm before clipping."""
    num_tokens: int
    """Tokens (prompt + response) processed in the step."""
