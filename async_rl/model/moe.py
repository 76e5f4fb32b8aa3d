"""MoE facts of a model, read from its transformers config: the one owner of which layers are MoE layers,
how many experts, how many per token, and the integer type routes travel in.

Everyone who needs one of these facts (engines recording routes, the wire codec, the learner's
entry checks, Megatron's converter and route cutting, the benchmarks) asks this module instead of
reading the config's ``num_experts`` / ``decoder_sparse_step`` / ``mlp_only_layers`` /
``first_k_dense_replace`` keys again. Imports nothing heavy (numpy only), so configs and checks that
use it stay fast.

A layer ``i`` of ``num_hidden_layers`` is an MoE layer when the model has experts and
``i >= first_k_dense_replace`` (DeepSeek-style dense first layers), ``i not in mlp_only_layers``
(Qwen-MoE) and ``(i + 1) % decoder_sparse_step == 0`` (every k-th layer). Routes are
``[tokens, num_moe_layers, top_k]`` in :func:`route_dtype` ``(num_experts)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def route_dtype(num_experts: int) -> np.dtype:
    """Smallest integer dtype that holds expert ids ``< num_experts``: uint8 up to 256 experts, int16 up to 32,768,
    else int32 (routes are the largest per-token payload on the wire, so every byte counts)."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be > 0, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def route_dtype_for_max_id(max_id: int) -> np.dtype:
    """The route dtype for recorded expert ids whose largest value is ``max_id`` (when the expert count is unknown)."""
    return route_dtype(int(max_id) + 1)


@dataclass(frozen=True, slots=True)
class MoEFacts:
    """The MoE shape of a model (all zeros / empty for a dense model)."""

    num_layers: int
    """Decoder layers, dense and MoE."""
    moe_layer_ids: tuple[int, ...]
    """Indices among all decoder layers of the layers with a router, ascending."""
    num_experts: int
    """Routed experts per MoE layer (0: dense model)."""
    top_k: int
    """Experts chosen per token (0: dense model)."""

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def moe_mask(self) -> tuple[bool, ...]:
        """One flag per decoder layer: True where it is an MoE layer."""
        ids = set(self.moe_layer_ids)
        return tuple(i in ids for i in range(self.num_layers))

    @property
    def route_dtype(self) -> np.dtype:
        """The integer type routes of this model travel in (see :func:`route_dtype`)."""
        if not self.is_moe:
            raise ValueError("a dense model has no routes")
        return route_dtype(self.num_experts)


def _text_config(config: Any) -> Any:
    # Multimodal configs (Qwen3-VL-MoE, ...) keep the language model's keys under text_config.
    return getattr(config, "text_config", None) or config


def num_experts_of(config: Any) -> int:
    """Routed experts per MoE layer of a transformers config (0: dense). Knows Qwen/OLMoE, Mixtral, DeepSeek keys."""
    cfg = _text_config(config)
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(cfg, key, None)
        if value:
            return int(value)
    return 0


def moe_facts(config: Any) -> MoEFacts:
    """The :class:`MoEFacts` of a transformers config (a ``PretrainedConfig`` or anything with the same attributes)."""
    cfg = _text_config(config)
    num_layers = int(cfg.num_hidden_layers)
    experts = num_experts_of(cfg)
    if not experts:
        return MoEFacts(num_layers=num_layers, moe_layer_ids=(), num_experts=0, top_k=0)
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    mlp_only = {int(i) for i in (getattr(cfg, "mlp_only_layers", None) or [])}
    first_dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    ids = tuple(i for i in range(num_layers) if i >= first_dense and i not in mlp_only and (i + 1) % step == 0)
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    if ids and top_k < 1:
        raise ValueError(f"model config has {experts} experts but num_experts_per_tok={top_k}")
    return MoEFacts(num_layers=num_layers, moe_layer_ids=ids, num_experts=experts if ids else 0,
                    top_k=top_k if ids else 0)  # fmt: skip
