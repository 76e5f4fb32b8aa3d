"""Joining a run: checked before the engine is built or any weight fetched, so a wrong setting ends in seconds.

- **The run exists** at this Redis and prefix (:mod:`async_rl.run.listing`). A generator may start before its learner,
  so a prefix with no run is waited for, saying at once which runs the Redis holds (a typo is offered as "did you
  mean"); a prefix that lives in another database of the same server is a mistake, and the generator exits.
- **The model matches the run's** (:mod:`async_rl.model.architecture`): the learner wrote its architecture into its
  state; a generator with another one (``small-moe`` against ``tiny-moe``) tells the learner
  (:class:`~async_rl.servers.control.JoinRefused`) and exits non-zero with one line naming the differences and the key to
  set, instead of refusing every version it fetches.
- **The task matches the run's** (:mod:`async_rl.tasks.identity`): name, prompt file (its name and content hash),
  dataset, environment, reward, tokenizer; a generator that would score against another task (``reverse`` under a
  learner on ``copy``) is refused the same way, in one line naming the first difference, on both sides.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from async_rl.model import architecture as arch
from async_rl.process.lifecycle import StartupError
from async_rl.run.listing import missing_run
from async_rl.servers.control import ControlPlane, JoinRefused
from async_rl.tasks import identity

log = logging.getLogger(__name__)


def model_key(cfg: Any) -> str:
    """The generator's key of its model name (``torch.model.name`` or ``vllm.model.name``)."""
    return f"{cfg.engine}.model.name"


async def check_join(cfg: Any, redis: Any, control: ControlPlane) -> bool:
    """Raise :class:`StartupError` (one line) when this generator cannot serve the run (module docstring). False
    when there is no run to compare with yet (its learner has not started): call again once its weights came."""
    names = cfg.run.names
    missing = await missing_run(redis, cfg.run.redis_url, cfg.run.prefix)
    if missing is not None:
        if missing.other_db is not None:  # the right prefix in the wrong database: no learner will come here
            raise StartupError(missing.line)
        log.warning("%s; waiting for its learner (up to weight_sync.first_version_timeout_s=%.0fs)", missing.line,
                    cfg.weight_sync.first_version_timeout_s)  # fmt: skip
        return False
    raw = await redis.hmget(names.learner_state, [arch.STATE_FIELD, "model", identity.STATE_FIELD])
    line = await asyncio.to_thread(_model_mismatch, cfg, arch.decode(raw[0]), (raw[1] or b"?").decode())
    if line is None:
        line = await asyncio.to_thread(_task_mismatch, cfg, identity.decode(raw[2]))
    if line is None:
        return True
    try:
        await control.publish(names.heartbeat_subject, JoinRefused(generator_id=cfg.generator_id, reason=line))
        await control.flush(2.0)
    except Exception as exc:  # informational: the generator's own line is what matters
        log.debug("telling the learner failed: %r", exc)
    raise StartupError(line)


def _model_mismatch(cfg: Any, run_arch: dict[str, Any] | None, run_model: str) -> str | None:
    """The line refusing a model of another architecture than the run's; None when it matches, or when the learner
    wrote none (an older learner: the weights' own checks still apply)."""
    if run_arch is None:
        return None
    model = getattr(cfg, cfg.engine).model.name
    diffs = arch.differences(arch.architecture(model), run_arch)
    if not diffs:
        return None
    return (f"model {model!r} does not match run {cfg.run.prefix!r}, whose learner trains {run_model!r}: "
            f"{'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''} (set {model_key(cfg)} to the learner's "
            "model.name or a model of the same architecture)")  # fmt: skip


def _task_mismatch(cfg: Any, run_facts: dict[str, Any] | None) -> str | None:
    """The line refusing another task than the run's (the first differences named); None when it matches, or when
    the learner wrote none."""
    if run_facts is None:
        return None
    diffs = identity.differences(identity.task_facts(cfg.task), run_facts)
    if not diffs:
        return None
    return (f"task {cfg.task.name!r} does not match run {cfg.run.prefix!r}, whose learner trains on "
            f"{run_facts.get('task.name', '?')!r}: {'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''} "
            "(give the generator the learner's task.* settings and the same files)")  # fmt: skip
