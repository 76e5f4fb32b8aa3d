"""RepeatedLine: the first occurrence at once, then one summary per interval with the count, never a line per event."""

from __future__ import annotations

import logging

import pytest

from async_rl.process.repeated import RepeatedLine


def test_a_flood_becomes_one_line_and_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.repeated")
    line = RepeatedLine(log, "dropped {n} groups over the staleness bound 4", interval_s=3600.0)
    with caplog.at_level(logging.INFO, logger="test.repeated"):
        for _ in range(1000):
            line.add(3)
        line.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "dropped 3 groups over the staleness bound 4"
    assert len(lines) == 2 and lines[1].startswith("dropped 2,997 groups over the staleness bound 4 (999 times in")
    assert line.total == 3000


def test_a_zero_interval_logs_every_event_with_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.repeated2")
    line = RepeatedLine(log, "heartbeat failed: {why} ({n}x)", level=logging.WARNING, interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="test.repeated2"):
        line.add(why="A")
        line.add(why="B")
    assert [r.getMessage().split(" (1 times")[0] for r in caplog.records] == ["heartbeat failed: A (1x)",
                                                                              "heartbeat failed: B (1x)"]
