"""Reducing per-token losses to this micro-batch's share of the step loss (step-global denominators).

Summing :func:`reduce_loss` over every micro-batch of a step (all data-parallel ranks) gives the
step loss, because the denominators are the step's: ``step_num_tokens`` response tokens and
``step_num_sequences`` sequences (see ``actors/learner/backend.py``). Modes, with K the kept tokens
(loss mask minus correction masks) and M the loss mask:

* ``token_mean``: Σ_K ℓ / N_tokens (every token weighs the same; long answers weigh more);
* ``seq_mean_token_mean``: Σ_seq (Σ_K ℓ / |M_seq|) / N_seqs (every sequence weighs the same);
* ``seq_mean_token_sum``: Σ_K ℓ / N_seqs;
* ``token_sum_norm``: Σ_K ℓ / (N_seqs · max_tokens) (Dr. GRPO: a constant, length-unbiased normaliser).

``renormalize`` decides whether tokens removed by a correction mask leave the denominator. False
(default, as SkyRL): they stay, so masking shrinks the step. True: they leave it, so the survivors
carry the full step. The mask depends on π_θ, known only inside the micro-batch, so renormalisation
is done per micro-batch and scaled by the micro-batch's share of the step (its M tokens / N_tokens,
or its sequences / N_seqs): exact when masks remove the same fraction everywhere, and always summing
to the same total weight as the unmasked step. Per-sequence token means renormalise exactly
(|K_seq| instead of |M_seq|).
"""

from __future__ import annotations

import torch

from async_rl.algorithms.config import REDUCTIONS


def reduce_loss(
    per_token: torch.Tensor,
    keep: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    mode: str,
    step_num_tokens: int,
    step_num_sequences: int,
    renormalize: bool = False,
    max_tokens: int = 0,
) -> torch.Tensor:
    """This micro-batch's share of the step loss from ``per_token`` ``[B, T]`` losses (see module doc)."""
    if mode not in REDUCTIONS:
        raise ValueError(f"algorithm.loss.reduction must be one of {list(REDUCTIONS)}, got {mode!r}")
    if step_num_tokens < 0 or step_num_sequences < 0:
        raise ValueError(
            f"MicroBatch.step_num_tokens / step_num_sequences must be >= 0, got {step_num_tokens} / {step_num_sequences}"
        )
    if per_token.shape != keep.shape or keep.shape != loss_mask.shape:
        raise ValueError(
            f"per_token {tuple(per_token.shape)}, keep {tuple(keep.shape)} and loss_mask {tuple(loss_mask.shape)} "
            "must have the same [B, T] shape"
        )
    mask = loss_mask.bool()
    keep = keep.bool() & mask
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    kept_loss = torch.where(keep, per_token, zero)
    n_tok = float(max(step_num_tokens, 1))
    n_seq = float(max(step_num_sequences, 1))
    dtype = per_token.dtype

    if mode == "token_mean":
        total = kept_loss.sum()
        if not renormalize:
            return total / n_tok
        share = mask.sum().to(dtype) / n_tok
        return total / keep.sum().clamp(min=1).to(dtype) * share
    if mode == "token_sum_norm":
        if max_tokens <= 0:
            raise ValueError("algorithm.loss.max_tokens must be > 0 with algorithm.loss.reduction='token_sum_norm'")
        return kept_loss.sum() / (n_seq * float(max_tokens))

    seq_sum = kept_loss.sum(dim=-1)
    if mode == "seq_mean_token_mean":
        denom = (keep if renormalize else mask).sum(dim=-1).clamp(min=1).to(dtype)
        seq_val = seq_sum / denom
    else:  # seq_mean_token_sum
        seq_val = seq_sum
    if not renormalize:
        return seq_val.sum() / n_seq
    share = mask.any(dim=-1).sum().to(dtype) / n_seq
    return seq_val.sum() / keep.any(dim=-1).sum().clamp(min=1).to(dtype) * share
