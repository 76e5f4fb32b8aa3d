"""The generator's process side of weight versions followed in vLLM's engine core (``vllm.follow="core"``).

The engine core's thread fetches, checks and loads versions by itself (:mod:`.vllm_follow`); this process starts it
and reads its report (one utility call every ``REPORT_INTERVAL_S``, and while waiting for the first version): what
the generator process and its work loop read of a :class:`~actors.generator.weight_sync.WeightSync` (the newest
version known, those refused, failures, snapshot times) and the swaps the engine reports in its heartbeat. A follower
that died ends the process with its error, as a failing ``WeightSync`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, NamedTuple

from actors.generator.config import GeneratorConfig
from actors.generator.vllm_worker_copies import describe_copy
from async_rl.config.configurable import to_dict

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.25
"""How often the engine core's report is read (the engine's version, for new requests' prefix-cache salt)."""
TAKEN_AT_KEPT = 64


class Fetched(NamedTuple):
    """What the generator's process shows of a fetch the engine core made."""

    version: int
    total_s: float


class CoreFollow:
    """What :class:`~actors.generator.process.Generator` reads of a weight sync, from the engine core's reports."""

    staged_version: int
    wanted_version: int
    refused: set[int]
    taken_at: dict[int, float]
    num_failures: int
    last_fetch: Fetched | None
    """The engine core's last fetch: its version and seconds (the heartbeat's ``fetch_s``, the fetch metric)."""

    def __init__(self, engine: Any, cfg: GeneratorConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.staged_version = self.wanted_version = -1
        self.refused, self.taken_at, self.num_failures = set(), {}, 0
        self.last_fetch = None
        self._staged: list[float] = []
        self._stop = asyncio.Event()
        self._started = False

    def take_staged_latencies(self) -> list[float]:
        out, self._staged = self._staged, []
        return out

    async def start(self) -> bool:
        """Start the engine core's follower and wait for its first version in use (``first_version_timeout_s``);
        False when stopped first."""
        await self.engine.core_call("arl_follow_start", to_dict(self.cfg))
        self._started = True
        timeout_s = self.cfg.weight_sync.first_version_timeout_s
        if timeout_s == 0:
            return True
        t0 = time.monotonic()
        next_note = t0 + self.cfg.weight_sync.wait_log_interval_s
        while self.engine.version < 0:
            if self._stop.is_set():
                return False
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise TimeoutError(f"no usable weight version of prefix {self.cfg.run.prefix!r} within {timeout_s}s "
                                   f"(the engine core's follower: latest {self.wanted_version}, refused "
                                   f"{sorted(self.refused)}); is a learner publishing there?")  # fmt: skip
            if now >= next_note:
                log.info("still waiting for weights of prefix %r (%.0fs so far; the engine core follows them)",
                         self.cfg.run.prefix, now - t0)  # fmt: skip
                next_note = now + self.cfg.weight_sync.wait_log_interval_s
            await self.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.02)
        log.info("engine is on weights version %d (the engine core follows versions)", self.engine.version)
        return True

    async def run(self) -> None:
        """Read the report until :meth:`stop`."""
        while not self._stop.is_set():
            await self.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), REPORT_INTERVAL_S)

    async def poll(self) -> None:
        r = await self.engine.core_call("arl_follow_report")
        if r is None or r["error"] is not None or not r["alive"]:
            why = "not started" if r is None else r["error"] or "its thread ended"
            raise RuntimeError(f"the engine core's weight follower is gone: {why}")
        self.taken_at.update({int(v): float(t) for v, t in r["taken_at"].items()})
        while len(self.taken_at) > TAKEN_AT_KEPT:
            del self.taken_at[min(self.taken_at)]
        self.engine.note_core_swaps([(int(v), float(t)) for v, t in r["swaps"]], r["pauses"])
        for v in r["versions"]:
            log.info("vLLM engine core: version %d %s, in use %s after it was ready (loaded by the %s's thread, its "
                     "call %s; a load %s on the GPU)", v["version"], _copied(v["copy"]), _s(v["waited_s"]),
                     v["by"], _s(v["call_s"]), _s(v["gpu_s"]))  # fmt: skip
        self._staged = [*self._staged, *r["staged_latencies"]][-TAKEN_AT_KEPT:]
        self.wanted_version = max(self.wanted_version, int(r["wanted"]))
        self.staged_version = max(self.staged_version, int(r["staged"]))
        self.refused = set(r["refused"])
        self.num_failures = int(r["failures"])
        if r["fetched"] is not None:
            self.last_fetch = Fetched(int(r["fetched"][0]), float(r["fetched"][1]))
        if r["load_error"]:
            self.engine.last_stage_error = r["load_error"]

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        """Stop the engine core's follower (its sync and thread; the engine's close ends the process anyway)."""
        self.stop()
        if self._started:
            self._started = False
            with contextlib.suppress(Exception):  # the engine may be gone already
                await self.engine.core_call("arl_follow_stop")


def _s(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.3f} s"


def _copied(c: dict[str, Any] | None) -> str:
    """A version's copy, as the engine's own line in the front-end mode says it."""
    return "staged from the host" if c is None else describe_copy(c["total_s"], c)
