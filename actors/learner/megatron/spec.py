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
"""

from __future__ import annotations

import dataclasses

import torch

_LOCAL_NORMS = ("WrappedTorchNorm", "FusedLayerNorm")


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


def _swap(obj: object, seen: set[int], names: tuple[str, ...], new: type) -> None:
    if id(obj) in seen or not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    seen.add(id(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if getattr(value, "__name__", None) in names:
            setattr(obj, f.name, new)
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


def decoder_block_spec(tc, *, use_te: bool, pp_rank: int, attention: str = "sdpa"):  # type: ignore[no-untyped-def]
    """megatron-core's GPT decoder block spec for this stage; on the local spec: SP-capable norms, SDPA attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank)
    if not use_te and tc.sequence_parallel:
        _swap_norms(spec, set())
    if not use_te and attention == "sdpa":
        _swap(spec, set(), ("DotProductAttention",), sdpa_attention_class())
    return spec
