"""Per-token logprobs (and entropy) from hidden states and the LM head, in chunks of tokens.

The full fp32 logits of a step, ``[tokens, vocab]``, dominate a learner's peak memory at real
vocabularies (8k tokens x 151,936 x 4 bytes = 5 GB, then the softmax and its gradient as much
again). :func:`chunked_token_logprobs` computes ``log p(target)`` and the entropy of the predictive
distribution ``chunk_tokens`` tokens at a time, and its backward recomputes each chunk's logits
rather than keeping them: the extra memory is one or two ``chunk_tokens x vocab`` fp32 buffers at a time
(two when an entropy gradient flows; plus the chunk's logits in the head's dtype while they are cast),
and an fp32 accumulator of the head's gradient when the head is in a low-precision dtype. The price is
the head's matmul once more per chunk in backward.

The logits of a chunk are treated exactly as the full-logits path treats them: the head's matmul in
its own dtype, cast to fp32, the sampling mask applied (:func:`async_rl.model.token_mask.mask_logits`: masked
columns get a constant, so no gradient), then divided by the sampling temperature. On CUDA each chunk's
logits (in the head's dtype) go through the fused kernels of :mod:`async_rl.logprobs.stats`, which do all of
that in one read and write the chunk's gradient in the head's dtype: no fp32 chunk buffer at all.
"""

from __future__ import annotations

import torch

from async_rl.logprobs.stats import can_fuse, fused_backward, fused_forward, vocab_mask
from async_rl.model.token_mask import MASKED_LOGIT


def _logits(h: torch.Tensor, weight: torch.Tensor, masked_ids: torch.Tensor | None, temperature: float
            ) -> torch.Tensor:  # fmt: skip
    """One chunk's fp32 (fp64 for fp64 inputs, for gradcheck) logits, masked and tempered in place: the values of
    the full-logits path (``mask_logits`` then ``/ temperature``) without their copies."""
    z = h @ weight.t()
    z = z if z.dtype == torch.float64 else z.float()
    if masked_ids is not None:
        z.index_fill_(-1, masked_ids, MASKED_LOGIT)
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[no-untyped-def, override]
                masked_ids: torch.Tensor | None, temperature: float, chunk: int, with_entropy: bool):  # fmt: skip
        n = hidden.shape[0]
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        lp = hidden.new_empty(n, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        ent = hidden.new_empty(n if with_entropy else 0, dtype=dtype)
        fused = can_fuse(hidden)
        mask = vocab_mask(masked_ids, weight.shape[0], hidden.device) if fused else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            if fused:  # the chunk's logits in the head's dtype, read once by the kernel
                lp[s:e], lse[s:e], ent_part = fused_forward(hidden[s:e] @ weight.t(), targets[s:e], mask,
                                                            temperature, with_entropy)  # fmt: skip
                if with_entropy:
                    ent[s:e] = ent_part
                continue
            z = _logits(hidden[s:e], weight, masked_ids, temperature)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            lp[s:e] = z.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1) - lse[s:e]
            if with_entropy:
                z.sub_(lse[s:e].unsqueeze(-1))  # log p
                ent[s:e] = z.exp().mul_(z).sum(-1).neg_()
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.set_materialize_grads(False)  # an entropy only reported (detached) passes no gradient: no entropy term
        ctx.masked_ids, ctx.mask, ctx.fused = masked_ids, mask, fused
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):  # type: ignore[no-untyped-def, override]
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc_dtype = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        if g_lp is None:
            g_lp = lse.new_zeros(n)
        use_ent = ctx.with_entropy and g_ent is not None
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            if ctx.fused:
                gz = fused_backward(hidden[s:e] @ weight.t(), targets[s:e], ctx.mask, lse[s:e],
                                    ent[s:e] if use_ent else None, g_lp[s:e],
                                    g_ent[s:e] if use_ent and g_ent is not None else None, ctx.temperature)  # fmt: skip
            else:
                gz = _chunk_grad(hidden[s:e], weight, targets[s:e], lse[s:e], ent[s:e] if use_ent else None, g_lp[s:e],
                                 g_ent[s:e] if use_ent and g_ent is not None else None, ctx.masked_ids,
                                 ctx.temperature)  # fmt: skip
            if grad_h is not None:
                grad_h[s:e] = gz @ weight
            if grad_w is not None:
                grad_w += (gz.t() @ hidden[s:e]).to(acc_dtype)
            del gz
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def _chunk_grad(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                ent: torch.Tensor | None, g_lp: torch.Tensor, g_ent: torch.Tensor | None,
                masked_ids: torch.Tensor | None, temperature: float) -> torch.Tensor:  # fmt: skip
    """One chunk's gradient with respect to its logits, in the head's dtype (plain torch: the CPU, fp64)."""
    logp = _logits(hidden, weight, masked_ids, temperature).sub_(lse.unsqueeze(-1))
    # d log p(y) / dz = onehot(y) - p;  d H / dz = -p * (log p + H)
    coef = g_lp.unsqueeze(-1)
    if ent is not None and g_ent is not None:
        p = logp.exp()
        coef = logp.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(coef)
    else:
        p = logp.exp_()  # one chunk x vocab buffer when no entropy gradient flows
    gz = p.mul_(coef).neg_()
    del logp, coef
    gz.scatter_add_(-1, targets.unsqueeze(-1), g_lp.unsqueeze(-1).to(gz.dtype))
    if temperature != 1.0:
        gz.div_(temperature)
    if masked_ids is not None:  # masked columns are constants: no gradient
        gz.index_fill_(-1, masked_ids, 0.0)
    return gz.to(weight.dtype)


def chunked_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int,
    temperature: float = 1.0, masked_ids: torch.Tensor | None = None, with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """fp32 (fp64 for fp64 inputs) ``log p(targets[i])`` under ``softmax((hidden[i] @ weight.T) / temperature)`` for hidden states
    ``[N, H]`` and an LM head ``[V, H]`` (bias-free), and the entropy of each distribution when asked;
    ``chunk_tokens`` tokens at a time, differentiable in ``hidden`` and ``weight`` (see the module docstring)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    ids = None
    if masked_ids is not None:
        ids = masked_ids.to(hidden.device).long()
        ids = ids[(ids >= 0) & (ids < weight.shape[0])]
        ids = ids if ids.numel() else None
    lp, ent = _ChunkedLogprobs.apply(hidden, weight, targets.long(), ids, float(temperature), int(chunk_tokens),
                                     with_entropy)  # fmt: skip
    return lp, ent if with_entropy else None
