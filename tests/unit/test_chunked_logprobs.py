"""Chunked logprobs from hidden states: values and gradients equal the full-logits computation (CPU, fp64/fp32)."""

from __future__ import annotations

import pytest
import torch

from async_rl.logprobs.chunked import chunked_token_logprobs
from async_rl.model.token_mask import mask_logits


def _plain(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, temperature: float, ids: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The torch backend's full-logits path: logits, fp32, mask, temperature, log-softmax and entropy."""
    z = (h @ w.t()).float() if h.dtype != torch.float64 else h @ w.t()
    if ids is not None:
        z = mask_logits(z, ids)
    z = z / temperature
    lse = torch.logsumexp(z, -1)
    lp = z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
    ent = lse - (torch.softmax(z, -1) * z).sum(-1)
    return lp, ent


def _inputs(dtype: torch.dtype, n: int = 23, hid: int = 8, v: int = 37, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hid, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(v, hid, generator=g, dtype=dtype) * 0.7).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    return h, w, y


@pytest.mark.parametrize("chunk", [1, 5, 23, 64])
@pytest.mark.parametrize("temperature, masked", [(1.0, None), (0.7, [0, 3, 36, 99])])
def test_values_and_gradients_match_the_full_logits(chunk: int, temperature: float, masked: list[int] | None) -> None:
    ids = None if masked is None else torch.tensor(masked)
    h, w, y = _inputs(torch.float64)
    if ids is not None:
        y[0] = 3  # a masked target: its logprob is ~ -1e9 on both paths, and its column gets no gradient
    gl, ge = torch.randn(23, dtype=torch.float64), torch.randn(23, dtype=torch.float64)
    lp, ent = chunked_token_logprobs(h, w, y, chunk_tokens=chunk, temperature=temperature, masked_ids=ids,
                                     with_entropy=True)  # fmt: skip
    assert ent is not None
    gh, gw = torch.autograd.grad((lp * gl).sum() + (ent * ge).sum(), (h, w))
    rlp, rent = _plain(h, w, y, temperature, None if ids is None else ids[ids < 37])
    rgh, rgw = torch.autograd.grad((rlp * gl).sum() + (rent * ge).sum(), (h, w))
    torch.testing.assert_close(lp, rlp.float() if lp.dtype == torch.float32 else rlp)
    torch.testing.assert_close(ent, rent.to(ent.dtype))
    torch.testing.assert_close(gh, rgh)
    torch.testing.assert_close(gw, rgw)
    if ids is not None:
        assert bool((gw[ids[ids < 37]] == 0).all())


def test_float64_gradcheck_and_logprobs_only() -> None:
    h, w, y = _inputs(torch.float64, n=7, hid=3, v=5)
    y[y == 1] = 2  # a masked target's logprob (-1e9) is beyond finite differences

    def f(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = chunked_token_logprobs(h, w, y, chunk_tokens=3, temperature=1.3, masked_ids=torch.tensor([1]),
                                         with_entropy=True)  # fmt: skip
        assert ent is not None
        return lp, ent

    assert torch.autograd.gradcheck(f, (h, w))
    lp, ent = chunked_token_logprobs(h, w, y, chunk_tokens=2)
    assert ent is None
    (gh,) = torch.autograd.grad(lp.sum(), h)
    (rgh,) = torch.autograd.grad(_plain(h, w, y, 1.0, None)[0].sum(), h)
    torch.testing.assert_close(gh, rgh)


def test_float32_and_bfloat16_heads_match_the_plain_path() -> None:
    h, w, y = _inputs(torch.float32, n=40, hid=16, v=300)
    lp, _ = chunked_token_logprobs(h, w, y, chunk_tokens=16)
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    rgh, rgw = torch.autograd.grad(_plain(h, w, y, 1.0, None)[0].sum(), (h, w))
    torch.testing.assert_close(gh, rgh)
    torch.testing.assert_close(gw, rgw)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    lp, _ = chunked_token_logprobs(hb, wb, y, chunk_tokens=16)
    assert lp.dtype == torch.float32
    gh, gw = torch.autograd.grad(lp.sum(), (hb, wb))
    assert gh.dtype == gw.dtype == torch.bfloat16
    rlp, _ = _plain(hb, wb, y, 1.0, None)
    rgh, rgw = torch.autograd.grad(rlp.sum(), (hb, wb))
    torch.testing.assert_close(lp, rlp)  # the same bf16 matmul, then fp32
    torch.testing.assert_close(gh.float(), rgh.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw.float(), rgw.float(), atol=2e-2, rtol=2e-2)


def test_no_gradient_needed_and_bad_shapes() -> None:
    h, w, y = _inputs(torch.float32)
    with torch.no_grad():
        lp, _ = chunked_token_logprobs(h, w, y, chunk_tokens=4)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, _plain(h, w, y, 1.0, None)[0].detach())
    with pytest.raises(ValueError, match="chunk_tokens must be > 0"):
        chunked_token_logprobs(h, w, y, chunk_tokens=0)
    with pytest.raises(ValueError, match="weight"):
        chunked_token_logprobs(h, w.t(), y, chunk_tokens=4)
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(h, w, y[:3], chunk_tokens=4)


def test_an_entropy_only_reported_adds_nothing_to_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner reports the entropy every step (``learner.entropy_metric``) and trains on it only with
    ``entropy_coef`` > 0: a detached entropy passes no gradient, so backward takes the logprob-only path (one
    chunk x vocab buffer, no entropy term) and the gradient is the logprobs-only one, bit for bit."""
    from async_rl.logprobs import chunked

    seen: list[bool] = []
    real = chunked._chunk_grad

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(args[4] is not None)  # ent: given only when an entropy gradient flows
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked, "_chunk_grad", spy)
    grads = []
    for with_entropy in (False, True):
        h, w, y = _inputs(torch.float32)
        lp, ent = chunked_token_logprobs(h, w, y, chunk_tokens=5, with_entropy=with_entropy)
        reported = None if ent is None else float(ent.detach().mean())
        (lp * torch.linspace(-1, 1, 23)).sum().backward()
        grads.append((h.grad, w.grad, reported))
    assert seen == [False] * 10, seen  # 5 chunks each, never an entropy term
    assert grads[1][2] is not None and grads[1][2] > 0
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)
