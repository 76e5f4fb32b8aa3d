"""The gradients' L2 norm without a host wait per tensor, where megatron-core falls back to its local implementation.

Without Apex or Transformer Engine megatron-core computes the norm that clips the gradients (and that the step reports)
with ``local_multi_tensor_l2_norm``: one norm per gradient tensor, each turned into a Python float, so the host waits
for the device once per tensor (75 times a step on the 8-layer Qwen3-30B-A3B slice under EP=4; ``bench backends
--profile``'s host syncs by site). :func:`use_device_grad_norm` puts in its place :func:`device_l2_norm`, the same norm
kept on the device: torch's multi-tensor norm over each list, then the norm of those norms.
"""

from __future__ import annotations

from typing import Any

import torch


def device_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
                   *args: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """The L2 norm of every tensor of ``tensor_lists`` together, as a one-element float32 tensor on their device
    (megatron's ``multi_tensor_l2norm`` signature; no per-tensor norms)."""
    norms = [n for tensors in tensor_lists if tensors for n in torch._foreach_norm(tensors)]
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def use_device_grad_norm() -> bool:
    """Make megatron-core's gradient clipping use :func:`device_l2_norm` where it would use its local fallback;
    True when it did (Apex or TE installed: their fused kernel stays)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = device_l2_norm
    return clip_grads.l2_norm_impl is device_l2_norm
