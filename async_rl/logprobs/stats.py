"""Per-token ``log p(target)`` and entropy from logits: one fused pass over the vocabulary on CUDA, plain torch elsewhere.

Both learner backends turn ``[tokens, vocab]`` logits into per-token logprobs (and entropies) in fp32. In plain
torch that is a string of full-size fp32 passes: the cast, the sampling mask, the temperature, ``logsumexp`` (max,
subtract, exp, sum), the gather, the entropy's softmax and product, and in backward as many again plus a scatter
into a zero tensor. At Qwen3's 151,936-token vocabulary an 8k-token micro-batch's fp32 logits are 5 GB, and those
passes took more GPU time than every matmul of the step together (``bench backends --profile`` on the
Qwen3-30B-A3B slice: 590 of 920 ms were element-wise and copy kernels).

:func:`token_stats` computes the same values with one Triton program per token: forward reads the logits once
(online log-sum-exp, the target's logit, and for the entropy the running ``sum p * z``), keeps only the per-token
log-sum-exp and entropy, and backward reads the logits once more and writes their gradient once, in the logits'
own dtype:

    z = mask(logits) / temperature        (fp32; masked columns = MASKED_LOGIT, as the generators sample)
    lp = z[target] - logsumexp(z)          H = logsumexp(z) - sum softmax(z) * z
    d/dz = g_lp * (onehot(target) - p) - g_H * p * (log p + H);   d/dlogits = d/dz / temperature, 0 where masked

The values are those of the torch path (:func:`reference_token_stats`, used on the CPU, for fp64 and where Triton is
missing) up to fp32 summation order; ``tests/unit/test_logit_stats.py`` runs the kernels in Triton's interpreter on
the CPU, ``tests/gpu/test_logit_stats_gpu.py`` on a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from async_rl.model.token_mask import MASKED_LOGIT

_BLOCK = 4096
"""Vocabulary columns a program handles per iteration (fewer for small vocabularies)."""


def reference_token_stats(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                          masked_ids: torch.Tensor | None = None, with_entropy: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """:func:`token_stats` in plain torch (fp32, fp64 for fp64 logits): the definition the fused kernels follow."""
    z = logits.double() if logits.dtype == torch.float64 else logits.float()
    if masked_ids is not None:
        z = z.index_fill(-1, masked_ids, MASKED_LOGIT)
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    return lp, ent


def token_stats(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                masked_ids: torch.Tensor | None = None, with_entropy: bool = False, fused: bool | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """fp32 ``log p(targets)`` of logits ``[..., V]`` (one or two leading dimensions, any strides with the vocabulary
    contiguous) under ``softmax(mask(logits) / temperature)``, and the entropy when asked; differentiable in
    ``logits``. ``masked_ids``: vocabulary columns set to :data:`~async_rl.model.token_mask.MASKED_LOGIT` first (the
    sampling mask). ``fused``: the Triton kernels (None: on CUDA when Triton imports and the logits are bf16, fp16
    or fp32). A target outside ``[0, V)`` gives a NaN logprob there (the plain torch path raises instead)."""
    if logits.dim() not in (2, 3) or targets.shape != logits.shape[:-1]:
        raise ValueError(f"need logits [N, V] or [B, T, V] and targets of the leading shape, got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")  # fmt: skip
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if masked_ids is not None:
        masked_ids = masked_ids.to(logits.device).long()
        masked_ids = masked_ids[(masked_ids >= 0) & (masked_ids < logits.shape[-1])]
        masked_ids = masked_ids if masked_ids.numel() else None
    if fused is None:
        fused = can_fuse(logits)
    if not fused:
        return reference_token_stats(logits, targets.long(), temperature=temperature, masked_ids=masked_ids,
                                     with_entropy=with_entropy)  # fmt: skip
    mask = vocab_mask(masked_ids, logits.shape[-1], logits.device)
    lp, ent = _FusedStats.apply(logits, targets, mask, float(temperature), bool(with_entropy))
    return lp, ent if with_entropy else None


def can_fuse(logits: torch.Tensor) -> bool:
    """Whether :func:`token_stats` takes the Triton kernels for these logits by default (CUDA, Triton, a float dtype
    other than fp64)."""
    return logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and _triton_ok()


def vocab_mask(masked_ids: torch.Tensor | None, vocab: int, device: torch.device) -> torch.Tensor | None:
    """uint8 ``[vocab]``, 1 at the masked columns, as the kernels take the sampling mask (None: nothing masked)."""
    if masked_ids is None:
        return None
    return torch.zeros(vocab, dtype=torch.uint8, device=device).index_fill_(0, masked_ids.to(device).long(), 1)


def fused_forward(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None, temperature: float,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The forward kernel on logits ``[N, V]`` or ``[B, T, V]``: flat fp32 ``(lp, lse, entropy)`` per row (entropy
    empty unless asked); no autograd."""
    fwd, _ = _kernels()
    x, rows, t, sb, st = _rows(logits)
    tgt = targets.reshape(-1).long().contiguous()
    v = x.shape[-1]
    lp = torch.empty(rows, dtype=torch.float32, device=x.device)
    lse = torch.empty_like(lp)
    ent = torch.empty(rows if with_entropy else 0, dtype=torch.float32, device=x.device)
    if rows:
        fwd[(rows,)](x, sb, st, t, tgt, mask if mask is not None else tgt, lp, lse, ent, v, temperature,
                     HAS_MASK=mask is not None, WITH_ENT=with_entropy, **_launch(v))  # fmt: skip
    return lp, lse, ent


