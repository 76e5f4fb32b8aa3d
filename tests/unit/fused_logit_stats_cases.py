"""Cases for the fused logit-statistics kernels (async_rl/logprobs/stats.py) against their torch definition: values and
gradients of log p(target) and entropy, with the sampling mask and a temperature, for bf16 and fp32 logits, flat and
as a strided slice of ``[B, T, V]`` logits. On the device of the run: CUDA where there is one, else the CPU, where
Triton's interpreter must be on before torch is imported (``tests/unit/test_logit_stats.py`` runs this file so)."""

from __future__ import annotations

import pytest
import torch

from async_rl.logprobs.stats import token_stats

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _both(logits: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor | None, **kw):  # type: ignore[no-untyped-def]
    out = []
    for fused in (True, False):
        x = logits.detach().clone().requires_grad_()
        lp, ent = token_stats(x, targets, fused=fused, with_entropy=g_ent is not None, **kw)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if ent is not None and g_ent is not None else 0.0)
        loss.backward()
        out.append((lp.detach(), None if ent is None else ent.detach(), x.grad))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize(("temperature", "masked"), [(1.0, None), (0.7, [0, 3, 50])])
def test_fused_matches_the_definition(dtype: torch.dtype, entropy: bool, temperature: float, masked) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    n, v = 6, 300  # 300 columns: blocks of 512 with a masked tail
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype).to(DEV)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0] = 3 if masked else targets[0]  # a masked target: lp = MASKED_LOGIT - lse, no gradient
    g_lp = torch.randn(n, generator=g)
    g_lp[1] = 0.0  # a padding row
    g_ent = torch.randn(n, generator=g) if entropy else None
    ids = torch.tensor(masked) if masked else None
    targets, g_lp = targets.to(DEV), g_lp.to(DEV)
    g_ent = None if g_ent is None else g_ent.to(DEV)
    ids = None if ids is None else ids.to(DEV)
    (lp, ent, gx), (rlp, rent, rgx) = _both(logits, targets, g_lp, g_ent, temperature=temperature, masked_ids=ids)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-4)
    if entropy:
        torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-4)
    assert gx.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(gx, rgx, **tol)
    if masked:
        assert ids is not None and gx[:, ids].abs().sum() == 0


def test_strided_slice_of_batched_logits() -> None:
    """``logits[:, :-1]`` of ``[B, T, V]`` (rows not contiguous in memory) as the torch backend passes them."""
    g = torch.Generator().manual_seed(1)
    full = torch.randn(3, 5, 40, generator=g).to(DEV)
    ids = torch.randint(0, 40, (3, 5), generator=g).to(DEV)
    logits, targets = full[:, :-1], ids[:, 1:]
    (lp, ent, gx), (rlp, rent, rgx) = _both(logits, targets, torch.ones(3, 4, device=DEV), torch.ones(3, 4, device=DEV))
    assert lp.shape == (3, 4) and gx.shape == (3, 4, 40)
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, rgx, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entropy", [False, True])
def test_chunked_logprobs_take_the_kernels(monkeypatch: pytest.MonkeyPatch, entropy: bool) -> None:
    """``chunked_token_logprobs`` with the kernels on its chunks: the values and gradients of its torch path."""
    from async_rl.logprobs import chunked as chunked_logprobs

    g = torch.Generator().manual_seed(3)
    h = torch.randn(7, 16, generator=g).to(DEV)
    w = torch.randn(90, 16, generator=g).to(DEV)
    y = torch.randint(0, 90, (7,), generator=g).to(DEV)
    g_lp, g_ent = torch.randn(7, generator=g).to(DEV), torch.randn(7, generator=g).to(DEV)
    out = []
    for fused in (True, False):
        monkeypatch.setattr(chunked_logprobs, "can_fuse", lambda _x, fused=fused: fused)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = chunked_logprobs.chunked_token_logprobs(hh, ww, y, chunk_tokens=3, temperature=0.8,
                                                          masked_ids=torch.tensor([5, 6]), with_entropy=entropy)  # fmt: skip
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if ent is not None else 0.0)
        loss.backward()
        out.append((lp.detach(), ent, hh.grad, ww.grad))
    (lp, ent, gh, gw), (rlp, rent, rgh, rgw) = out
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5)
    if entropy:
        torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, rgh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, rgw, rtol=1e-4, atol=1e-5)


def test_a_target_outside_the_vocabulary_gives_nan_not_a_stray_read() -> None:
    logits = torch.randn(3, 20).to(DEV)
    lp, _ = token_stats(logits, torch.tensor([1, 20, -1]).to(DEV), fused=True)
    assert torch.isfinite(lp[0]) and torch.isnan(lp[1:]).all()



def test_an_entropy_only_reported_runs_the_logprob_only_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entropy asked for and only reported (detached, as the learner's ``loss/entropy_mean`` with ``entropy_coef``
    0): the backward kernel runs without its entropy term, and the gradient is the logprobs-only one."""
    from async_rl.logprobs import stats

    seen: list[bool] = []
    real = stats.fused_backward

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(args[4] is not None and args[6] is not None)  # ent and g_ent: the entropy term
        return real(*args, **kwargs)

    monkeypatch.setattr(stats, "fused_backward", spy)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 70, generator=g).to(DEV)
    targets = torch.randint(0, 70, (5,), generator=g).to(DEV)
    grads = []
    for with_entropy in (False, True):
        x = logits.clone().requires_grad_()
        lp, ent = token_stats(x, targets, fused=True, with_entropy=with_entropy)
        assert (ent is not None) == with_entropy and (ent is None or bool((ent.detach() > 0).all()))
        lp.sum().backward()
        grads.append(x.grad)
    assert seen == [False, False], seen
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
