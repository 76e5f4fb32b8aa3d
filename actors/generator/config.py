"""Configuration of one ``async-rl generator`` process."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from actors.generator.episodes import EpisodeConfig
from async_rl.metrics.prometheus import PrometheusConfig
from async_rl.model.config import ModelConfig
from async_rl.run.config import RunConfig
from async_rl.servers.control import ControlPlaneConfig
from async_rl.tasks.config import TaskConfig
from async_rl.weights.config import ReaderConfig
from async_rl.weights.transport import TransportConfig
from async_rl.wire.sampling import Sampling
from buffer.prompts import PromptQueueConfig
from buffer.rollout_writer import RolloutWriterConfig


@dataclass(kw_only=True, slots=True)
class TorchEngineConfig:
    """The torch engine: which model, where, how big a batch."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model preset or local HF directory, init seed and dtype."""
    device: str = "cpu"
    """torch device: 'cpu', 'cuda' or 'cuda:N'."""
    max_batch_prompts: int = 64
    """Prompts the generator should hand over in one generate call (its in-flight bound)."""
    max_batch_sequences: int = 512
    """Rows (prompts x n) decoded together; larger calls run in consecutive chunks."""
    seed: int = 0
    """Seed of the engine's own sampling stream (used when SamplingParams.seed is None)."""
    stop_on_eos: bool = True
    """Also stop on the model's eos token(s), as vLLM does by default."""
    num_threads: int = 1
    """torch intra-op threads (process-wide; 0: leave torch's default). One by default: on a shared CPU
    (learner and generators on 2 cores) two spinning OpenMP threads per process made a decode batch
    16x slower (6.5 s against 0.4 s at load 8), while one thread loses little on the toy models."""
    load_threads: int = 2
    """Threads copying a fetched version into the standby model on the CPU (each copy releases the GIL; the
    standby is loaded while generation goes on). On the 2-core machine 1 GB took 0.08 s on two threads, 0.10 s
    on one. A CUDA device copies on one side stream."""

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"engine.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.max_batch_prompts < 1:
            raise ValueError("engine.max_batch_prompts must be >= 1")
        if self.max_batch_sequences < 1:
            raise ValueError("engine.max_batch_sequences must be >= 1")
        if self.num_threads < 0:
            raise ValueError("engine.num_threads must be >= 0")
        if self.load_threads < 1:
            raise ValueError("engine.load_threads must be >= 1")


