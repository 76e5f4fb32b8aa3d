"""The evaluation queue: held-out prompts out, scores back, apart from training in every key.

* **Apart from training.** Evaluation prompts go through a prompt queue of their own (:class:`PromptQueue` on
  ``Names.evaluation``: stream ``<prefix>:eval:prompts``, its own consumer group, open set and counters), so
  they are never in the rollout stream (never trained on), never in the training audit's open set (admission
  control never counts them) and never among its fates (``async-rl audit``'s totals are training's alone).
* **Still accounted for.** The evaluation audit has the same guarantees with fates :data:`EVAL_FATES`:
  ``issued = evaluated + dead_lettered + in flight``. A generator's :meth:`EvalQueue.finish` appends the result
  to ``<prefix>:eval:results`` (``XADD``), acks and deletes the prompt (``XACK``/``XDEL``) and records the fate
  ``evaluated`` in one ``MULTI``: a generator killed at any point leaves the prompt pending (another reclaims it)
  or both done. Delivery limits and dead letters are the prompt queue's.
* **Results by cursor.** The learner reads results with ``XREAD`` from the last id it consumed, kept in its
  checkpoint with the metrics rows they went into: a restarted learner reads each result into exactly one
  committed row. The stream keeps the newest :data:`MAX_RESULTS` (``XADD MAXLEN ~``).

A result (msgpack) holds the prompt id, the round (the learner version the round was issued at), its source
(the label its metrics go by), each sample's reward, reward components and extracted answer, and the weight versions
its tokens were sampled with.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis.asyncio as aioredis

from async_rl.run.lease import Fence
from async_rl.run.names import Names
from async_rl.wire import PromptSpec
from buffer.audit import EVAL_FATES, Audit
from buffer.prompts import PromptEntry, PromptQueue, PromptQueueConfig
from buffer.streams import check_client, sid

MAX_RESULTS = 100_000
"""Results kept in the stream (a few hundred bytes each): far more than a learner falls behind by."""
ROUND_KEY = "eval_round"
"""Metadata key of an evaluation prompt: the round (learner version) it belongs to."""
RESULT_SCHEMA = 2
"""Schema of a result record (2: with each sample's answer)."""
GREEDY_KEY = "eval_greedy"
"""Metadata key: sample greedily (temperature 0) instead of with the prompt's ``sampling``."""


@dataclass(slots=True)
class EvalResult:
    """One evaluation prompt, scored."""

    prompt_id: str
    """The evaluation prompt's id (unique per round)."""
    round: int
    """Learner version the round was issued at."""
    label: str
    """What the metrics are named by: the prompt's source (``eval/<source>/...``)."""
    rewards: list[float]
    """Each sample's reward."""
    info: dict[str, list[float]] = field(default_factory=dict)
    """Each reward component, per sample."""
    answers: list[str | None] = field(default_factory=list)
    """Each sample's answer as the task extracts it (``maj@k`` votes on them); None where the task has none (empty:
    none for every sample)."""
    min_version: int = -1
    """Oldest weight version among the samples' tokens."""
    max_version: int = -1
    """Newest weight version among the samples' tokens."""
    generator_id: str = ""
    """Who scored it."""

    def encode(self) -> bytes:
        return msgpack.packb([RESULT_SCHEMA, self.prompt_id, self.round, self.label, self.rewards, self.info,
                              self.min_version, self.max_version, self.generator_id,
                              self.answers or [None] * len(self.rewards)])  # fmt: skip

    @classmethod
    def decode(cls, raw: bytes) -> EvalResult:
        """ValueError for anything but a result this module wrote (schema 1, before answers, reads with none)."""
        try:
            v = msgpack.unpackb(raw)
            schema, pid, rnd, label, rewards, info, lo, hi, gen = v[:9]
            answers = v[9] if schema == RESULT_SCHEMA else [None] * len(rewards)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"eval result: not a result record ({exc})") from exc
        if (schema not in (1, RESULT_SCHEMA) or not isinstance(rewards, list) or not isinstance(info, dict)
                or not isinstance(answers, list) or len(answers) != len(rewards)):  # fmt: skip
            raise ValueError(f"eval result: schema {schema!r} or fields malformed")
        return cls(str(pid), int(rnd), str(label), [float(r) for r in rewards],
                   {str(k): [float(x) for x in xs] for k, xs in info.items()},
                   [None if a is None else str(a) for a in answers], int(lo), int(hi), str(gen))  # fmt: skip


