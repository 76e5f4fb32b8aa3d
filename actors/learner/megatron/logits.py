"""Per-token logprobs and entropy from (vocab-parallel) logits, and the CP all-gather of per-token values.

Imported only on GPU ranks for tensor parallelism (megatron-core is imported inside the TP branch);
the single-rank path is plain torch and tested on the CPU.
"""

from __future__ import annotations

import torch

from async_rl.logprobs import stats as logit_stats
from async_rl.model.token_mask import mask_logits


def batch_major_logits(output_layer: torch.nn.Module) -> None:
    """Have megatron's output layer compute its logits batch-major (``[b, s, V]``) and hand them on as an ``[s, b, V]``
    view, so that ``GPTModel``'s ``logits.transpose(0, 1).contiguous()`` copies nothing. Without this, that copy and
    the matching one of the gradient are strided passes over the largest tensor of the step (16k tokens x 151,936
    bf16 = 4.9 GB each way). The hidden states are transposed instead: ``h / V`` of the bytes. Only without sequence
    parallelism, whose gather runs along the sequence dimension inside the layer."""

    def to_batch_major(module, args, kwargs):  # type: ignore[no-untyped-def]
        return (args[0].transpose(0, 1).contiguous(), *args[1:]), kwargs

    def to_sequence_major(module, args, kwargs, output):  # type: ignore[no-untyped-def]
        logits, bias = output
        return logits.transpose(0, 1), bias

    output_layer.register_forward_pre_hook(to_batch_major, with_kwargs=True)
    output_layer.register_forward_hook(to_sequence_major, with_kwargs=True)


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


def token_stats(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool, tp_group, tp_size: int, *,  # type: ignore[no-untyped-def]
                temperature: float = 1.0, masked_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """log p(label) and (optionally) entropy per position from vocab-parallel logits ``[b, s, V/tp]``, fp32, after the
    sampling mask (``masked_ids``: global token ids) and the temperature. One rank: :func:`async_rl.logprobs.stats.
    token_stats` (fused Triton kernels on CUDA, no fp32 copy of the logits)."""
    if tp_size == 1:
        return logit_stats.token_stats(logits, labels, temperature=temperature, masked_ids=masked_ids,
                                       with_entropy=with_entropy)  # fmt: skip
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    if masked_ids is not None:  # this rank's vocab-parallel columns start at tp_rank * V / tp
        start = torch.distributed.get_rank(tp_group) * logits.shape[-1]
        logits = mask_logits(logits, masked_ids, start)
    if temperature != 1.0:
        logits = logits / temperature
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
