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
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from async_rl.algorithms.batch import ForwardOutput, LossFn, MicroBatch, StepResult


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
