"""Configuration of the ``async-rl learner`` process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from actors.learner.evaluation import EvalConfig, eval_sources
from actors.learner.lr_schedule import LR_SCHEDULES, LrSchedule
from actors.learner.megatron.config import MegatronConfig
from actors.learner.samples_table import SamplesTableConfig
from async_rl.algorithms import AlgorithmConfig
from async_rl.metrics.prometheus import PrometheusConfig
from async_rl.metrics.scaling import ScalingConfig
from async_rl.metrics.sinks import MetricsConfig
from async_rl.model.config import DTYPE_NAMES, ModelConfig
from async_rl.run.config import RunConfig
from async_rl.run.lease import LeaseConfig
from async_rl.servers.control import ControlPlaneConfig
from async_rl.tasks.config import TaskConfig
from async_rl.weights.config import PublisherConfig
from async_rl.weights.transport import TransportConfig
from async_rl.wire.sampling import Sampling
from buffer.prompts import PromptQueueConfig
from buffer.rollouts import RolloutReaderConfig
from buffer.staleness import StalenessConfig

EXPORT_FORMATS = ("state_dict", "checkpoint")
"""Weight names of the torch backend's export: ``state_dict``, transformers' in-memory names (fused expert
tensors); ``checkpoint``, the names ``save_pretrained`` writes and vLLM loads (one tensor per expert)."""


@dataclass(kw_only=True, slots=True)
class BatchingConfig:
    """How the learner cuts a step batch into micro-batches."""

    micro_batch_tokens: int = 8192
    """Budget of padded tokens (sequences x longest length) per micro-batch."""
    max_micro_batch_sequences: int = 0
    """Cap on sequences per micro-batch (0: no cap)."""
    sort_by_length: bool = True
    """Pack sequences of similar length together (less padding); False keeps the given order."""

    def __post_init__(self) -> None:
        if self.micro_batch_tokens <= 0:
            raise ValueError(f"learner.batching.micro_batch_tokens must be > 0, got {self.micro_batch_tokens}")
        if self.max_micro_batch_sequences < 0:
            raise ValueError(
                f"learner.batching.max_micro_batch_sequences must be >= 0, got {self.max_micro_batch_sequences}"
            )


@dataclass(kw_only=True, slots=True)
class TorchBackendConfig:
    """Optimizer and placement of the torch backend."""

    lr: float = 1e-5
    """AdamW learning rate (the peak: the schedule below scales it)."""
    lr_schedule: LrSchedule = "constant"
    """After warm-up: ``constant`` keeps ``lr``; ``cosine`` / ``linear`` decay it to ``lr * lr_min_ratio`` over
    ``lr_decay_steps`` optimizer steps, then hold it there (``actors/learner/lr_schedule.py``)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from ``lr / lr_warmup_steps`` to ``lr`` (0: none)."""
    lr_decay_steps: int = 0
    """Optimizer steps of the cosine / linear decay after warm-up (> 0 with those schedules)."""
    lr_min_ratio: float = 0.0
    """The lr the decay ends at, as a fraction of ``lr`` (in [0, 1])."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping, the norm is still reported)."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32, bfloat16 or float16 (optimizer state follows the parameters)."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N``, or ``auto`` (the first GPU when there is one, else the CPU)."""
    seed: int = 0
    """Torch RNG seed set when the backend is built."""
    temperature: float = 1.0
    """Sampling temperature of the generators: logits are divided by it so logprobs match the behaviour ones."""
    masked_token_ids: tuple[int, ...] = ()
    """Token ids whose logits are masked before the softmax, as the generators mask them (set from
    ``sampling.mask_special_tokens`` and :func:`async_rl.model.token_mask.masked_token_ids` of the model)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (routes are replayed in the recompute too)."""
    logprob_chunk_tokens: int = 4096
    """Logprobs (and entropy) from the last hidden states and the LM head this many tokens at a time, never
    the full fp32 logits ``[tokens, vocab]`` (``async_rl/logprobs/chunked.py``); padding gets no logits at all.
    0: the model's full logits. Models whose logits are more than a bias-free linear head of the last hidden
    states (a logit scale or soft-cap) always take the full logits. On CUDA both go through the fused kernels of
    ``async_rl/logprobs/stats.py``; there the chunks cost the head's matmul once more in backward (on the Qwen3-30B-A3B
    slice with 8k-token micro-batches: 809 against 710 ms a step, at the same peak memory) and bound the memory of
    larger micro-batches (the full logits and their gradient take 4 bytes x tokens x vocabulary in bf16)."""
    export_format: str = "state_dict"
    """Weight names of :meth:`TorchBackend.export_weights`: ``state_dict`` or ``checkpoint``."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"learner.torch.lr must be > 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"learner.torch.lr_schedule must be one of {list(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"learner.torch.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay_steps < 0:
            raise ValueError(f"learner.torch.lr_decay_steps must be >= 0, got {self.lr_decay_steps}")
        if self.lr_schedule != "constant" and self.lr_decay_steps == 0:
            raise ValueError(f"learner.torch.lr_decay_steps must be > 0 with lr_schedule={self.lr_schedule!r}")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"learner.torch.lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"learner.torch.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"learner.torch.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"learner.torch.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"learner.torch.grad_clip must be >= 0, got {self.grad_clip}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"learner.torch.dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"learner.torch.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not self.temperature > 0:
            raise ValueError(f"learner.torch.temperature must be > 0, got {self.temperature}")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"learner.torch.logprob_chunk_tokens must be >= 0, got {self.logprob_chunk_tokens}")
        if self.export_format not in EXPORT_FORMATS:
            raise ValueError(f"learner.torch.export_format must be one of {list(EXPORT_FORMATS)}")



@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When and where the learner checkpoints (acks of consumed rollouts wait for the checkpoint)."""

    every: int = 1
    """Checkpoint every this many steps; rollout entries are acked when the checkpoint covering them is written."""
    keep: int = 2
    """Checkpoints kept on disk."""
    resume: bool = True
    """Resume from the newest checkpoint under <run_dir>/checkpoints when there is one."""
    on_lost_state: Literal["refuse", "rebuild"] = "refuse"
    """When the run's Redis state is missing or older than the checkpoint (its server lost it): ``refuse`` exits 1
    with one line saying so; ``rebuild`` goes on from the checkpoint (its version published again, prompts issued
    from its data position; the prompts in flight at the loss are lost, and the run's state records it for
    ``async-rl audit``). A learner on embedded servers of its own always rebuilds (they keep nothing)."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError("learner.checkpoint.every must be >= 1")
        if self.on_lost_state not in ("refuse", "rebuild"):
            raise ValueError(f"learner.checkpoint.on_lost_state must be refuse or rebuild, got {self.on_lost_state!r}")
        if self.keep < 1:
            raise ValueError("learner.checkpoint.keep must be >= 1")


@dataclass(kw_only=True, slots=True)
class LearnerConfig:
    """The learner: model and backend, data and its admission, the algorithm, publishing, checkpoints, metrics."""

    run: RunConfig = field(default_factory=RunConfig)
    """Prefix, server URLs and run directory."""
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    """One learner per run: the run's lease (its time-to-live) and what a second learner does (refuse, or stand by)."""
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
    sampling: Sampling = field(default_factory=Sampling)
    """Sampling parameters carried in every prompt record (generators sample with exactly these)."""
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
    samples_table: SamplesTableConfig = field(default_factory=SamplesTableConfig)
    """A few trained samples as text every ``every_steps`` steps: samples.jsonl and a wandb table."""
    entropy_metric: bool = True
    """Report the policy's mean per-token entropy over the trained tokens every step (``loss/entropy_mean``), from
    the logits the loss reads: in the same pass on CUDA (the fused kernels) and with no gradient unless
    ``algorithm.loss.entropy_coef`` > 0. False saves its pass over the logits where they are not fused (the CPU,
    Megatron with tensor parallelism)."""
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    """Prometheus /metrics endpoint (off while prometheus.port is 0)."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    """Thresholds of the scaling signal the learner publishes for autoscalers (async_rl/metrics/scaling.py)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and resume."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation on the task's held-out prompts every ``eval.interval_versions`` versions (actors/learner/evaluation.py)."""
    publish_every: int = 1
    """Publish weights every this many steps."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run until stopped)."""
    target_reward: float = 0.0
    """Stop once the mean of ``target_metric`` over the last target_window steps reaches this (0: off)."""
    target_metric: str = "reward"
    """What target_reward is compared with: ``reward`` (the mean reward of a step's samples) or a reward
    component ``reward/<name>`` the task reports (the toy tasks: ``reward/exact``, the exact-match rate, and
    ``reward/length_ok``). A component the task does not report stops the learner at its first step."""
    target_window: int = 5
    """Steps averaged for target_reward."""
    read_block_ms: int = 500
    """How long one rollout read blocks when the stream is empty."""
    starved_log_interval_s: float = 30.0
    """While the learner waits for rollouts, say so this often (what it has, what it waits for, who is alive)."""
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
        if self.target_metric != "reward" and not (self.target_metric.startswith("reward/") and self.target_metric[7:]):
            raise ValueError(f"learner.target_metric must be 'reward' or 'reward/<component>', got {self.target_metric!r}")
        if self.read_block_ms < 1:
            raise ValueError("learner.read_block_ms must be >= 1")
        if not self.starved_log_interval_s > 0:
            raise ValueError("learner.starved_log_interval_s must be > 0")
        if not 0 <= self.admission_lag_versions <= self.staleness.max_staleness:
            raise ValueError("learner.admission_lag_versions must be in [0, staleness.max_staleness]")
        if self.eval.interval_versions or self.eval.sources:
            eval_sources(self.eval, self.task)  # every source evaluated is the task's and has a held-out split
        if self.algorithm.advantage.estimator in ("grpo", "rloo") and self.sampling.n < 2:
            raise ValueError(f"learner.sampling.n must be >= 2 for the {self.algorithm.advantage.estimator} "
                             "estimator (a group of one has zero advantage)")  # fmt: skip
