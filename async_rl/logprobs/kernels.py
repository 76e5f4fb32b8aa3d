"""The Triton kernels of :mod:`async_rl.logprobs.stats` (one program per token; see that module for what they compute).

Imported only where they run (CUDA, or Triton's interpreter in the CPU tests): this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from async_rl.model.token_mask import MASKED_LOGIT

masked_logit = tl.constexpr(MASKED_LOGIT)



@triton.jit
def stats_fwd(x_ptr, stride_b, stride_t, T, tgt_ptr, mask_ptr, lp_ptr, lse_ptr, ent_ptr, V, temperature,  # type: ignore[no-untyped-def]
        HAS_MASK: tl.constexpr, WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    b = r // T
    base = x_ptr + b * stride_b + (r - b * T) * stride_t
    m = -float("inf")
    s = 0.0
    acc = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_MASK:
            z = tl.where(tl.load(mask_ptr + cols, mask=ok, other=0) != 0, masked_logit, z)
        z = z / temperature
        z = tl.where(ok, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        s = s * scale + tl.sum(e, 0)
        if WITH_ENT:
            acc = acc * scale + tl.sum(tl.where(ok, e * z, 0.0), 0)
        m = m_new
    lse = m + tl.log(s)
    tgt = tl.load(tgt_ptr + r)
    inside = (tgt >= 0) & (tgt < V)  # a target outside the vocabulary reads nothing and gives NaN, never other memory
    zt = tl.load(base + tgt, mask=inside, other=float("nan")).to(tl.float32)
    if HAS_MASK:
        zt = tl.where(tl.load(mask_ptr + tgt, mask=inside, other=0) != 0, masked_logit, zt)
    tl.store(lp_ptr + r, zt / temperature - lse)
    tl.store(lse_ptr + r, lse)
    if WITH_ENT:
        tl.store(ent_ptr + r, lse - acc / s)

@triton.jit
def stats_bwd(x_ptr, stride_b, stride_t, T, g_ptr, tgt_ptr, mask_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, V,  # type: ignore[no-untyped-def]
        temperature, HAS_MASK: tl.constexpr, WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    b = r // T
    base = x_ptr + b * stride_b + (r - b * T) * stride_t
    out = g_ptr + r * V
    lse = tl.load(lse_ptr + r)
    glp = tl.load(glp_ptr + r)
    tgt = tl.load(tgt_ptr + r)
    if WITH_ENT:
        h = tl.load(ent_ptr + r)
        ge = tl.load(gent_ptr + r)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_MASK:
            masked = tl.load(mask_ptr + cols, mask=ok, other=0) != 0
            z = tl.where(masked, masked_logit, z)
        logp = z / temperature - lse
        p = tl.exp(logp)
        dz = -p * glp
        if WITH_ENT:
            dz -= p * (logp + h) * ge
        dz = tl.where(cols == tgt, dz + glp, dz)
        if HAS_MASK:
            dz = tl.where(masked, 0.0, dz)
        tl.store(out + cols, (dz / temperature).to(g_ptr.dtype.element_ty), mask=ok)
