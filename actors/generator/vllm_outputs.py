"""A finished vLLM request as the engine's :class:`~actors.generator.engine.Completion`: the sampled tokens, the
logprob of each under the distribution it was sampled from, its per-token weight versions and its routes."""

from __future__ import annotations

from typing import Any

import numpy as np

from actors.generator.engine import Completion
from actors.generator.model_facts import ModelFacts
from actors.generator.vllm_compat import Span
from async_rl.model.moe import route_dtype


def completion(output: Any, spans: list[Span], version: int, native_routes: ModelFacts | None, rid: str) -> Completion:
    """``output`` (vLLM's ``CompletionOutput``) with ``spans`` of weight-version labels (``version``: the fallback);
    with ``native_routes``, vLLM's routed experts cut to that model's MoE layers (``[T_run, moe_layers, top_k]``)."""
    tokens = np.asarray(output.token_ids, dtype=np.int32)
    routes = None
    if native_routes is not None and output.routed_experts is not None:
        raw = np.asarray(output.routed_experts)[:, list(native_routes.moe_layer_ids)]
        routes = raw.astype(np.uint8 if native_routes.num_experts <= 256 else np.int16)
    reason = output.finish_reason if output.finish_reason in ("stop", "length") else "abort"
    return Completion(token_ids=tokens, logprobs=sampled_logprobs(output.logprobs, tokens, rid),
                      versions=version_array(spans, tokens.size, version), finish_reason=reason, routes=routes)  # fmt: skip


def version_array(spans: list[Span], num_tokens: int, fallback: int) -> np.ndarray:
    """Per-token versions from a request's label spans (labels are our integer versions)."""
    out = np.full(num_tokens, fallback, dtype=np.int32)
    for label, start, end in spans:
        try:
            v = int(label)
        except ValueError:
            v = fallback
        out[start:end] = v
    return out


def sampled_logprobs(flat: Any, tokens: np.ndarray, rid: str) -> np.ndarray:
    """The sampled token's logprob at each position (``logprobs=0``: one entry per position)."""
    if tokens.size == 0:
        return np.zeros(0, dtype=np.float32)
    if flat is None or len(flat.start_indices) != tokens.size:
        raise RuntimeError(f"vLLM returned no per-token logprobs for request {rid}")
    starts = np.asarray(flat.start_indices)
    got = np.asarray(flat.token_ids)[starts]
    if not np.array_equal(got, tokens):
        raise RuntimeError(f"vLLM logprobs of request {rid} are not those of its sampled tokens")
    return np.asarray(flat.logprobs, dtype=np.float32)[starts]


def trim_routes(routes: np.ndarray | None, facts: ModelFacts, prompt_len: int, num_tokens: int) -> np.ndarray:
    """At most ``prompt + response - 1`` positions of a sample's routes (the last sampled token is never run); none
    (empty, of the model's route dtype) when the sample has none."""
    if routes is None:
        return np.zeros((0, len(facts.moe_layer_ids), facts.top_k), dtype=route_dtype(facts.num_experts))
    return routes[: max(prompt_len + num_tokens - 1, 0)]
