"""Building the megatron-core model of :class:`~actors.learner.megatron.backend.MegatronBackend`: its
TransformerConfig from the Hugging Face config, the GPTModel of this rank's pipeline stage, DDP and the optimizer,
and loading global (HF-named) weights into this rank's slices."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from actors.learner.megatron.convert import hf_to_mcore, local_state, shard
from actors.learner.megatron.dispatcher import use_local_dispatchers
from actors.learner.megatron.grad_norm import use_device_grad_norm
from actors.learner.megatron.logits import batch_major_logits
from actors.learner.megatron.spec import STACKED_EXPERTS, decoder_block_spec
from actors.learner.megatron.weights import MegatronWeights


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class MegatronBuild(MegatronWeights):
    """The building half of the backend (mixed into :class:`~actors.learner.megatron.backend.MegatronBackend`,
    whose ``__init__`` sets these attributes and calls the builders in order)."""

    te_spec: bool
    dtype: torch.dtype
    device: torch.device
    pp_rank: int
    is_first: bool
    is_last: bool
    tc: Any
    """megatron-core's TransformerConfig (untyped here)."""

    def _transformer_config(self):  # type: ignore[no-untyped-def]
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        a, c = self.arch, self.cfg
        moe = dict(
            num_moe_experts=a.num_experts, moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_router_topk=a.top_k,
            moe_layer_freq=[1 if m else 0 for m in a.moe_layers], moe_router_pre_softmax=not a.norm_topk_prob,
            moe_router_load_balancing_type=c.moe_router_load_balancing_type, moe_aux_loss_coeff=c.moe_aux_loss_coeff,
            moe_router_score_function=c.moe_router_score_function, moe_router_fusion=c.moe_router_fusion,
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=self.te_spec,
            moe_enable_routing_replay=c.router_replay, moe_router_dtype=c.moe_router_dtype or None,
        ) if a.num_experts else {}  # fmt: skip
        if a.shared_expert_size:
            moe.update(moe_shared_expert_intermediate_size=a.shared_expert_size, moe_shared_expert_gate=True)
        recompute = (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            if c.recompute
            else {}
        )
        tc = TransformerConfig(
            num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_heads,
            num_query_groups=a.num_kv_heads, kv_channels=a.head_dim, ffn_hidden_size=a.ffn_hidden_size,
            normalization="RMSNorm", layernorm_epsilon=a.rms_eps, qk_layernorm=a.qk_norm, add_bias_linear=False,
            add_qkv_bias=a.qkv_bias, gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0,
            attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            tensor_model_parallel_size=c.tensor_parallel, pipeline_model_parallel_size=c.pipeline_parallel,
            expert_model_parallel_size=c.expert_parallel, expert_tensor_parallel_size=self.etp_size,
            context_parallel_size=c.context_parallel, sequence_parallel=c.sequence_parallel,
            num_layers_in_first_pipeline_stage=c.first_stage_layers, num_layers_in_last_pipeline_stage=c.last_stage_layers,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype, pipeline_dtype=self.dtype,
            variable_seq_lengths=c.pipeline_parallel > 1, calculate_per_token_loss=True,
            init_method_std=0.02, **recompute, **moe,
        )  # fmt: skip
        return tc

    def _build_model(self):  # type: ignore[no-untyped-def]
        from megatron.core.models.gpt import GPTModel

        spec = decoder_block_spec(self.tc, use_te=self.te_spec, pp_rank=self.pp_rank, attention=self.cfg.attention,
                                  experts=self.cfg.experts)  # fmt: skip
        model = GPTModel(
            config=self.tc, transformer_layer_spec=spec, vocab_size=self.arch.vocab_size,
            max_sequence_length=self.arch.max_position_embeddings, pre_process=self.is_first,
            post_process=self.is_last, share_embeddings_and_output_weights=self.arch.tie_embeddings,
            position_embedding_type="rope", rotary_base=int(self.arch.rope_theta), parallel_output=True,
        )  # fmt: skip
        if self.is_last and not self.cfg.sequence_parallel:
            batch_major_logits(model.output_layer)
        if not self.te_spec and self.cfg.experts == "grouped":  # counts on the device: our grouped experts take them
            use_local_dispatchers(model)  # where one rank holds every expert (dispatcher.py)
        return model.to(self.device)

    def _build_ddp_and_optimizer(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        def finalize(model, num_tokens=None, **kwargs):  # type: ignore[no-untyped-def]
            return finalize_model_grads(model, None, **kwargs)  # sum, never divide by tokens (see module doc)

        self.tc.finalize_model_grads_func = finalize
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=self.cfg.distributed_optimizer)  # fmt: skip
        self.ddp = DistributedDataParallel(config=self.tc, ddp_config=ddp_cfg, module=self.gpt)
        c = self.cfg
        oc = OptimizerConfig(optimizer="adam", lr=c.lr, min_lr=c.lr, weight_decay=c.weight_decay, adam_beta1=c.adam_beta1,
                             adam_beta2=c.adam_beta2, adam_eps=c.adam_eps, clip_grad=c.clip_grad,
                             bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                             use_distributed_optimizer=c.distributed_optimizer)  # fmt: skip
        self.optimizer = get_megatron_optimizer(oc, [self.ddp])
        use_device_grad_norm()  # the clipping norm without a host wait per gradient tensor (grad_norm.py)
        # Without TE or Apex megatron builds torch's AdamW with its default multi-tensor (foreach) kernels; the fused
        # one updates each group in one launch and is what TE's FusedAdam would be (the optimizer step of the Qwen3-30B-A3B
        # slice in `bench backends --profile`: 51 -> 20 ms).
        fuse = all(p.is_cuda and p.is_floating_point() for g in self.optimizer.param_groups for p in g["params"])
        for g in self.optimizer.param_groups:
            g["lr"] = c.lr
            g["weight_decay"] = c.weight_decay * g.get("wd_mult", 1.0)
            if fuse and "fused" in g and "foreach" in g:  # torch.optim.Adam(W) groups only
                g["fused"], g["foreach"] = True, False

    def _load_global(self, glob: Mapping[str, torch.Tensor]) -> None:
        """Copy a global megatron state dict into this rank's parameters (TP/EP/PP slices)."""
        local = local_state(glob, self.naming, self.arch, self.tp_rank, self.cfg.tensor_parallel,
                            self.etp_rank, self.etp_size)  # fmt: skip
        if self.arch.tie_embeddings and self.is_last and not self.is_first:
            local["output_layer.weight"] = shard("output_layer.weight", glob["embedding.word_embeddings.weight"],
                                                 self.tp_rank, self.cfg.tensor_parallel)  # fmt: skip
        params = dict(self.gpt.named_parameters())
        for name in params:
            if (m := STACKED_EXPERTS.match(name)) is not None:  # grouped experts: stack the per-expert tensors
                prefix, which = m.group(1), m.group(2)
                fc = "linear_fc1" if which == "1" else "linear_fc2"
                n = params[name].shape[0]
                local[name] = torch.stack([local.pop(f"{prefix}local_experts.{e}.{fc}.weight") for e in range(n)])
        missing = sorted(set(params) - set(local))
        unknown = sorted(set(local) - set(params))
        if missing or unknown:
            raise ValueError(
                f"weights do not match the model on this rank: missing {missing[:4]}, unknown {unknown[:4]}"
            )
        with torch.no_grad():
            for name, p in params.items():
                src = local[name]
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(p.shape)}")
                p.copy_(src.to(device=p.device, dtype=p.dtype))

    def load_hf_weights(self, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the model weights by HF-named weights (every rank passes the same dict) and reset fp32 masters."""
        self._load_global(hf_to_mcore(hf_state_dict, self.arch))
        self.optimizer.reload_model_params()
