"""Layer specs for the Megatron backend: Transformer Engine where installed, megatron-core's local modules elsewhere.

megatron-core trains MoE with TP > 1 only under sequence parallelism, and its local spec's norm
(``WrappedTorchNorm``, used when neither TE nor Apex is installed) refuses sequence parallelism. The
norm itself needs nothing special under SP: each TP rank normalises its own tokens, and the weight's
gradient must be summed over the TP group, which ``finalize_model_grads`` does for every parameter
flagged ``sequence_parallel`` (and, by name, for ``q_layernorm`` / ``k_layernorm``). :class:`TorchRMSNorm`
is that norm; :func:`decoder_block_spec` swaps it into the local spec when sequence parallelism is on.

The local spec's ``DotProductAttention`` materialises the ``[b*heads, s, s]`` score matrix (baddbmm, masked
softmax, bmm). With ``attention="sdpa"`` the local spec uses a subclass that calls PyTorch's
``scaled_dot_product_attention`` (flash / memory-efficient kernels, causal, GQA without repeating K/V)
for the plain causal self-attention case and falls back to the parent for anything else (masks,
biases, packed sequences, softmax offsets, dropout, query-key layer scaling).

The local spec's ``SequentialMLP`` runs each expert as its own ``MLP`` module (two GEMMs, activation,
scaling: a dozen small kernels and Python calls per expert per layer, forward and backward), which made
the GPU idle most of a training step. With ``experts="grouped"`` the local spec uses
:func:`grouped_experts_class`: all local experts' weights in two stacked parameters
(``weight1 [E_local, 2*ffn/etp, h]`` = per expert ``[gate; up]`` as in ``linear_fc1``, ``weight2
[E_local, h, ffn/etp]`` as in ``linear_fc2``) and one grouped GEMM per projection (PyTorch
``grouped_mm``, bf16; a per-expert loop for other dtypes). Routing weights are applied to the
activation before ``fc2``, exactly where megatron's ``MLP`` applies them. Under expert parallelism megatron's
dispatcher hands the experts their token counts on the host (it waited for them before its all-to-all); they go
back to the GPU for the grouped GEMM's offsets through pinned memory (:func:`device_counts`): a plain copy from
pageable memory waits for the GPU to drain, one more host wait a layer and micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

_LOCAL_NORMS = ("WrappedTorchNorm", "FusedLayerNorm")

STACKED_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)weight([12])$")
"""A stacked weight of :func:`grouped_experts_class` by its (local) parameter name: groups (prefix, 1 or 2)."""


class TorchRMSNorm(torch.nn.Module):
    """RMSNorm (``torch.rms_norm``) whose weight is flagged for megatron's sequence-parallel gradient all-reduce."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"TorchRMSNorm only implements RMSNorm, config asks {config.normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def device_counts(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The experts' token counts as int32 on ``device``, without a host wait: counts on the host (megatron's
    dispatcher under expert parallelism) are copied from pinned memory, asynchronously; counts on a device stay."""
    if tokens_per_expert.device.type == "cpu" and device.type == "cuda":
        return tokens_per_expert.to(torch.int32).pin_memory().to(device, non_blocking=True)
    return tokens_per_expert.to(device=device, dtype=torch.int32)


def sdpa_attention_class():  # type: ignore[no-untyped-def]
    """megatron-core's DotProductAttention with a PyTorch SDPA fast path (built lazily: imports megatron)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPADotProductAttention(DotProductAttention):
        """Causal self-attention through ``torch.nn.functional.scaled_dot_product_attention``."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,  # type: ignore[no-untyped-def]
                    packed_seq_params=None):  # fmt: skip
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            plain = (
                attention_mask is None and attention_bias is None and packed_seq_params is None
                and mask_type == AttnMaskType.causal and self.softmax_offset is None
                and not self.config.apply_query_key_layer_scaling and query.shape[0] == key.shape[0]
                and not (self.training and self.config.attention_dropout > 0)
            )  # fmt: skip
            if not plain:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)  # fmt: skip
            sq, b, heads, hd = query.shape
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hd]
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != heads
            )
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hd)

    return SDPADotProductAttention


def grouped_experts_class():  # type: ignore[no-untyped-def]
    """A megatron experts module with stacked weights and grouped GEMMs (built lazily: imports megatron)."""
    import math

    from megatron.core.transformer.module import MegatronModule

    try:
        from torch.nn.functional import grouped_mm
    except ImportError:  # older torch
        grouped_mm = torch._grouped_mm

    class GroupedExperts(MegatronModule):
        """Local experts of one MoE layer as two stacked weights; forward = two grouped GEMMs."""

        def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,  # type: ignore[no-untyped-def]
                     name: str | None = None) -> None:  # fmt: skip
            super().__init__(config=config)
            etp = pg_collection.expt_tp.size() if pg_collection is not None else 1
            if config.moe_ffn_hidden_size % etp:
                raise ValueError(f"moe_ffn_hidden_size {config.moe_ffn_hidden_size} does not split over ETP={etp}")
            if not config.gated_linear_unit or config.add_bias_linear:
                raise ValueError("GroupedExperts implements gated (SwiGLU-style) experts without biases only")
            n, h, f = num_local_experts, config.hidden_size, config.moe_ffn_hidden_size // etp
            self.num_local_experts = n
            dev = torch.cuda.current_device()
            self.weight1 = torch.nn.Parameter(torch.empty(n, 2 * f, h, dtype=config.params_dtype, device=dev))
            self.weight2 = torch.nn.Parameter(torch.empty(n, h, f, dtype=config.params_dtype, device=dev))
            std = getattr(config, "init_method_std", 0.02)
            with torch.no_grad():
                self.weight1.normal_(0.0, std)
                self.weight2.normal_(0.0, std / math.sqrt(2.0 * config.num_layers))
            expert_pgs = config.expert_model_parallel_size > 1 or (
                config.expert_tensor_parallel_size != config.tensor_model_parallel_size
            )
            for w, dim in ((self.weight1, 1), (self.weight2, 2)):
                setattr(w, "tensor_model_parallel", True)  # noqa: B010 - a unique shard per ETP rank, never a TP duplicate
                setattr(w, "partition_dim", dim)  # noqa: B010
                setattr(w, "partition_stride", 1)  # noqa: B010
                setattr(w, "allreduce", not expert_pgs)  # noqa: B010 - expert-DP gradient reduction, like megatron's

        def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):  # type: ignore[no-untyped-def]
            counts = device_counts(tokens_per_expert, hidden.device)
            if hidden.dtype == torch.bfloat16:
                offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
                inter = grouped_mm(hidden, self.weight1.transpose(1, 2), offs=offs)
            else:  # grouped_mm is bf16-only: one GEMM per expert
                sizes = tokens_per_expert.tolist()
                inter = torch.cat([x @ w.t() for x, w in zip(hidden.split(sizes), self.weight1, strict=True)])
            gate, up = torch.chunk(inter, 2, dim=-1)
            act = self.config.activation_func(gate) * up
            act = (act * probs.unsqueeze(-1)).to(act.dtype)
            if hidden.dtype == torch.bfloat16:
                out = grouped_mm(act, self.weight2.transpose(1, 2), offs=offs)
            else:
                out = torch.cat([x @ w.t() for x, w in zip(act.split(sizes), self.weight2, strict=True)])
            return out, None

        def backward_dw(self) -> None:  # megatron calls this for delayed weight-gradient schedules
            return None

    return GroupedExperts


def _swap(obj: object, seen: set[int], names: tuple[str, ...], new: type) -> None:
    if id(obj) in seen or not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    seen.add(id(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if getattr(value, "__name__", None) in names:
            setattr(obj, f.name, new)
        elif isinstance(value, functools.partial) and getattr(value.func, "__name__", None) in names:
            setattr(obj, f.name, functools.partial(new, *value.args, **value.keywords))
        elif isinstance(value, functools.partial):
            for v in (*value.args, *value.keywords.values()):
                _swap(v, seen, names, new)
        elif isinstance(value, list | tuple):
            for v in value:
                _swap(v, seen, names, new)
        else:
            _swap(value, seen, names, new)


def _swap_norms(obj: object, seen: set[int]) -> None:
    if id(obj) in seen or not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    seen.add(id(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if getattr(value, "__name__", None) in _LOCAL_NORMS:
            setattr(obj, f.name, TorchRMSNorm)
        elif isinstance(value, list | tuple):
            for v in value:
                _swap_norms(v, seen)
        else:
            _swap_norms(value, seen)


def decoder_block_spec(tc, *, use_te: bool, pp_rank: int, attention: str = "sdpa", experts: str = "grouped"):  # type: ignore[no-untyped-def]
    """megatron-core's GPT decoder block spec for this stage; on the local spec: SP-capable norms, SDPA attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank)
    if not use_te and tc.sequence_parallel:
        _swap_norms(spec, set())
    if not use_te and attention == "sdpa":
        _swap(spec, set(), ("DotProductAttention",), sdpa_attention_class())
    if not use_te and experts == "grouped":
        _swap(spec, set(), ("SequentialMLP",), grouped_experts_class())
    return spec
