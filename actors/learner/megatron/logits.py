"""Per-token logprobs and entropy from (vocab-parallel) logits, and the CP all-gather of per-token values.

Imported only on GPU ranks for tensor parallelism (megatron-core is imported inside the TP branch);
the single-rank path is plain torch and tested on the CPU.
"""

from __future__ import annotations

import torch


class CPGather(torch.autograd.Function):
    """All-gather a ``[b, T_local]`` tensor over CP into ``[b, T]``; backward keeps this rank's positions only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, positions: torch.Tensor, seq_len: int, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
        world = torch.distributed.get_world_size(group)
        xs = [torch.empty_like(x) for _ in range(world)]
        ps = [torch.empty_like(positions) for _ in range(world)]
        torch.distributed.all_gather(xs, x.contiguous(), group=group)
        torch.distributed.all_gather(ps, positions.contiguous(), group=group)
        out = x.new_zeros(x.shape[0], seq_len)
        for xi, pi in zip(xs, ps, strict=True):
            out[:, pi] = xi
        ctx.save_for_backward(positions)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        (positions,) = ctx.saved_tensors
        return grad[:, positions], None, None, None


def token_stats(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool, tp_group, tp_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """log p(label) and (optionally) entropy per position from vocab-parallel logits ``[b, s, V/tp]`` (fp32)."""
    logits = logits.float()
    if tp_size == 1:
        # logsumexp + gather: no second [b, s, V] float tensor (the vocabulary is the largest dimension here).
        lse = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1) if with_entropy else None
        return lp, ent
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    lp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)
    ent = None
    if with_entropy:
        m = logits.detach().max(dim=-1).values
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        z = logits - m.unsqueeze(-1)
        se = reduce_from_tensor_model_parallel_region(z.exp().sum(-1))
        p = z.exp() / se.unsqueeze(-1)
        ent = se.log() - reduce_from_tensor_model_parallel_region((p * z).sum(-1))
    return lp, ent
