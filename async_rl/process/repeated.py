"""A condition that repeats is logged once, then summarised with a count: never one line per event.

:class:`RepeatedLine` logs its first occurrence at once, then at most one line per ``interval_s`` summing what
happened since (``dropped 1,204 groups over the staleness bound 4 (87 times in the last 30s)``). A learner that
dropped groups 90 times a second wrote 1,121 lines in a minute before; now it writes three.
"""

from __future__ import annotations

import logging
import time

SUMMARY_INTERVAL_S = 30.0
"""Default spacing of the summary lines: two a minute still shows a condition that persists, at a glance."""


class RepeatedLine:
    """One log line for a condition that may happen many times a second (see the module docstring)."""

    log: logging.Logger
    level: int
    what: str
    """The line, with one ``{n}`` for the summed amount (``"dropped {n} groups over the staleness bound 4"``)."""
    interval_s: float
    total: int
    """Amount summed over the whole life (for tests and the final line)."""
    _pending: int
    _pending_times: int
    _last_line_at: float | None

    def __init__(self, log: logging.Logger, what: str, *, level: int = logging.INFO,
                 interval_s: float = SUMMARY_INTERVAL_S) -> None:  # fmt: skip
        self.log, self.level, self.what, self.interval_s = log, level, what, interval_s
        self.total = 0
        self._pending = self._pending_times = 0
        self._last_line_at = None

    def add(self, n: int = 1, *, exc_info: BaseException | None = None, **fields: object) -> None:
        """Count ``n`` more (``fields`` fill the other placeholders of ``what``); log when the interval is over.
        ``exc_info``: an exception whose traceback goes with the first line only (the summaries stay one line)."""
        self.total += n
        self._pending += n
        self._pending_times += 1
        now = time.monotonic()
        if self._last_line_at is None:  # the first occurrence: at once, as it is
            self._emit(now, fields, first=True, exc_info=exc_info)
        elif now - self._last_line_at >= self.interval_s:
            self._emit(now, fields, first=False)

    def flush(self, **fields: object) -> None:
        """Log what was counted since the last line (at the end of a phase or of the process)."""
        if self._pending and self._last_line_at is not None:
            self._emit(time.monotonic(), fields, first=False)

    def _emit(self, now: float, fields: dict[str, object], *, first: bool, exc_info: BaseException | None = None) -> None:
        line = self.what.format(n=f"{self._pending:,}", **fields)
        if not first:
            line += f" ({self._pending_times} times in the last {now - (self._last_line_at or now):.0f}s)"
        self.log.log(self.level, "%s", line, exc_info=exc_info)
        self._pending = self._pending_times = 0
        self._last_line_at = now
