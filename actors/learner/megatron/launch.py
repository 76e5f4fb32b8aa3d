"""Process-group and megatron parallel-state setup for the Megatron backend (torchrun or a single process).

Under ``torchrun`` the usual ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*`` variables are
read; a plain single process (tests, ``async-rl learner`` on one GPU) gets a world of one on a free
local port. megatron-core is imported lazily.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch

from actors.learner.megatron.config import MegatronConfig


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(cfg: MegatronConfig) -> None:
    """Start torch.distributed (NCCL) and megatron's parallel groups for ``cfg``'s layout; idempotent.

    Raises ValueError if megatron's groups already exist with another layout (one layout per process).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not torch.cuda.is_available():
        raise RuntimeError("the Megatron backend needs a CUDA GPU")
    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(_free_port())})  # fmt: skip
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(
            backend="nccl", timeout=datetime.timedelta(minutes=cfg.distributed_timeout_minutes)
        )
    world = torch.distributed.get_world_size()
    cfg.data_parallel_size(world)  # validates the layout against the world size
    want = (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.context_parallel, cfg.expert_parallel)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())  # fmt: skip
        if have != want:
            raise ValueError(f"megatron parallel state already set up as (tp, pp, cp, ep) = {have}, asked {want}")
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_parallel,
            pipeline_model_parallel_size=cfg.pipeline_parallel,
            context_parallel_size=cfg.context_parallel,
            expert_model_parallel_size=cfg.expert_parallel,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel,
            distributed_timeout_minutes=cfg.distributed_timeout_minutes,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)


def shutdown() -> None:
    """Tear down megatron's groups and the process group (end of a run)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
