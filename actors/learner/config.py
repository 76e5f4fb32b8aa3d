"""Configuration of the ``async-rl learner`` process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from actors.learner.batching import BatchingConfig
from actors.learner.megatron.config import MegatronConfig
from actors.learner.torch_backend import TorchBackendConfig
from async_rl.algorithms import AlgorithmConfig
from async_rl.control import ControlPlaneConfig
from async_rl.metrics import MetricsConfig
from async_rl.models import ModelConfig
from async_rl.run_config import RunConfig
from async_rl.tasks.config import TaskConfig
from async_rl.transport import TransportConfig
from async_rl.weights import PublisherConfig
from buffer.prompts import PromptQueueConfig
from buffer.rollouts import RolloutReaderConfig
from buffer.staleness import StalenessConfig


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """How generators sample; sent with every prompt so that every generator of the run uses the same."""

    n: int = 8
    """Samples per prompt (the group size of the advantages)."""
    max_new_tokens: int = 0
    """Response budget (0: the task's own)."""
    temperature: float = 1.0
    """Softmax temperature; the learner divides its logits by the same value so logprobs match."""
    top_p: float = 1.0
    """Nucleus mass (1.0: off). With top_p/top_k < off, behaviour logprobs are of the truncated distribution."""
    top_k: int = 0
    """Top-k truncation (0: off)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("learner.sampling.n must be >= 1")
        if self.max_new_tokens < 0:
            raise ValueError("learner.sampling.max_new_tokens must be >= 0")
        if not self.temperature > 0:
            raise ValueError("learner.sampling.temperature must be > 0 (greedy rollouts have no policy gradient)")
        if not 0 < self.top_p <= 1:
            raise ValueError("learner.sampling.top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("learner.sampling.top_k must be >= 0")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When and where the learner checkpoints (acks of consumed rollouts wait for the checkpoint)."""

    every: int = 1
    """Checkpoint every this many steps; rollout entries are acked when the checkpoint covering them is written."""
    keep: int = 2
    """Checkpoints kept on disk."""
    resume: bool = True
    """Resume from the newest checkpoint under <run_dir>/checkpoints when there is one."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError("learner.checkpoint.every must be >= 1")
        if self.keep < 1:
            raise ValueError("learner.checkpoint.keep must be >= 1")


@dataclass(kw_only=True, slots=True)
class LearnerConfig:
    """The learner: model and backend, data and its admission, the algorithm, publishing, checkpoints, metrics."""

    run: RunConfig = field(default_factory=RunConfig)
    """Prefix, server URLs and run directory."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model preset or local HF directory (the generators must run the same architecture)."""
    backend: Literal["torch", "megatron"] = "torch"
    """Training backend."""
    torch: TorchBackendConfig = field(default_factory=TorchBackendConfig)
    """Settings of the torch backend (its temperature is taken from sampling.temperature)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Settings of the Megatron backend (launch under torchrun)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, policy loss, corrections."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Which prompts to issue (generators score with the same task)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters sent with every prompt."""
    batch_groups: int = 32
    """B: prompt groups per optimizer step."""
    replay_routes: bool = True
    """R3: replay the generators' MoE routes in the learner's forward passes."""
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    """Staleness bound S and what happens to groups over it; admission keeps (S+1)·B prompts in flight."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """Micro-batching by token budget."""
    prompts: PromptQueueConfig = field(default_factory=PromptQueueConfig)
    """Prompt stream settings."""
    rollouts: RolloutReaderConfig = field(default_factory=RolloutReaderConfig)
    """Rollout stream settings."""
    publisher: PublisherConfig = field(default_factory=PublisherConfig)
    """Weight bucket size, versions kept, checksum."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Transport of weight bucket bytes."""
    control: ControlPlaneConfig = field(default_factory=ControlPlaneConfig)
    """NATS connection settings."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """wandb and JSONL metrics."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and resume."""
    publish_every: int = 1
    """Publish weights every this many steps."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run until stopped)."""
    target_reward: float = 0.0
    """Stop once the mean reward over the last target_window steps reaches this (0: off)."""
    target_window: int = 5
    """Steps averaged for target_reward."""
    read_block_ms: int = 500
    """How long one rollout read blocks when the stream is empty."""
    admission_lag_versions: int = 1
    """Versions of slack for weight propagation: admission keeps (S + 1 - lag)·B prompts in flight, because a
    generator may still sample with the previous version when it takes a prompt. With lag 0 ((S+1)·B, the
    textbook bound) the quickstart dropped 8% of its groups as over S; see docs/learner.md."""

    def __post_init__(self) -> None:
        if self.batch_groups < 1:
            raise ValueError("learner.batch_groups must be >= 1")
        if self.publish_every < 1:
            raise ValueError("learner.publish_every must be >= 1")
        if self.max_steps < 0:
            raise ValueError("learner.max_steps must be >= 0")
        if self.target_reward < 0:
            raise ValueError("learner.target_reward must be >= 0")
        if self.target_window < 1:
            raise ValueError("learner.target_window must be >= 1")
        if self.read_block_ms < 1:
            raise ValueError("learner.read_block_ms must be >= 1")
        if self.backend == "megatron" and self.algorithm.needs_reference_logprobs:
            raise ValueError("learner.algorithm.loss.kl_coef > 0 needs a reference model, which the megatron backend "
                             "does not have yet; use backend=torch or kl_coef=0")  # fmt: skip
        if not 0 <= self.admission_lag_versions <= self.staleness.max_staleness:
            raise ValueError("learner.admission_lag_versions must be in [0, staleness.max_staleness]")
        if self.algorithm.advantage.estimator in ("grpo", "rloo") and self.sampling.n < 2:
            raise ValueError(f"learner.sampling.n must be >= 2 for the {self.algorithm.advantage.estimator} "
                             "estimator (a group of one has zero advantage)")  # fmt: skip
