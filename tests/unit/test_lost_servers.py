"""A process that lost a server names it, Redis or NATS with its URL (issue 37): every failure inside what ended it
is looked at, not only the first task's (the learner used to blame NATS for a Redis that was gone)."""

from __future__ import annotations

import nats.errors
import redis.exceptions

from async_rl.process.lifecycle import TaskFailed
from async_rl.servers.reach import REDIS_RETRIES, describe_failure

REDIS, NATS = "redis://:pw@db:6379/0", "nats://u:pw@db:4222"


def _raised(exc: BaseException, task: str) -> TaskFailed:
    try:
        try:
            raise exc
        except Exception as inner:
            raise TaskFailed(task, inner) from inner
    except TaskFailed as failed:
        return failed


def test_each_lost_server_is_named() -> None:
    refused = redis.exceptions.ConnectionError("Error 111 connecting to db:6379. Connection refused.")
    reconnecting = nats.errors.ConnectionReconnectingError()
    both = ExceptionGroup("tasks", [_raised(reconnecting, "heartbeat"), _raised(refused, "work")])
    assert describe_failure(both, REDIS, NATS) == (
        f"lost Redis at redis://***@db:6379/0 after {REDIS_RETRIES} retries: nothing is listening (connection refused); "
        "lost NATS at nats://***@db:4222: ConnectionReconnectingError: nats: connection reconnecting")
    only_redis = ExceptionGroup("tasks", [_raised(refused, "work")])
    assert describe_failure(only_redis, REDIS, NATS).startswith("lost Redis at redis://***@db:6379/0")  # type: ignore[union-attr]
    nested = BaseExceptionGroup("outer", [ExceptionGroup("inner", [_raised(reconnecting, "publish")])])
    assert describe_failure(nested, REDIS, NATS) == ("lost NATS at nats://***@db:4222: ConnectionReconnectingError: "
                                                     "nats: connection reconnecting")  # fmt: skip
    assert describe_failure(ValueError("a bug"), REDIS, NATS) is None
