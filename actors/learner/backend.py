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
from async_rl.weights.config import PublisherConfig
from async_rl.weights.gpu.publisher import local_slots
from async_rl.weights.gpu.slots import GpuExport

REQUIRED_STEP_METRICS = ("loss", "grad_norm", "lr", "step_skipped", "num_micro_batches", "train_tokens_per_s")
"""Keys every backend's :meth:`TrainingBackend.train_step` reports in ``StepResult.metrics`` (besides the loss
function's own metrics, token-weighted over micro-batches and ranks)."""


class TrainingBackend(abc.ABC):
    """A model and its optimizer, as the learner loop needs them: every method the learner calls is here.

    Guarantees every backend keeps (checked by ``tests/unit/test_backend_conformance.py`` on the torch backend on
    CPU and the Megatron backend on a GPU):

    * **Loss scaling.** ``loss_fn`` returns its micro-batch's share of the step loss (module docstring); the
      backend sums gradients over micro-batches and data-parallel ranks, so any split of a step batch into
      micro-batches gives the same gradients and the same update.
    * **Reduction over ranks is the backend's.** The learner sees one :class:`StepResult` on the main rank: the
      gradient norm is global, ``metrics["loss"]`` is the step loss (the sum of the micro-batch losses, all
      ranks), the loss function's metrics are token-weighted means over all micro-batches and ranks.
    * **Non-finite gradients skip the step.** When the global gradient norm is not finite, no parameter and no
      optimizer state changes; the step returns with ``metrics["step_skipped"] == 1`` and the non-finite norm,
      and the learner carries on (it counts and logs skipped steps). It never raises for that.
    * **Metrics.** ``StepResult.metrics`` holds at least :data:`REQUIRED_STEP_METRICS`.
    * **Ranks.** Exactly one rank is the main rank (:attr:`is_main_rank`): it reads streams, calls the
      methods below and publishes. Every other rank runs :meth:`follow` until the main rank calls :meth:`close`.
    """

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
    def follow(self) -> None:
        """Non-main ranks: run what the main rank calls, until it calls :meth:`close`. On the main rank: an error."""

    @abc.abstractmethod
    def forward_logprobs(
        self, mb: MicroBatch, *, replay_routes: bool = True, with_entropy: bool = False, reference: bool = False
    ) -> ForwardOutput:
        """No-grad forward; CPU float32 ``[B, T]`` outputs, 0 at t = 0 and on padding. ``reference`` uses the frozen
        reference model (a backend without one raises ``ValueError``)."""

    @abc.abstractmethod
    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, replay_routes: bool = True,
                   with_entropy: bool = False) -> StepResult:  # fmt: skip
        """Forward + ``loss_fn`` + backward on each micro-batch, then one optimizer step (or a skipped one, above)."""

    @abc.abstractmethod
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current weights in Hugging Face names as contiguous CPU tensors (main rank; others yield nothing)."""

    def snapshot_source(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights in Hugging Face names where they live (GPU tensors allowed), for a snapshot that copies them
        at once (:mod:`async_rl.weights.snapshot`: pinned buffers, a side stream); valid until the next
        :meth:`train_step`. Default: :meth:`export_weights`."""
        return self.export_weights()

    def gpu_export(self, cfg: PublisherConfig) -> GpuExport | None:
        """Where the GPU weight path keeps this learner's versions (:mod:`async_rl.weights.gpu.publisher`): GPU slots
        filled from :meth:`snapshot_source` when that is on a CUDA GPU; None otherwise. A multi-rank backend returns
        its ranks' own slots (each rank its own pieces)."""
        device = self.publish_device
        return local_slots(device, cfg) if device.startswith("cuda") else None

    @property
    def publish_device(self) -> str:
        """Where :meth:`snapshot_source`'s tensors live ('cpu', 'cuda:N'): from a CUDA GPU, versions are also kept in
        GPU buffers that same-host generators copy over CUDA IPC (:mod:`async_rl.weights.gpu.publisher`)."""
        return "cpu"

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Save model and optimizer state under ``directory``: after :meth:`load`, training continues bit for bit."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Restore what :meth:`save` wrote."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources (process groups, GPU memory); on the main rank, also ends the followers' loops."""
