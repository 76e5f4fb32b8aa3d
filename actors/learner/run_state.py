"""The run's Redis state against the learner's checkpoint: state lost with its server is said, never papered over.

A learner resumes from ``<run_dir>/checkpoints``, and the run goes on in Redis: the weight versions, the audit of
every issued prompt, the prompt and rollout streams. When Redis no longer holds what the checkpoint says was there
(a Valkey that kept nothing on disk restarted; another server or database), resuming as if nothing happened would
hide that the prompts in flight and the published versions are gone. Before anything heavy starts,
:func:`check_run_state` compares:

* **lost**: none of the run's state is there (no learner state, no weights, no audit counters), and the
  checkpoint is past step 0;
* **older**: the newest weight version there is older than the checkpoint's published version, or the audit
  counters are gone while the checkpoint issued prompts.

Then, by ``checkpoint.on_lost_state``: ``refuse`` (the default) exits 1 with one line naming what is missing and the
fixes; ``rebuild`` says the same in one warning and goes on from the checkpoint: its version is published again
(``Publishing.start``), prompts are issued from its data position, and the loss is recorded in the learner's state
hash (field :data:`LOST_FIELD`), which ``async-rl audit`` prints: the prompts in flight at the loss have no fate.
A learner on embedded servers of its own (no URLs given) always rebuilds: they keep nothing by design.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from async_rl.process.lifecycle import redact_url

if TYPE_CHECKING:  # async-rl audit reads LOST_FIELD from here without torch (the checkpoint's backend imports it)
    from actors.learner.config import LearnerConfig

log = logging.getLogger(__name__)

LOST_FIELD = "lost_state"
"""Field of ``Names.learner_state``: JSON of the last rebuild after the run's Redis state was lost (when, what was
missing, the checkpoint it went on from)."""


def _missing(redis: Any, cfg: LearnerConfig, meta: dict[str, Any]) -> str | None:
    """What of the run's state is missing or older than the checkpoint ``meta`` says, in words; None when nothing."""
    names = cfg.run.names
    has_state = bool(redis.exists(names.learner_state))
    # The newest version published by either path: the host transport's, or the GPU slots' (publisher.gpu).
    published_there = [int(v) for v in (redis.get(names.weights_latest), redis.get(names.weights_gpu_latest))
                       if v is not None]  # fmt: skip
    latest = max(published_there) if published_there else None
    counters = redis.hgetall(names.audit_counters)
    step, published, issued = int(meta["step"]), int(meta["published_version"]), int(meta["prompts_issued"])
    if not has_state and latest is None and not counters and (step > 0 or published >= 0):
        return "holds none of its state (no learner state, no weights, no audit counters)"
    parts = []
    if published >= 0 and (latest is None or latest < published):
        parts.append(f"its newest weights there are {'none' if latest is None else f'v{latest}'}, the checkpoint "
                     f"published v{published}")  # fmt: skip
    if issued > 0 and not counters:
        parts.append(f"it has no audit counters, the checkpoint issued {issued} prompts")
    return f"is older than the checkpoint: {'; '.join(parts)}" if parts else None


def check_run_state(cfg: LearnerConfig, *, owned_servers: bool = False) -> str | None:
    """Compare the run's Redis state with the newest checkpoint (module docstring): the line to exit 1 with when
    it is lost or older and ``checkpoint.on_lost_state`` is ``refuse``; None when the learner may go on (a rebuild is
    logged and recorded)."""
    import redis as redis_sync

    from actors.learner.checkpoint import CheckpointManager

    found = CheckpointManager(cfg.run.run_dir / "checkpoints", keep=cfg.checkpoint.keep).latest_meta()
    if found is None:
        return None
    path, meta = found
    assert cfg.run.redis_url
    client = redis_sync.Redis.from_url(cfg.run.redis_url)
    try:
        missing = _missing(client, cfg, meta)
        if missing is None:
            return None
        what = (f"run {cfg.run.prefix!r} at {redact_url(cfg.run.redis_url)} {missing}, but the checkpoint {path} is "
                f"at step {meta['step']}, version {meta['version']}: the run's Redis state was lost")  # fmt: skip
        if cfg.checkpoint.on_lost_state == "refuse" and not owned_servers:
            return (f"{what} (a Valkey that keeps nothing on disk restarted, or another server or database). Point "
                    "run.redis_url at the run's own server, or restore its data (async-rl serve --data-dir keeps it), "
                    "or go on from the checkpoint with the prompts in flight lost: checkpoint.on_lost_state=rebuild")
        log.warning("%s; rebuilding from the checkpoint%s: its version is published again, prompts are issued from "
                    "#%d on, the prompts in flight at the loss have no fate (async-rl audit says so)", what,
                    " (embedded servers keep nothing)" if owned_servers else " (checkpoint.on_lost_state=rebuild)",
                    meta["prompts_issued"])  # fmt: skip
        if int(os.environ.get("RANK", "0")) == 0:  # one record per rebuild, from rank 0 of a multi-rank learner
            record = {"at": time.time(), "missing": missing, "checkpoint": path.name, "step": meta["step"],
                      "version": meta["version"], "prompts_issued": meta["prompts_issued"]}  # fmt: skip
            client.hset(cfg.run.names.learner_state, LOST_FIELD, json.dumps(record))
        return None
    finally:
        client.close()
