"""What vLLM's workers answer to ``arl_copy_ipc`` (:mod:`actors.generator.vllm_worker`), checked in the engine's
process (every rank mapped the learner's buffers and copied the same bytes) and said in its log."""

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


def describe_copy(total_s: float, r: dict[str, Any]) -> str:
    """A version's copy as the log says it, in either follower (the front end's, the engine core's): ``total_s``
    from the request to the answer, then the worker's own breakdown (``r``, its answer to ``arl_copy_ipc``)."""
    return (f"copied from the learner's GPU in {total_s:.3f} s (in the worker {r['s']:.3f}: copy and checksums "
            f"{r['copy_s']:.3f}, views {r['prepare_s']:.3f}; loads by {r['load']})")
