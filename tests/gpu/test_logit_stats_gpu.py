"""The fused logit statistics (async_rl/logprobs/stats.py) at Qwen3's vocabulary on one CUDA GPU: the values and
gradients of the plain torch path, and their time and extra memory against it (printed: ``-s`` shows them).
The small cases of ``tests/unit/fused_logit_stats_cases.py`` run here too, on the GPU."""

from __future__ import annotations

import time

import pytest
import torch

from async_rl.logprobs.stats import token_stats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N, V = 8192, 151936
"""An 8k-token micro-batch's logits at Qwen3's vocabulary (2.5 GB in bf16)."""


def _run(fused: bool, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, g: torch.Tensor):  # type: ignore[no-untyped-def]
    x = x.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    lp, ent = token_stats(x, y, temperature=0.9, masked_ids=ids, with_entropy=True, fused=fused)
    assert ent is not None
    ((lp * g).sum() + (ent * g).sum()).backward()
    torch.cuda.synchronize()
    return lp.detach(), ent.detach(), x.grad, time.perf_counter() - t0, (torch.cuda.max_memory_allocated() - base) / 2**30


def test_fused_equals_torch_at_qwen3_vocabulary() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(N, V, device="cuda", generator=gen) * 2).bfloat16()
    y = torch.randint(0, V, (N,), device="cuda", generator=gen)
    g = torch.randn(N, device="cuda", generator=gen)
    ids = torch.tensor([0, 1, 151643, 151935], device="cuda")
    for fused in (True, False):  # warm-up (Triton compiles, cuBLAS/allocator settle)
        _run(fused, x[:64], y[:64], ids, g[:64])
    lp, ent, gx, t_fused, mem_fused = _run(True, x, y, ids, g)
    del gx
    rlp, rent, rgx, t_torch, mem_torch = _run(False, x, y, ids, g)
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=2e-4)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=2e-4)
    _, _, gx, _, _ = _run(True, x, y, ids, g)
    torch.testing.assert_close(gx, rgx, rtol=1e-2, atol=1e-6)
    assert gx[:, ids].abs().sum() == 0
    print(f"\nlogit stats N={N} V={V} bf16, forward + backward with entropy, mask and temperature: fused "
          f"{t_fused * 1e3:.1f} ms / {mem_fused:.2f} GiB extra, torch {t_torch * 1e3:.1f} ms / {mem_torch:.2f} GiB "
          f"({t_torch / t_fused:.1f}x)")


def test_small_cases_on_the_gpu() -> None:
    import subprocess
    import sys
    from pathlib import Path

    cases = Path(__file__).parents[1] / "unit" / "fused_logit_stats_cases.py"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", str(cases)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and "skipped" not in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
