"""Driving megatron-core's RouterReplay (R3) around the pipeline schedules.

megatron-core keeps one ``RouterReplay`` per router, in construction order, in a class-level list.
Per micro-batch we hand every router of this rank its ``[rows, top_k]`` int64 indices
(:func:`actors.learner.megatron.routes.replay_indices` cut them on the host) and switch the action to
``REPLAY_FORWARD``. ``set_replay_data`` also appends the indices to each router's
``replay_backward_list``; with activation recompute, the backward pass re-runs the forward of each
layer and must pop those same indices, in the same (FIFO, micro-batch) order, which megatron-core
only does under ``REPLAY_BACKWARD`` -- it never switches to it by itself. We switch it from inside
autograd: an identity op on the stage output whose backward runs first in the stage's backward
(before any layer recompute) and sets ``REPLAY_BACKWARD``. Every schedule (forward-only included)
starts and ends with a full clear (indices, action, backward lists), so nothing leaks into the next.

Everything megatron is imported lazily (this module is imported only on GPU ranks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch


def _rr():  # type: ignore[no-untyped-def]
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


def check_replay_config(transformer_config: object) -> None:
    """Refuse the combinations in which megatron-core silently skips replay."""
    if getattr(transformer_config, "moe_router_fusion", False):
        raise ValueError("router replay is skipped by megatron-core with moe_router_fusion=True; turn one off")
    if getattr(transformer_config, "moe_router_load_balancing_type", "") == "sinkhorn":
        raise ValueError("router replay is skipped by megatron-core with sinkhorn routing; turn one off")


def num_routers() -> int:
    """RouterReplay instances that exist in this process (this rank's MoE layers)."""
    rr, _ = _rr()
    return len(rr.global_router_replay_instances)


def reset_instances() -> None:
    """Forget routers of a previous model (call before building another model in this process)."""
    rr, _ = _rr()
    rr.clear_global_indices()
    rr.clear_global_router_replay_action()
    rr.clear_global_router_replay_instances()


def clear() -> None:
    """Drop indices, recorded routes, backward lists and actions of every router."""
    rr, _ = _rr()
    rr.clear_global_indices()
    rr.clear_global_router_replay_action()


@contextmanager
def schedule_scope() -> Iterator[None]:
    """Wrap one pipeline schedule (train or forward-only): replay state is clean before and after."""
    clear()
    try:
        yield
    finally:
        clear()


def set_forward(per_layer: Sequence[np.ndarray | torch.Tensor] | None, device: torch.device) -> None:
    """Before a micro-batch's forward: replay ``per_layer`` (one ``[rows, top_k]`` per router, host arrays or tensors
    already on ``device``) or route freely."""
    rr, action = _rr()
    if per_layer is None:
        rr.clear_global_router_replay_action()
        return
    n = len(rr.global_router_replay_instances)
    if len(per_layer) != n:
        raise ValueError(f"{len(per_layer)} route tensors for {n} routers on this rank")
    rr.set_replay_data([(a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a)))
                        .to(device, non_blocking=True) for a in per_layer])  # fmt: skip
    rr.set_global_router_replay_action(action.REPLAY_FORWARD)


def set_record() -> None:
    """Before a forward whose own routing should be recorded (``recorded()`` reads it afterwards)."""
    rr, action = _rr()
    rr.clear_global_indices()
    rr.set_global_router_replay_action(action.RECORD)


def recorded() -> list[torch.Tensor]:
    """Routes recorded by the last forward under :func:`set_record`, cloned (megatron keeps references)."""
    rr, _ = _rr()
    out = rr.get_recorded_data()
    if any(t is None for t in out):
        raise RuntimeError("a router recorded nothing: was the forward run under set_record()?")
    return [t.detach().clone() for t in out]


class _BackwardReplaySwitch(torch.autograd.Function):
    """Identity whose backward sets the routers' action for the stage's recompute, before any layer recomputes.

    ``replaying``: REPLAY_BACKWARD (pop this micro-batch's indices); else clear the action (free routing),
    so that a later micro-batch's REPLAY_FORWARD (1F1B interleaves forwards and backwards) never leaks in.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, replaying: bool) -> torch.Tensor:  # type: ignore[no-untyped-def]
        ctx.replaying = replaying
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        rr, action = _rr()
        if ctx.replaying:
            rr.set_global_router_replay_action(action.REPLAY_BACKWARD)
        else:
            rr.clear_global_router_replay_action()
        return grad, None


def backward_switch(output: torch.Tensor, *, replaying: bool) -> torch.Tensor:
    """Mark a stage output so that its backward recompute replays (or freely routes) like its forward did."""
    if not output.requires_grad:
        return output
    return _BackwardReplaySwitch.apply(output, replaying)
