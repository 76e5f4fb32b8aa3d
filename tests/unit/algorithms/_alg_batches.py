"""Helpers for the algorithm tests: micro-batches built from explicit tensors (no model needed)."""

from __future__ import annotations

import torch

from async_rl.algorithms.batch import MicroBatch


def micro_batch(
    mask: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    *,
    step_num_tokens: int | None = None,
    step_num_sequences: int | None = None,
    proximal: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
) -> MicroBatch:
    b, t = mask.shape
    return MicroBatch(
        input_ids=torch.ones(b, t, dtype=torch.long),
        attention_mask=torch.ones(b, t, dtype=torch.bool),
        loss_mask=mask,
        behaviour_logprobs=behaviour,
        advantages=advantages,
        token_versions=versions if versions is not None else torch.zeros(b, t, dtype=torch.long),
        routes=[None] * b,
        step_num_tokens=int(mask.sum()) if step_num_tokens is None else step_num_tokens,
        step_num_sequences=b if step_num_sequences is None else step_num_sequences,
        proximal_logprobs=proximal,
        reference_logprobs=reference,
    )


def rows(mb: MicroBatch, lo: int, hi: int) -> MicroBatch:
    """Rows ``lo:hi`` of ``mb`` as a micro-batch that keeps the step-global denominators."""

    def cut(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[lo:hi]

    return MicroBatch(
        input_ids=mb.input_ids[lo:hi], attention_mask=mb.attention_mask[lo:hi], loss_mask=mb.loss_mask[lo:hi],
        behaviour_logprobs=mb.behaviour_logprobs[lo:hi], advantages=mb.advantages[lo:hi],
        token_versions=mb.token_versions[lo:hi], routes=mb.routes[lo:hi], step_num_tokens=mb.step_num_tokens,
        step_num_sequences=mb.step_num_sequences, proximal_logprobs=cut(mb.proximal_logprobs),
        reference_logprobs=cut(mb.reference_logprobs),
    )  # fmt: skip
