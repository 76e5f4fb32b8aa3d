"""The model and step shapes of ``bench backends``: presets, RL-like sequence lengths, padding and model FLOPs.

Pure functions (no GPU), so the numbers the benchmark reports are unit-tested on the CPU:

* :data:`SHAPE_PRESETS`: named model and step shapes, e.g. ``qwen3-30b-a3b-slice``: the layers of
  Qwen3-30B-A3B (hidden 2048, 128 experts top-8 of FFN 768, 32 query / 4 KV heads of 128, vocabulary
  151,936, every layer MoE), cut to a few layers so that the model and its AdamW state fit one H100.
* :func:`sequence_lengths`: the variable lengths of an RL step (seeded draws from a distribution).
* :func:`padding_frac`: the share of a step's token slots (micro-batch rows x longest row) that are padding.
* :func:`model_flops_per_token`: the model FLOPs both backends are measured by (one formula for both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "lognormal")
"""``fixed``: every sequence ``max_len`` long; ``uniform``: integers drawn uniformly in ``[min_len, max_len]``;
``lognormal``: ``exp(N(mu, sigma))`` with ``mu`` the log of the geometric mean of ``min_len`` and ``max_len`` and
``sigma`` a quarter of their log ratio (so +-2 sigma spans the range), clipped to it: many mid-length
sequences and a tail of long ones, as RL responses come."""

SHAPE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b-slice": dict(
        layers=2, hidden=2048, experts=128, top_k=8, moe_ffn=768, heads=32, kv_heads=4, head_dim=128, vocab=151936,
        dense_first=False, lengths="lognormal", min_seq=2048, seq=8192, sequences=16, micro_batch_tokens=8192,
    ),
}  # fmt: skip
"""Preset name -> ``bench backends`` option values (flag names with ``_``); flags given on the command line win.
``qwen3-30b-a3b-slice`` at 2 layers holds 1.87B parameters (the embedding and LM head alone 0.62B); ``--layers 4``
3.1B, which fits the torch backend (bf16 weights, gradients and AdamW state: 8 bytes a parameter) but is tight for
Megatron's fp32 main weights and optimizer state."""


def sequence_lengths(n: int, *, distribution: str, min_len: int, max_len: int, seed: int = 0) -> list[int]:
    """``n`` sequence lengths in ``[min_len, max_len]`` drawn from ``distribution`` (see :data:`LENGTH_DISTRIBUTIONS`),
    the same for the same seed."""
    if distribution not in LENGTH_DISTRIBUTIONS:
        raise ValueError(f"--lengths must be one of {', '.join(LENGTH_DISTRIBUTIONS)}, got {distribution!r}")
    if n <= 0 or not 0 < min_len <= max_len:
        raise ValueError(f"need n > 0 and 0 < min_len <= max_len, got n={n}, min_len={min_len}, max_len={max_len}")
    if distribution == "fixed":
        return [max_len] * n
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        return [int(x) for x in rng.integers(min_len, max_len + 1, size=n)]
    lo, hi = math.log(min_len), math.log(max_len)
    draws = np.exp(rng.normal((lo + hi) / 2, (hi - lo) / 4, size=n))
    return [int(x) for x in np.clip(np.rint(draws), min_len, max_len)]


def padded_slots(groups: Sequence[Sequence[int]], multiple: int = 1) -> int:
    """Token slots the micro-batches of these lengths occupy: rows x the longest row, rounded up to ``multiple``."""
    return sum(len(g) * (-(-max(g) // multiple) * multiple) for g in groups if g)


def padding_frac(groups: Sequence[Sequence[int]], multiple: int = 1) -> float:
    """The share of the step's token slots that are padding (right-padded micro-batches of these lengths)."""
    slots = padded_slots(groups, multiple)
    return 1.0 - sum(sum(g) for g in groups) / slots if slots else 0.0


def model_flops_per_token(cfg, seq_len: int | Sequence[int]) -> float:  # type: ignore[no-untyped-def]
    """Model (not hardware) FLOPs per trained real token for a Qwen3-MoE-style config (forward + backward).

    ``6 * (matmul parameters a token touches: attention, router, top-k experts or the dense MLP, LM head)``
    plus causal attention, ``6 * layers * n * heads * head_dim`` for a token of a sequence of ``n`` tokens (the
    mean context of a causal sequence is ``n / 2``; scores and values are 2 matmuls, 3 passes). ``seq_len`` is one
    length for all sequences or the step's per-sequence lengths (then the attention term is the token-weighted
    mean, ``sum n^2 / sum n``: long sequences cost more per token). Padding is no model FLOP.
    """
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    mlp_only = set(cfg.mlp_only_layers or [])
    n = 0
    for i in range(cfg.num_hidden_layers):
        n += h * q + 2 * h * kv + q * h
        if i in mlp_only or cfg.num_experts == 0:
            n += 3 * h * cfg.intermediate_size
        else:
            n += h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    n += h * cfg.vocab_size
    if isinstance(seq_len, int):
        context = float(seq_len)
    else:
        lengths = [int(x) for x in seq_len]
        if not lengths or min(lengths) <= 0:
            raise ValueError(f"seq_len must be positive lengths, got {seq_len!r}")
        context = sum(x * x for x in lengths) / sum(lengths)
    return 6.0 * n + 6 * cfg.num_hidden_layers * context * q
