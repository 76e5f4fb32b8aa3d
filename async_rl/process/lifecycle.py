"""Structured lifecycle of a process's long-lived tasks.

Every long-lived task runs in a ``TaskGroup`` owned by its process. A background task that fails
(the weight fetch, the heartbeat) must end the process with a clear error instead of dying while
the rest still looks healthy: :func:`named_task` wraps its coroutine so that the failure reaches
the TaskGroup as a :class:`TaskFailed` naming the task, the TaskGroup cancels its siblings, and the
entry point prints that one line and exits non-zero for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")


class StartupError(RuntimeError):
    """A process cannot start as configured (a port taken, a file missing): the message is the one line to print."""


class TaskFailed(RuntimeError):
    """A named long-lived task of a process failed; the message names the task and its error."""

    task: str

    def __init__(self, task: str, cause: BaseException) -> None:
        while isinstance(cause, BaseExceptionGroup) and cause.exceptions:  # a task's own TaskGroup: name the leaf
            cause = cause.exceptions[0]
        super().__init__(f"the {task} task failed: {type(cause).__name__}: {cause}")
        self.task = task


async def named_task(name: str, coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro``; any exception (not cancellation) is re-raised as :class:`TaskFailed` naming ``name``."""
    try:
        return await coro
    except Exception as exc:
        raise TaskFailed(name, exc) from exc


def raise_if_cancel_requested() -> None:
    """Raise ``CancelledError`` when the current task was asked to cancel but is still running.

    A loop calls this once per iteration: redis-py (8.1 seen here) swallows a cancellation that arrives while it
    opens a new pooled connection, and Python 3.11's ``asyncio.wait_for`` one that races its inner future's
    completion, so a TaskGroup's cancel of the loop (after a sibling failed) can be lost and the loop would run on
    forever; the task's own ``cancelling()`` count still says it was asked.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def first_task_failure(group: BaseExceptionGroup) -> TaskFailed | None:
    """The first :class:`TaskFailed` inside an exception group (nested groups included), or None."""
    for exc in group.exceptions:
        if isinstance(exc, TaskFailed):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = first_task_failure(exc)
            if found is not None:
                return found
    return None


def redact_url(url: str | None) -> str:
    """``url`` without its user and password, for log lines and errors (credentials are never printed)."""
    if not url:
        return str(url)
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
