"""What vLLM's workers answer to ``arl_copy_ipc`` (:mod:`actors.generator.vllm_worker`), checked in the engine's
process: every rank mapped the learner's buffers and copied the same bytes."""

from __future__ import annotations

from typing import Any

from async_rl.weights.gpu.cuda_ipc import IpcUnavailable
from async_rl.weights.gpu.reader import RemoteCopied
from async_rl.weights.reader import CorruptVersion


def copies_agree(results: list[dict[str, Any]], version: int) -> RemoteCopied:
    """The buckets' wsum64 as every rank computed them (for the caller to check against the manifest) and when the
    last rank had read the learner's buffers. :class:`IpcUnavailable` where a rank could not map them,
    :class:`CorruptVersion` where tensor-parallel ranks copied different bytes."""
    for r in results:
        if "unavailable" in r:
            raise IpcUnavailable(f"vLLM's worker cannot map the learner's GPU buffers: {r['unavailable']}")
    sums = [int(x) for x in results[0]["sums"]]
    for rank, r in enumerate(results[1:], 1):
        if [int(x) for x in r["sums"]] != sums:
            raise CorruptVersion(f"GPU-held weights v{version}: tensor-parallel rank {rank} copied other bytes than "
                                 "rank 0")  # fmt: skip
    return RemoteCopied(sums, max(float(r["copied_at"]) for r in results))
