"""The gradient clipping norm the Megatron backend uses where megatron-core would wait on the host per tensor (CPU, no
megatron-core import)."""

from __future__ import annotations

import torch


def test_the_device_grad_norm_is_the_norm_of_every_tensor_together() -> None:
    from actors.learner.megatron.grad_norm import device_l2_norm

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(*shape, generator=g) for shape in ((3, 4), (7,), (2, 2, 5)))
    norm, per_tensor = device_l2_norm(2048 * 32, None, [[a, b], [], [c]], False)
    expected = torch.cat([a.flatten(), b, c.flatten()]).double().norm()
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert abs(float(norm[0]) - float(expected)) <= 1e-6 * float(expected)
