"""The training-backend interface the learner loop drives (torch, Megatron).

The learner owns the data: it turns group records into :class:`TrainSample` s, computes
advantages, cuts the step batch into :class:`MicroBatch` es by token budget and passes a
loss function from :mod:`async_rl.algorithms`. A backend owns the model and optimizer:
forward passes (optionally replaying recorded MoE routes), backward over micro-batches,
the optimizer step, weight export in Hugging Face names, save and load.

Loss scaling (the contract between the learner's loss function and every backend): the
loss function returns *this micro-batch's share of the global step loss*, already
normalised with step-global denominators (``MicroBatch.step_num_tokens`` /
``MicroBatch.step_num_sequences``, counted by the learner over the whole step batch, all
data-parallel ranks together). Backends therefore **sum** gradients over micro-batches
and over data-parallel ranks, and never rescale by the number of micro-batches. (Megatron
averages over DP by default; its backend multiplies by the DP size to get the sum.)
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


@dataclass(slots=True)
class TrainSample:
    """One sequence to train on, host side (see :mod:`async_rl.wire_types` for alignments)."""

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


@dataclass(slots=True)
class MicroBatch:
    """A right-padded batch of sequences; every ``[B, T]`` tensor lives on the CPU until a backend moves it.

    Position ``t`` of ``logprobs``-like tensors holds the value for token ``input_ids[b, t]``
    (predicted from ``input_ids[b, :t]``); ``loss_mask`` is True exactly on response tokens.
    """

    input_ids: torch.Tensor
    """int64 ``[B, T]``, pad id 0 past each sequence."""
    attention_mask: torch.Tensor
    """bool ``[B, T]``: True on real tokens."""
    loss_mask: torch.Tensor
    """bool ``[B, T]``: True on response tokens (the ones trained on)."""
    behaviour_logprobs: torch.Tensor
    """float32 ``[B, T]`` (0 outside loss_mask)."""
    advantages: torch.Tensor
    """float32 ``[B, T]`` (0 outside loss_mask)."""
    token_versions: torch.Tensor
    """int64 ``[B, T]`` (0 outside loss_mask)."""
    routes: list[np.ndarray | None]
    """Ragged recorded routes per sequence (see :attr:`TrainSample.routes`); backends cut them per rank."""
    step_num_tokens: int
    """Response tokens in the whole step batch (all micro-batches, all DP ranks)."""
    step_num_sequences: int
    """Sequences in the whole step batch (all micro-batches, all DP ranks)."""
    proximal_logprobs: torch.Tensor | None = None
    """float32 ``[B, T]``: π_prox recomputed by the learner before the update (decoupled PPO)."""
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


LossFn = Callable[[ForwardOutput, MicroBatch], tuple[torch.Tensor, dict[str, float]]]
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


class TrainingBackend(abc.ABC):
    """A model and its optimizer, as the learner loop needs them."""

    name: str = "backend"

    @property
    @abc.abstractmethod
    def is_main_rank(self) -> bool:
        """True on the one rank that reads streams, publishes weights and logs."""

    @property
    @abc.abstractmethod
    def num_moe_layers(self) -> int:
        """MoE layers of the model (0 for dense): the middle dimension of the routes."""

    @abc.abstractmethod
    def forward_logprobs(
        self, mb: MicroBatch, *, replay_routes: bool = True, with_entropy: bool = False, reference: bool = False
    ) -> ForwardOutput:
        """No-grad forward; CPU float32 outputs. ``reference`` uses the frozen reference model."""

    @abc.abstractmethod
    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, replay_routes: bool = True,
                   with_entropy: bool = False) -> StepResult:  # fmt: skip
        """Forward + ``loss_fn`` + backward on each micro-batch, then one optimizer step."""

    @abc.abstractmethod
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current weights in Hugging Face names as contiguous CPU tensors (main rank; others yield nothing)."""

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Save model and optimizer state under ``directory``."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Restore what :meth:`save` wrote."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (process groups, GPU memory)."""