@dataclass(kw_only=True, slots=True)
class VLLMEngineConfig:
    """The vLLM engine: which model, how big a batch, how routes are captured."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model preset (written to a directory for vLLM) or local HF directory, init seed and dtype."""
    max_batch_prompts: int = 64
    """Prompts the generator should hand over in one generate call (its in-flight bound)."""
    max_num_seqs: int = 256
    """Sequences vLLM schedules together."""
    max_model_len: int = 0
    """Longest prompt + response (0: the model's max_position_embeddings)."""
    kv_cache_mib: int = 0
    """KV cache size in MiB (0: GPU: from gpu_memory_utilization; CPU: 1024)."""
    gpu_memory_utilization: float = 0.85
    """Share of GPU memory vLLM may use (weights, activations, KV cache)."""
    enforce_eager: bool | None = None
    """Run without CUDA graphs / torch.compile (None: eager on CPU, graphs on GPU). Route hooks need eager."""
    routes: Literal["auto", "native", "hooks", "off"] = "auto"
    """MoE route capture: vLLM's own output (native, CUDA), worker hooks (hooks, eager), none (off); auto picks."""
    enable_prefix_caching: bool | None = None
    """Prefix caching (None: on unless routes are captured by hooks, which cannot see cached positions)."""
    stop_on_eos: bool = True
    """Also stop on the model's eos token(s) (vLLM's default)."""
    seed: int = 0
    """vLLM's global seed (samples without SamplingParams.seed use vLLM's own stream)."""
    tensor_parallel_size: int = 1
    """Tensor-parallel GPUs per engine."""
    work_dir: str = ""
    """Where a preset is written as a HF directory, once, and kept for the next start and every other generator
    given the same directory ('' = a temporary directory of this generator's, removed on close)."""
    version_labels: Literal["auto", "engine", "front"] = "auto"
    """Who labels each token with its weight version: vLLM itself (engine, 0.27+), the engine's own process (front,
    any vLLM; see actors/generator/vllm_compat.py), or auto (engine where vLLM has it)."""
    swap_load: Literal["auto", "reload"] = "auto"
    """How a new version is loaded in place while generation is paused: auto replays vLLM's own loaders as batched
    copies where that is proven exact at start (CUDA, unquantized; actors/generator/vllm_load_plan.py), else
    vLLM's layerwise reload; reload always takes the layerwise reload (slower: seconds for a 1.6B MoE)."""
    swap: Literal["pause", "core", "boundary"] = "boundary"
    """How a staged version goes into use (actors/generator/vllm_swap.py): boundary asks the engine core once and
    nothing pauses: the load is queued on the GPU between two steps and the scheduler labels each step; core asks
    once, and the engine core pauses, loads and resumes at its next idle point; pause asks vLLM's engine core to
    pause, the workers to load it and the core to resume (three round trips from the generator's process). boundary
    and core need the project's scheduler (engine_args' scheduler_cls left as it is); a scheduler of your own needs
    pause."""
    follow: Literal["front", "core"] = "front"
    """Who follows the learner's weight versions: front, the generator's process (its event loop, beside vLLM's front
    end), or core, a thread of vLLM's engine core process, which loads each version at its next step by itself
    (actors/generator/vllm_follow.py; one GPU an engine, vllm.swap='boundary')."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Further vLLM ``AsyncEngineArgs`` fields, passed through (names are checked)."""

    def __post_init__(self) -> None:
        if self.max_batch_prompts < 1:
            raise ValueError("engine.max_batch_prompts must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("engine.max_num_seqs must be >= 1")
        if self.max_model_len < 0:
            raise ValueError("engine.max_model_len must be >= 0")
        if self.kv_cache_mib < 0:
            raise ValueError("engine.kv_cache_mib must be >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("engine.gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError("engine.tensor_parallel_size must be >= 1")
        if self.routes not in ("auto", "native", "hooks", "off"):
            raise ValueError(f"engine.routes must be auto, native, hooks or off, got {self.routes!r}")
        if self.version_labels not in ("auto", "engine", "front"):
            raise ValueError(f"vllm.version_labels must be auto, engine or front, got {self.version_labels!r}")
        if self.swap_load not in ("auto", "reload"):
            raise ValueError(f"vllm.swap_load must be auto or reload, got {self.swap_load!r}")
        if self.swap not in ("pause", "core", "boundary"):
            raise ValueError(f"vllm.swap must be pause, core or boundary, got {self.swap!r}")
        if self.follow not in ("front", "core"):
            raise ValueError(f"vllm.follow must be front or core, got {self.follow!r}")
        if self.follow == "core" and (self.tensor_parallel_size != 1 or self.swap != "boundary"):
            raise ValueError("vllm.follow='core' needs vllm.tensor_parallel_size=1 and vllm.swap='boundary' (the "
                             f"engine core's one worker loads each version at a step boundary), got "
                             f"{self.tensor_parallel_size} and {self.swap!r}")  # fmt: skip
        if self.swap != "pause" and "scheduler_cls" in self.engine_args:
            raise ValueError(f"vllm.swap={self.swap!r} needs the project's scheduler (actors/generator/vllm_swap.py): "
                             "leave vllm.engine_args.scheduler_cls unset, or take vllm.swap='pause'")  # fmt: skip


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How a generator follows the learner's weight versions."""

    poll_interval_s: float = 2.0
    """Fallback poll of the latest-version key (NATS announcements normally arrive first)."""
    wait_log_interval_s: float = 10.0
    """While waiting for the first version: log "still waiting for weights of <prefix> at <url>" this often."""
    first_version_timeout_s: float = 600.0
    """How long start() waits for the learner's first version; 0 starts on the engine's own weights."""
    apply_timeout_s: float = 120.0
    """How long start() waits for the engine to apply the first version."""
    max_backoff_s: float = 10.0
    """Cap of the backoff between retries after a transient fetch error."""
    max_retries: int = 8
    """Transient failures on one version before it is given up (a newer version is still taken)."""
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    """Lease and prefetch settings of the reader."""
    gpu: bool = True
    """A CUDA torch engine on the learner's host takes the versions the learner keeps in GPU memory over CUDA IPC
    (a GPU-to-GPU copy, milliseconds), falling back to the host transport where it cannot map them."""
    fresh_wait_s: float = 0.05
    """A batch about to start while a newer version is announced and on its way waits up to this long for it (once
    per version): the batch then runs on the newest weights, and the swap needs no decode step boundary. Same-host
    GPU versions arrive in tens of milliseconds; a slower one is not waited for twice. 0: never wait."""
    stream: bool = True
    """Hand a full version to an engine that takes one in parts (the torch engine) bucket by bucket as each is
    verified, so that its copy overlaps the fetch; false: whole versions only."""

    def __post_init__(self) -> None:
        if self.poll_interval_s <= 0:
            raise ValueError("generator.weight_sync.poll_interval_s must be > 0")
        if self.wait_log_interval_s <= 0:
            raise ValueError("generator.weight_sync.wait_log_interval_s must be > 0")
        if self.first_version_timeout_s < 0:
            raise ValueError("generator.weight_sync.first_version_timeout_s must be >= 0")
        if self.apply_timeout_s <= 0:
            raise ValueError("generator.weight_sync.apply_timeout_s must be > 0")
        if self.max_backoff_s <= 0:
            raise ValueError("generator.weight_sync.max_backoff_s must be > 0")
        if self.max_retries < 1:
            raise ValueError("generator.weight_sync.max_retries must be >= 1")
        if self.fresh_wait_s < 0:
            raise ValueError("generator.weight_sync.fresh_wait_s must be >= 0")


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
    sampling: Sampling = field(default_factory=Sampling)
    """Sampling of prompts that carry none (the learner's prompts always carry its own)."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Limits of episodes of several turns (environment tasks such as tool_copy; docs/environments.md)."""
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
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    """Prometheus /metrics endpoint (off while prometheus.port is 0)."""
    heartbeat_interval_s: float = 2.0
    """Seconds between heartbeats on NATS."""
    read_block_ms: int = 1000
    """How long one prompt read blocks when the stream is empty."""
    batches_in_flight: int = 0
    """Batches of up to the engine's ``max_batch_prompts`` generating at once (0: the engine's default, 2 for vLLM,
    whose continuous batching takes the next batch in while the last one's longest samples finish, 1 for the torch
    engine; :mod:`actors.generator.work`)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: time allowed to finish the batches in hand before their prompts are released to others."""
    max_prompts: int = 0
    """Stop after this many prompts (0: run until stopped). For tests and benchmarks."""
    max_failed_groups: int = 8
    """Exit 1, naming ``task.reward`` (``task.env`` for environments), once every sample of this many groups in a
    row failed to score: the reward is broken, not one odd input. Each group whose reward or environment raised is
    dead-lettered with the error either way and the generator goes on (0: never exit for it)."""
    on_run_end: Literal["exit", "wait"] = "exit"
    """When the learner announces the end of the run (max_steps or target_reward reached): ``exit`` drains the
    batch in hand and exits 0 (a batch job ends by itself); ``wait`` keeps the generator waiting for a successor
    learner of the same run prefix."""

    def __post_init__(self) -> None:
        if not self.generator_id:
            self.generator_id = default_generator_id()
        if len(self.generator_id) > 200 or any(c.isspace() for c in self.generator_id):
            raise ValueError("generator.generator_id must be at most 200 characters without spaces")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("generator.heartbeat_interval_s must be > 0")
        if self.read_block_ms < 1:
            raise ValueError("generator.read_block_ms must be >= 1")
        if self.batches_in_flight < 0:
            raise ValueError("generator.batches_in_flight must be >= 0 (0: the engine's default)")
        if self.drain_timeout_s < 0:
            raise ValueError("generator.drain_timeout_s must be >= 0")
        if self.max_prompts < 0:
            raise ValueError("generator.max_prompts must be >= 0")
        if self.max_failed_groups < 0:
            raise ValueError("generator.max_failed_groups must be >= 0")
        if self.on_run_end not in ("exit", "wait"):
            raise ValueError(f"generator.on_run_end must be exit or wait, got {self.on_run_end!r}")
