"""The inference-engine interface every generator engine implements (torch, vLLM).

An engine turns a batch of prompts into ``n`` completions each, with the behaviour
logprob and weight version of every sampled token and, for MoE models, the experts each
MoE layer routed every token the engine ran through the model to. New weights are staged
with :meth:`Engine.stage_weights` at any time (from another thread or task) and swapped in
between engine steps, so a sequence that spans a swap keeps generating and its per-token
versions say which tokens came from which version. An engine may also take a version tensor by tensor while
its buckets are still arriving (:meth:`Engine.open_stage`), so that copying one bucket overlaps fetching the next.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from async_rl.weights.gpu.reader import RemoteCopy


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample one batch."""

    n: int = 1
    """Samples per prompt."""
    max_new_tokens: int = 32
    """Upper bound on generated tokens per sample."""
    temperature: float = 1.0
    """Softmax temperature; logprobs are reported under the tempered distribution. 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off); logprobs are under the truncated, renormalised distribution."""
    top_k: int = 0
    """Top-k truncation (0 = off)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a sample (kept in the response, finish_reason 'stop')."""
    seed: int | None = None
    """Seed for reproducible sampling (None: engine's own stream)."""
    mask_special_tokens: bool = True
    """Never sample the engine model's masked token ids (:func:`async_rl.model.token_mask.masked_token_ids`)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("sampling.n must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError("sampling.max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("sampling.temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("sampling.top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("sampling.top_k must be >= 0")


@dataclass(slots=True)
class Completion:
    """One sampled response (see :mod:`async_rl.wire.types` for the alignment conventions)."""

    token_ids: np.ndarray
    """int32 ``[R]``."""
    logprobs: np.ndarray
    """float32 ``[R]``: logprob of each sampled token under the distribution it was sampled from."""
    versions: np.ndarray
    """int32 ``[R]``: weight version that produced each token."""
    finish_reason: str
    """'stop' | 'length' | 'abort'."""
    routes: np.ndarray | None = None
    """uint8/int16 ``[T_run, moe_layers, top_k]`` for the prompt+response tokens the engine ran, or None."""


class Engine(abc.ABC):
    """An inference engine. Implementations: ``TorchEngine``, ``VLLMEngine``."""

    name: str = "engine"
    last_swap_pause_s: float = 0.0
    """Time generation stood still for the last weight swap (engines set it when they swap)."""

    def take_swap_pauses(self) -> list[float]:
        """Seconds generation stood still at each swap since the last call (engines that keep them)."""
        return []

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Weight version currently in use (-1 before any weights were loaded from the learner)."""

    @property
    @abc.abstractmethod
    def max_batch_prompts(self) -> int:
        """How many prompts the engine can usefully batch at once (the generator's in-flight bound)."""

    @abc.abstractmethod
    async def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order."""

    async def generate_each(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                            on_done: Callable[[int, list[Completion]], None]) -> None:  # fmt: skip
        """:meth:`generate`, handing each prompt's ``params.n`` completions to ``on_done(index, completions)`` as soon
        as they are all done, in the order they finish; returns once every prompt's were handed over. Engines that
        batch continuously (vLLM) finish prompts at different times: a generator pushes each group then, instead of
        holding the batch's first groups until its longest sample ends. Here (the torch engine: one batch at a
        time) all of them at the end, in prompt order."""
        for i, completions in enumerate(await self.generate(prompts, params)):
            on_done(i, completions)

    @abc.abstractmethod
    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Hand over a complete, verified weight version (Hugging Face names).

        Thread-safe and non-blocking: the engine applies it between engine steps (a decode step
        for the torch engine, with generation paused only for the copy). A newer staged
        version replaces an older one that was not applied yet.
        """

    def open_stage(self, version: int, layout: Mapping[str, torch.Tensor]) -> StagingStream | None:
        """Start staging ``version`` before its bytes are all here. ``layout`` holds every name with its shape
        and dtype (meta tensors) and is checked now (ValueError); the tensors follow through the returned stream,
        each once its bucket was verified. None: this engine takes whole versions only (:meth:`stage_weights`)."""
        return None

    async def ready(self) -> None:  # noqa: B027 - optional hook
        """Finish the set-up an engine does on first use (before a GPU copy takes its short lease)."""

    def gpu_copier(self) -> RemoteCopy | None:
        """How a same-host GPU version reaches this engine when it copies it itself (a vLLM worker maps the
        learner's buffers): a :data:`~async_rl.weights.gpu.reader.RemoteCopy` for ``GpuReader.fetch``, after which
        :meth:`stage_copied` hands the verified version over. None: the generator's process copies GPU versions
        into tensors for :meth:`stage_weights` (or there is no GPU path)."""
        return None

    def stage_copied(self, version: int) -> None:
        """Swap in ``version``, already copied by :meth:`gpu_copier`'s copy and verified (engines that have one)."""
        raise NotImplementedError(f"{type(self).__name__} copies no GPU version itself")

    def take_swaps(self) -> list[tuple[int, float]]:
        """(version, unix time) of every swap since the last call, for snapshot-to-applied figures (engines that
        track them; others: none)."""
        return []

    def take_swap_timings(self) -> list[tuple[float, float]]:
        """(seconds copying into the standby, seconds waiting from loaded to swapped) of every swap since the last
        call (engines with a standby; others: none)."""
        return []

    @abc.abstractmethod
    async def wait_applied(self, version: int, timeout_s: float | None = None) -> bool:
        """Wait until ``version`` (or newer) is in use; True if it is, False on timeout."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""


class StagingStream(abc.ABC):
    """A version handed to the engine in parts (:meth:`Engine.open_stage`); thread-safe."""

    @abc.abstractmethod
    def put(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Some of the version's tensors, verified; the engine keeps references until it copied them."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Every tensor was put: the version is staged as :meth:`Engine.stage_weights` would have staged it."""

    @abc.abstractmethod
    def abort(self) -> None:
        """The version will not complete (a bucket failed, the fetch was cancelled): nothing of it is used."""
