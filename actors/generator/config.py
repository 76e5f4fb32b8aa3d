"""Configuration of one ``async-rl generator`` process."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Literal

from actors.generator.torch_engine import TorchEngineConfig
from actors.generator.vllm_engine import VLLMEngineConfig
from actors.generator.weight_sync import WeightSyncConfig
from async_rl.control import ControlPlaneConfig
from async_rl.run_config import RunConfig
from async_rl.tasks.config import TaskConfig
from async_rl.transport import TransportConfig
from buffer.prompts import PromptQueueConfig
from buffer.rollouts import RolloutWriterConfig


@dataclass(kw_only=True, slots=True)
class GeneratorSamplingConfig:
    """Fallback sampling parameters: the learner sends its own with every prompt (metadata ``sampling``), which win."""

    temperature: float = 1.0
    """Softmax temperature (0: greedy). Behaviour logprobs are under the tempered distribution."""
    top_p: float = 1.0
    """Nucleus mass (1.0: off)."""
    top_k: int = 0
    """Top-k truncation (0: off)."""
    default_n: int = 8
    """Samples per prompt when a prompt does not say."""
    default_max_new_tokens: int = 0
    """Response budget when a prompt does not say (0: the task's own)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("generator.sampling.temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("generator.sampling.top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("generator.sampling.top_k must be >= 0")
        if self.default_n < 1:
            raise ValueError("generator.sampling.default_n must be >= 1")
        if self.default_max_new_tokens < 0:
            raise ValueError("generator.sampling.default_max_new_tokens must be >= 0")


def default_generator_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(kw_only=True, slots=True)
class GeneratorConfig:
    """One generator process: where the run is, which engine, how it samples and scores."""

    run: RunConfig = field(default_factory=RunConfig)
    """Prefix and server URLs of the run (shared with the learner)."""
    generator_id: str = ""
    """Unique id (consumer name in the prompt group, heartbeat id); '' = host-pid-random."""
    engine: Literal["torch", "vllm"] = "torch"
    """Inference engine."""
    torch: TorchEngineConfig = field(default_factory=TorchEngineConfig)
    """Settings of the torch engine."""
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    """Settings of the vLLM engine (docs/vllm.md)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """How responses are scored (must match the learner's task)."""
    sampling: GeneratorSamplingConfig = field(default_factory=GeneratorSamplingConfig)
    """Sampling knobs."""
    prompts: PromptQueueConfig = field(default_factory=PromptQueueConfig)
    """Prompt stream settings (reclaim timeout, poison-prompt limit)."""
    rollouts: RolloutWriterConfig = field(default_factory=RolloutWriterConfig)
    """Rollout stream settings (back-pressure)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the generator follows new weight versions."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Transport of weight bucket bytes (must match the learner's)."""
    control: ControlPlaneConfig = field(default_factory=ControlPlaneConfig)
    """NATS connection settings."""
    heartbeat_interval_s: float = 2.0
    """Seconds between heartbeats on NATS."""
    read_block_ms: int = 1000
    """How long one prompt read blocks when the stream is empty."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: time allowed to finish the batch in hand before its prompts are released to others."""
    max_prompts: int = 0
    """Stop after this many prompts (0: run until stopped). For tests and benchmarks."""

    def __post_init__(self) -> None:
        if not self.generator_id:
            self.generator_id = default_generator_id()
        if len(self.generator_id) > 200 or any(c.isspace() for c in self.generator_id):
            raise ValueError("generator.generator_id must be at most 200 characters without spaces")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("generator.heartbeat_interval_s must be > 0")
        if self.read_block_ms < 1:
            raise ValueError("generator.read_block_ms must be >= 1")
        if self.drain_timeout_s < 0:
            raise ValueError("generator.drain_timeout_s must be >= 0")
        if self.max_prompts < 0:
            raise ValueError("generator.max_prompts must be >= 0")
