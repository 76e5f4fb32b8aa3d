"""Layer specs for the Megatron backend: Transformer Engine where installed, megatron-core's local modules elsewhere.

megatron-core trains MoE with TP > 1 only under sequence parallelism, and its local spec's norm
(``WrappedTorchNorm``, used when neither TE nor Apex is installed) refuses sequence parallelism. The
norm itself needs nothing special under SP: each TP rank normalises its own tokens, and the weight's
gradient must be summed over the TP group, which ``finalize_model_grads`` does for every parameter
flagged ``sequence_parallel`` (and, by name, for ``q_layernorm`` / ``k_layernorm``). :class:`TorchRMSNorm`
is that norm; :func:`decoder_block_spec` swaps it into the local spec when sequence parallelism is on.
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


def decoder_block_spec(tc, *, use_te: bool, pp_rank: int):  # type: ignore[no-untyped-def]
    """megatron-core's GPT decoder block spec for this stage, with SP-capable norms on the local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank)
    if not use_te and tc.sequence_parallel:
        _swap_norms(spec, set())
    return spec
