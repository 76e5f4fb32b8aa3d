"""The event-loop lateness a generator's heartbeats carry (async_rl/process/loop_lag.py), on a real loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from async_rl.process.loop_lag import LoopLag


def test_a_blocked_loop_is_seen_late_by_at_least_the_block_and_the_max_starts_again_once_taken() -> None:
    async def main() -> tuple[float, float]:
        lag = LoopLag(tick_s=0.01)
        timer = asyncio.create_task(lag.run())
        await asyncio.sleep(0.03)  # a few ticks on an idle loop
        time.sleep(0.05)  # noqa: ASYNC251  # the loop held on purpose: the waiting tick fires at least 40 ms late
        await asyncio.sleep(0.03)
        seen, again = lag.take_max(), lag.take_max()
        timer.cancel()
        await asyncio.gather(timer, return_exceptions=True)
        return seen, again

    seen, again = asyncio.run(main())
    assert seen >= 0.04
    assert again == 0.0


def test_a_tick_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tick_s"):
        LoopLag(tick_s=0)