class EvalQueue:
    """Both sides of a run's evaluation queue (see the module docstring)."""

    redis: aioredis.Redis
    names: Names
    audit: Audit
    prompts: PromptQueue

    def __init__(self, redis: aioredis.Redis, names: Names, cfg: PromptQueueConfig | None = None, *,
                 fence: Fence | None = None) -> None:  # fmt: skip
        """``fence``: the learner's (its issues are refused unless its token is the run's current one)."""
        self.redis = check_client(redis, "EvalQueue")
        self.names = names
        self.audit = Audit(self.redis, names.evaluation, fates=EVAL_FATES, fence=fence)
        self.prompts = PromptQueue(self.redis, names.evaluation, cfg, audit=self.audit, fence=fence)

    # ---- learner side ------------------------------------------------------------------
    async def issue(self, specs: Sequence[PromptSpec], version: int) -> int:
        """Issue the prompts of a round that are not open already (a restarted learner re-issuing a round its
        predecessor issued); returns how many were issued."""
        open_ = await self.audit.open_among([s.prompt_id for s in specs])
        fresh = [s for s in specs if s.prompt_id not in open_]
        if fresh:
            await self.prompts.issue(fresh, version)
        return len(fresh)

    async def results(self, cursor: str, count: int = 1000) -> tuple[list[EvalResult], str]:
        """Results appended after ``cursor`` (a stream id; ``"0-0"``: from the start), and the new cursor.
        An undecodable entry is skipped (only generators of this run write here)."""
        rows: Any = await self.redis.xread({self.names.eval_results_stream: cursor}, count=count)
        out: list[EvalResult] = []
        for _stream, entries in rows or []:
            for eid, fields in entries:
                cursor = sid(eid)
                try:
                    out.append(EvalResult.decode(fields[b"r"]))
                except (KeyError, ValueError):
                    continue
        return out, cursor

    async def counters(self) -> dict[str, int]:
        """``issued``, ``evaluated``, ``dead_lettered``, ``in_flight`` of evaluation prompts."""
        return await self.audit.counters()

    # ---- generator side ----------------------------------------------------------------
    async def read(self, consumer: str, count: int) -> list[PromptEntry]:
        """Up to ``count`` evaluation prompts for ``consumer`` (never blocks: training prompts wait otherwise).

        One ``XLEN`` when there are none (a run without evaluation: every generator loop asks): entries stay in the
        stream until acked, so a prompt a dead generator held keeps it non-empty until someone reclaims it."""
        if not await self.redis.xlen(self.names.evaluation.prompts_stream):
            return []
        return await self.prompts.read(consumer, count, block_ms=0)

    async def finish(self, entry: PromptEntry, result: EvalResult) -> None:
        """Append the result, ack and delete the prompt, record its fate ``evaluated``: one transaction."""
        n = self.names
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(n.eval_results_stream, {"r": result.encode(), "pid": result.prompt_id}, maxlen=MAX_RESULTS,
                      approximate=True)  # fmt: skip
            pipe.xack(n.evaluation.prompts_stream, n.evaluation.prompts_group, entry.entry_id)
            pipe.xdel(n.evaluation.prompts_stream, entry.entry_id)
            self.audit.finish_into(pipe, "evaluated", [(result.prompt_id, f"round {result.round} at {time.time():.3f}")])
            await pipe.execute()
        self.prompts.forget([entry])

    async def release(self, entries: Sequence[PromptEntry]) -> int:
        """Give evaluation prompts back unscored (shutdown): another generator takes them at once."""
        return await self.prompts.release(entries)
