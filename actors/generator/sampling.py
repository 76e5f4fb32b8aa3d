"""Sampling one token per row from logits, with the logprob under the exact distribution sampled from."""

from __future__ import annotations

import torch

from actors.generator.engine import SamplingParams
from async_rl.model.token_mask import mask_logits


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    masked_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sample one token per row of ``logits`` ``[B, V]``; return ``(tokens [B] int64, logprobs [B] float32)``.

    Order: the token mask (``masked_ids``, never sampled), temperature, top-k, top-p (as vLLM). The
    logprob is under the distribution actually sampled from (masked, tempered, truncated,
    renormalised); for greedy it is the untempered model logprob.
    """
    logits = mask_logits(logits.float(), masked_ids)
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= params.top_p  # the top token always has mass_before 0 and stays
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
