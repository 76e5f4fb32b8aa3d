"""How late a process's asyncio event loop runs what is due: a timer's lateness, the largest since the last look.

Everything a generator does between engine steps waits for its event loop: the replies of vLLM's RPCs, a weight
version's notice, the swap's pause and resume, each request's outputs. A loop kept busy (hundreds of requests'
outputs, groups encoded for the stream) adds its lateness to each of them; the heartbeats carry the largest
(``Heartbeat.loop_lag_ms``), so a slow swap can be told from a slow loop.
"""

from __future__ import annotations

import asyncio
import time

LAG_TICK_S = 0.01
"""The timer's period: the lateness of one tick is measured; a tick costs a few microseconds of the loop."""


class LoopLag:
    """A timer on the running loop (:meth:`run`) that keeps its largest lateness until :meth:`take_max`."""

    tick_s: float
    _max_s: float

    def __init__(self, tick_s: float = LAG_TICK_S) -> None:
        if tick_s <= 0:
            raise ValueError(f"tick_s must be > 0, got {tick_s}")
        self.tick_s = tick_s
        self._max_s = 0.0

    async def run(self) -> None:
        """Tick until cancelled (a task beside the process's work)."""
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.tick_s)
            self._max_s = max(self._max_s, time.monotonic() - t0 - self.tick_s)

    def take_max(self) -> float:
        """The largest lateness in seconds since the last call (0.0 before the first tick), and start again."""
        out, self._max_s = self._max_s, 0.0
        return out
