"""The loss function on a CUDA device matches the CPU result (values, gradients, metrics); bf16 logprobs work."""

from __future__ import annotations

import pytest
import torch
from _alg_batches import micro_batch

from async_rl.algorithms import make_loss_fn
from async_rl.algorithms.batch import ForwardOutput
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.config.configurable import from_dict

CFG = {
    "loss": {"type": "regular", "kl_coef": 0.1, "entropy_coef": 0.01, "reduction": "seq_mean_token_mean"},
    "correction": {"tis": "token", "outlier_mask": True, "token_mask": True, "sequence_mask": "geometric",
                   "geometric_low": 0.5, "geometric_high": 2.0},
}  # fmt: skip


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    cfg = from_dict(AlgorithmConfig, CFG)
    g = torch.Generator().manual_seed(0)
    b, t = 16, 256
    lengths = torch.randint(0, t, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    mu = -torch.rand(b, t, generator=g) * 3
    logp = mu + torch.randn(b, t, generator=g) * 0.3
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    ent = torch.rand(b, t, generator=g)
    mb = micro_batch(mask, mu, adv, proximal=mu + 0.05, reference=mu - 0.05,
                     versions=torch.randint(0, 10, (b, t), generator=g))  # fmt: skip
    fn = make_loss_fn(cfg, learner_version=10)
    results = []
    for device in ("cpu", "cuda"):
        lp = logp.detach().to(device).clone().requires_grad_()
        loss, m = fn(ForwardOutput(logprobs=lp, entropy=ent.to(device)), mb.to(device))
        loss.backward()
        results.append((loss.item(), lp.grad.cpu(), m))
    (l_cpu, g_cpu, m_cpu), (l_gpu, g_gpu, m_gpu) = results
    assert l_gpu == pytest.approx(l_cpu, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(g_gpu, g_cpu, rtol=1e-4, atol=1e-7)
    assert m_gpu.keys() == m_cpu.keys()
    for k in m_cpu:
        assert m_gpu[k] == pytest.approx(m_cpu[k], rel=1e-4, abs=1e-6), k
    # bf16 logprobs from a backend are upcast, the gradient comes back in bf16
    lp = logp.detach().to("cuda", torch.bfloat16).requires_grad_()
    loss, m = fn(ForwardOutput(logprobs=lp, entropy=ent.cuda()), mb.to("cuda"))
    loss.backward()
    assert torch.isfinite(loss) and lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad.float()).all()
