"""Chunked logprobs at Qwen3's vocabulary on one CUDA GPU: the full-logits values and gradients at a fraction of the
peak memory (skipped without a GPU). Prints the peaks: ``-s`` shows them."""

from __future__ import annotations

import pytest
import torch

from async_rl.logprobs.chunked import chunked_token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N, H, V = 8192, 2048, 151936
"""An 8k-token micro-batch of the Qwen3-30B-A3B slice (``bench backends --preset qwen3-30b-a3b-slice``)."""


def _plain(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The torch backend's full-logits path (bf16 head, fp32 logits, sampling mask, temperature, log-softmax)."""
    z = (h @ w.t()).float().index_fill(-1, ids, -1.0e9) / 0.9
    return z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, -1)


def _run(fn, h: torch.Tensor, w: torch.Tensor, g: torch.Tensor):  # type: ignore[no-untyped-def]
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp = fn(h, w)
    gh, gw = torch.autograd.grad((lp * g).sum(), (h, w))
    torch.cuda.synchronize()
    return lp.detach(), gh, gw, (torch.cuda.max_memory_allocated() - base) / 2**30


def test_chunked_logprobs_match_the_full_logits_at_151k_vocab_with_less_memory() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16()
    y = torch.randint(0, V, (N,), device="cuda", generator=gen)
    g = torch.randn(N, device="cuda", generator=gen)
    ids = torch.tensor([0, 151643, 151935], device="cuda")
    y[y == 0] = 1
    plain = _run(lambda h, w: _plain(h, w, y, ids), h, w, g)
    chunked = {}
    for chunk in (2048, 4096):
        chunked[chunk] = _run(lambda h, w, c=chunk: chunked_token_logprobs(  # type: ignore[misc]
            h, w, y, chunk_tokens=c, temperature=0.9, masked_ids=ids)[0], h, w, g)  # fmt: skip
    print(f"\nextra peak GiB over inputs, N={N} H={H} V={V}: full logits {plain[3]:.2f}, "
          + ", ".join(f"chunks of {c} {r[3]:.2f}" for c, r in chunked.items()))  # fmt: skip
    for lp, gh, gw, peak in chunked.values():
        torch.testing.assert_close(lp, plain[0], rtol=0, atol=1e-4)
        for a, b in ((gh, plain[1]), (gw, plain[2])):  # bf16 gradients: the same up to bf16 rounding
            assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
        assert peak < 0.5 * plain[3]