def fused_backward(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None, lse: torch.Tensor,
                   ent: torch.Tensor | None, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None,
                   temperature: float) -> torch.Tensor:  # fmt: skip
    """The backward kernel: the gradient of ``sum(g_lp * lp + g_ent * entropy)`` with respect to ``logits``, as
    ``[rows, V]`` in the logits' dtype (``ent`` and ``g_ent`` None: no entropy term)."""
    _, bwd = _kernels()
    x, rows, t, sb, st = _rows(logits)
    tgt = targets.reshape(-1).long().contiguous()
    v = x.shape[-1]
    grad = torch.empty((rows, v), dtype=x.dtype, device=x.device)
    g_lp = lse.new_zeros(rows) if g_lp is None else g_lp.reshape(-1).float().contiguous()
    use_ent = ent is not None and g_ent is not None
    g_e = g_ent.reshape(-1).float().contiguous() if use_ent and g_ent is not None else g_lp
    if rows:
        bwd[(rows,)](x, sb, st, t, grad, tgt, mask if mask is not None else tgt, lse,
                     ent if use_ent and ent is not None else lse, g_lp, g_e, v, temperature,
                     HAS_MASK=mask is not None, WITH_ENT=use_ent, **_launch(v))  # fmt: skip
    return grad


def _launch(vocab: int) -> dict[str, int]:
    """Both kernels' block of columns and warps for this vocabulary."""
    block = min(_BLOCK, max(16, 1 << (vocab - 1).bit_length()))
    return {"BLOCK": block, "num_warps": 8 if block >= 2048 else 4}


@functools.cache
def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """``x`` ``[N, V]`` or ``[B, T, V]`` as (tensor with a contiguous last dimension, rows, T, stride_b, stride_t)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, x.shape[0], max(x.shape[0], 1), 0, x.stride(0)
    return x, x.shape[0] * x.shape[1], max(x.shape[1], 1), x.stride(0), x.stride(1)


class _FusedStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,  # type: ignore[no-untyped-def, override]
                temperature: float, with_entropy: bool):  # fmt: skip
        lp, lse, ent = fused_forward(logits, targets, mask, temperature, with_entropy)
        ctx.save_for_backward(logits, targets, mask, lse, ent)
        ctx.set_materialize_grads(False)  # an entropy only reported (detached) passes no gradient: no entropy term
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        out_shape = logits.shape[:-1]
        return lp.view(out_shape), (ent.view(out_shape) if with_entropy else ent)

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):  # type: ignore[no-untyped-def, override]
        logits, targets, mask, lse, ent = ctx.saved_tensors
        grad = fused_backward(logits, targets, mask, lse, ent if ctx.with_entropy else None, g_lp,
                              g_ent if ctx.with_entropy else None, ctx.temperature)  # fmt: skip
        return grad.view(logits.shape), None, None, None, None


def _kernels() -> tuple[Any, Any]:
    """The forward and backward Triton kernels (their module imports Triton: only where they run)."""
    from async_rl.logprobs import kernels as k

    return k.stats_fwd, k.stats_bwd
