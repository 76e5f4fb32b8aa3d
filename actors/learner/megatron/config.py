"""Configuration of the Megatron learner backend (parallel layout, precision, optimizer, replay)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class MegatronConfig:
    """``[learner.megatron]``: how the Megatron backend lays the model over GPUs and trains it."""

    tensor_parallel: int = 1
    """Tensor-parallel size (TP)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (PP)."""
    expert_parallel: int = 1
    """Expert-parallel size (EP); experts are split over EP ranks, which also hold different data."""
    expert_tensor_parallel: int | None = None
    """Tensor-parallel size inside each expert (None: megatron's default, equal to TP)."""
    context_parallel: int = 1
    """Context-parallel size (CP); needs the Transformer Engine spec (the local attention has no CP)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (requires TP > 1; required by megatron for MoE with TP > 1 and EP > 1)."""
    first_stage_layers: int | None = None
    """Decoder layers on the first pipeline stage (uneven split), None for an even split."""
    last_stage_layers: int | None = None
    """Decoder layers on the last pipeline stage (uneven split), None for an even split."""
    spec: Literal["auto", "local", "te"] = "auto"
    """Layer implementation: Transformer Engine ("te"), megatron-core's own modules ("local"), or TE when installed."""
    attention: Literal["sdpa", "unfused"] = "sdpa"
    """Local spec only: PyTorch SDPA (flash / memory-efficient kernels) or megatron's unfused DotProductAttention."""
    experts: Literal["grouped", "sequential"] = "grouped"
    """Local spec only: stacked expert weights with grouped GEMMs, or megatron's SequentialMLP (one module per expert)."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter / activation dtype (fp32 master weights are kept by the optimizer either way)."""
    recompute: bool = True
    """Full activation recompute of every layer (router replay then drives the recompute too)."""
    router_replay: bool = True
    """Build routers with megatron-core's RouterReplay so recorded expert routes can be replayed (R3)."""
    moe_router_fusion: bool = False
    """Fused TE top-k router kernel; silently skips replay in megatron-core, so refused with router_replay."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function (HF Qwen/Mixtral routers are softmax)."""
    moe_router_load_balancing_type: Literal["none", "aux_loss", "sinkhorn", "seq_aux_loss"] = "none"
    """Router load balancing; sinkhorn ignores replay, so it is refused with router_replay."""
    moe_router_dtype: Literal["", "fp32", "fp64"] = ""
    """Router logits, top-k and the weighted sum of expert outputs in this dtype (megatron-core's
    ``moe_router_dtype``): 'fp32' keeps bf16 training's routing stable with many experts. '' = the model dtype."""
    moe_aux_loss_coeff: float = 0.0
    """Auxiliary load-balancing loss coefficient (0: off; RL fine-tuning usually keeps it off)."""
    lr: float = 1e-6
    """Adam learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0: off)."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: the fp32 master weights and Adam moments sharded over the data-parallel
    ranks (the dense layers' over every data-parallel rank, the experts' over the expert-data-parallel ones) instead
    of whole on each; gradients are reduce-scattered and the weights all-gathered after each step. Each rank's
    checkpoint file keeps its own shard (no gather): a run resumes on the layout that wrote it."""
    temperature: float = 1.0
    """Sampling temperature of the generators: logits are divided by it so logprobs match the behaviour ones."""
    masked_token_ids: tuple[int, ...] = ()
    """Token ids whose logits are masked before the softmax, as the generators mask them (set from
    ``sampling.mask_special_tokens`` and :func:`async_rl.model.token_mask.masked_token_ids` of the model)."""
    seed: int = 1234
    """Seed of megatron's model-parallel RNG tracker."""
    fused_experts_export: bool = True
    """Export experts in transformers' fused in-memory layout (gate_up_proj) rather than per-expert names."""
    distributed_timeout_minutes: int = 10
    """Timeout of torch.distributed collectives."""

    def __post_init__(self) -> None:
        p = "learner.megatron."
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "context_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{p}{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor_parallel is not None and self.expert_tensor_parallel < 1:
            raise ValueError(f"{p}expert_tensor_parallel must be >= 1, got {self.expert_tensor_parallel}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError(f"{p}sequence_parallel needs {p}tensor_parallel > 1")
        for name in ("first_stage_layers", "last_stage_layers"):
            v = getattr(self, name)
            if v is not None and (v < 0 or self.pipeline_parallel == 1):
                raise ValueError(f"{p}{name} must be >= 0 and needs {p}pipeline_parallel > 1, got {v}")
        if self.spec not in ("auto", "local", "te"):
            raise ValueError(f"{p}spec must be 'auto', 'local' or 'te', got {self.spec!r}")
        if self.attention not in ("sdpa", "unfused"):
            raise ValueError(f"{p}attention must be 'sdpa' or 'unfused', got {self.attention!r}")
        if self.experts not in ("grouped", "sequential"):
            raise ValueError(f"{p}experts must be 'grouped' or 'sequential', got {self.experts!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"{p}dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.router_replay and self.moe_router_fusion:
            raise ValueError(f"{p}moe_router_fusion=True skips router replay in megatron-core; turn one off")
        if self.router_replay and self.moe_router_load_balancing_type == "sinkhorn":
            raise ValueError(f"{p}moe_router_load_balancing_type='sinkhorn' ignores router replay; turn one off")
        if self.lr < 0 or self.weight_decay < 0 or self.clip_grad < 0 or self.moe_aux_loss_coeff < 0:
            raise ValueError(f"{p}lr, weight_decay, clip_grad and moe_aux_loss_coeff must be >= 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1) or self.adam_eps <= 0:
            raise ValueError(f"{p}adam_beta1/adam_beta2 must be in [0, 1) and adam_eps > 0")
        if not self.temperature > 0:
            raise ValueError(f"{p}temperature must be > 0, got {self.temperature}")
        if self.distributed_timeout_minutes < 1:
            raise ValueError(f"{p}distributed_timeout_minutes must be >= 1")

    @property
    def model_parallel_size(self) -> int:
        """GPUs one model replica spans (TP x PP x CP)."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks; raises ValueError when the layout does not fit."""
        mp = self.model_parallel_size
        if world_size % mp:
            raise ValueError(f"world size {world_size} is not a multiple of TP*PP*CP = {mp}")
        dp = world_size // mp
        etp = self.expert_tensor_parallel or self.tensor_parallel
        expert_mp = etp * self.expert_parallel * self.pipeline_parallel
        if world_size % expert_mp:
            raise ValueError(f"world size {world_size} is not a multiple of ETP*EP*PP = {expert_mp}")
        return dp
