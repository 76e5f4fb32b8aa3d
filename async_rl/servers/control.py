"""The NATS control plane: typed msgpack messages and a small wrapper over nats-py.

Every message is a dataclass with a ``kind`` literal; on the wire it is a msgpack map of its
fields plus ``kind``. Subjects come from :class:`~async_rl.run.names.Names`: weight announcements on
``weights_subject``, generator heartbeats on ``heartbeat_subject``, commands on
``control_subject`` (and the end of the run, :class:`RunEnded`), learner progress on ``learner_subject``, the
learner's scaling signal on ``scaling_subject``. Core NATS (no JetStream): messages
are hints and liveness signals, never the only copy of anything (the weight version of record is
``weights:latest`` in Redis, which generators also poll).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgpack

from async_rl.process.lifecycle import redact_url

log = logging.getLogger(__name__)

CONTROL_SCHEMA = 1


class ControlPlaneLost(ConnectionError):
    """The NATS connection closed after its reconnect attempts were spent; the message names the URL."""


class MessageError(ValueError):
    """A control message that cannot be decoded (unknown kind, missing or mistyped field)."""


@dataclass(kw_only=True, slots=True)
class WeightsAnnounced:
    """A weight version became complete and visible."""

    kind: ClassVar[Literal["weights"]] = "weights"
    version: int
    """The new version."""
    manifest_key: str
    """Redis key of its manifest."""
    total_bytes: int
    """Bytes of all its buckets."""
    num_buckets: int = 0
    """Number of buckets."""
    transport: str = "redis"
    """Transport holding the bucket bytes."""
    sent_at: float = field(default_factory=time.time)
    """Unix time of the announcement."""


@dataclass(kw_only=True, slots=True)
class Heartbeat:
    """A generator is alive: what it runs and how fast."""

    kind: ClassVar[Literal["heartbeat"]] = "heartbeat"
    generator_id: str
    """Unique id of the generator process."""
    host: str = field(default_factory=socket.gethostname)
    """Host name."""
    pid: int = field(default_factory=os.getpid)
    """Process id on that host."""
    engine: str = ""
    """Engine name ('torch', 'vllm')."""
    version: int = -1
    """Weight version in use."""
    tokens_per_s: float = 0.0
    """Generated tokens per second over the last heartbeat interval."""
    in_flight: int = 0
    """Prompts being generated."""
    state: str = "running"
    """'starting' | 'running' | 'paused' | 'draining' | 'stopping'."""
    weight_failures: int = 0
    """Weight versions refused so far (incomplete or corrupt)."""
    swap_pause_ms: float = 0.0
    """Generation pause of the last weight swap."""
    fetch_s: float = 0.0
    """Time the last weight version took to fetch and verify."""
    interval_s: float = 0.0
    """Seconds between this generator's heartbeats (0: not said): three missed ones mean it is gone."""
    reclaim_idle_ms: int = 0
    """The generator's ``prompts.reclaim_idle_ms``: when others take over what it holds if it vanishes."""
    started_at: float = 0.0
    """Unix time the generator started."""
    generate_s: float = 0.0
    """Seconds spent in the engine generating since start: its growth over wall time is the busy share."""
    version_wait_s: float = 0.0
    """Seconds spent waiting for the weight version a prompt asked for (synchronous mode) since start."""
    staged_latency_s: list[float] = field(default_factory=list)
    """For each weight version staged since the previous heartbeat: seconds from the learner's snapshot of it to
    its hand-over to the engine (fetched and verified)."""
    applied_latency_s: list[float] = field(default_factory=list)
    """For each weight version swapped in since the previous heartbeat: seconds from the learner's snapshot of it
    to the swap (same host: one clock)."""
    standby_load_s: list[float] = field(default_factory=list)
    """For each weight version swapped in since the previous heartbeat: seconds the engine took to copy it into its
    standby weights (engines with a standby: the torch engine)."""
    swap_wait_s: list[float] = field(default_factory=list)
    """For each of those versions: seconds from loaded in the standby to swapped in (the next step boundary)."""
    swap_pauses_ms: list[float] = field(default_factory=list)
    """For each swap since the previous heartbeat, milliseconds generation stood still (engines that report each:
    vLLM's); ``swap_pause_ms`` is the last one."""
    loop_lag_ms: float = 0.0
    """The generator's event loop's largest lateness since the previous heartbeat (a 10 ms timer's): every RPC reply,
    weight notice and swap of the generator waits that long more (:mod:`async_rl.process.loop_lag`)."""
    sent_at: float = field(default_factory=time.time)
    """Unix time of this heartbeat."""


@dataclass(kw_only=True, slots=True)
class JoinRefused:
    """A generator refused to join the run (its model does not match the run's): sent on ``heartbeat_subject``
    before it exits, so that the learner's log says so too."""

    kind: ClassVar[Literal["join_refused"]] = "join_refused"
    generator_id: str
    """Unique id of the generator process."""
    host: str = field(default_factory=socket.gethostname)
    """Host name."""
    pid: int = field(default_factory=os.getpid)
    """Process id on that host."""
    reason: str
    """The one line the generator printed."""
    sent_at: float = field(default_factory=time.time)
    """Unix time of the refusal."""


ControlAction = Literal["pause", "resume", "drain", "stop"]


@dataclass(kw_only=True, slots=True)
class Control:
    """A command to generators: ``target`` is a generator id or '*' for all."""

    kind: ClassVar[Literal["control"]] = "control"
    action: str
    """'pause' | 'resume' | 'drain' | 'stop'."""
    target: str = "*"
    """Generator id, or '*' for every generator."""
    reason: str = ""
    """Free text for logs."""
    sent_at: float = field(default_factory=time.time)
    """Unix time of the command."""

    def __post_init__(self) -> None:
        if self.action not in ("pause", "resume", "drain", "stop"):
            raise MessageError(f"control.action must be one of pause/resume/drain/stop, got {self.action!r}")

    def applies_to(self, generator_id: str) -> bool:
        return self.target in ("*", generator_id)


@dataclass(kw_only=True, slots=True)
class LearnerProgress:
    """The learner finished an optimizer step."""

    kind: ClassVar[Literal["learner"]] = "learner"
    step: int
    """Optimizer steps so far."""
    version: int
    """Weight version after the step."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scalar metrics of the step (reward, loss, staleness, ...)."""
    sent_at: float = field(default_factory=time.time)
    """Unix time of the event."""


@dataclass(kw_only=True, slots=True)
class RunEnded:
    """The learner reached the end of the run (``max_steps`` or ``target_reward``): its generators may leave.

    Sent on ``control_subject`` after the final commit; the record of it is kept in Redis too
    (:mod:`async_rl.run.end`), so a generator that missed the message, or starts later, still learns it.
    A learner stopped by a signal is not an end of the run (a successor may resume it) and sends nothing.
    """

    kind: ClassVar[Literal["run_ended"]] = "run_ended"
    step: int
    """Optimizer steps of the run."""
    version: int
    """Final weight version."""
    reason: str
    """Why the run ended: 'max_steps' | 'target_reward'."""
    sent_at: float = field(default_factory=time.time)
    """Unix time the run ended."""


@dataclass(kw_only=True, slots=True)
class ScalingSignal:
    """How starved the learner is for rollouts, and how many generators would keep it busy (any autoscaler's input).

    Computed by the learner over its last ``scaling.window_steps`` steps (:mod:`async_rl.metrics.scaling`), sent on
    ``scaling_subject`` after every step and kept in Redis for ``async-rl status``.
    """

    kind: ClassVar[Literal["scaling"]] = "scaling"
    step: int
    """Learner step the signal was computed at."""
    wait_share: float
    """Share of the learner's wall time spent waiting for rollouts (0: never waits, 1: only waits)."""
    backlog_groups: int
    """Groups in the rollout stream not yet read by the learner when it began collecting its last batch."""
    backlog_batches: float
    """The same in batches of ``batch_groups``."""
    generators: int
    """Generators alive (heartbeats of the last ``scaling.heartbeat_timeout_s``)."""
    suggested_generators: int
    """How many generators the policy suggests (equal to ``generators`` when nothing should change)."""
    decision: str
    """'up' | 'down' | 'hold', with the policy's thresholds in ``reason``."""
    reason: str = ""
    """One line: which threshold decided."""
    sent_at: float = field(default_factory=time.time)
    """Unix time of the signal."""


Message = WeightsAnnounced | Heartbeat | Control | LearnerProgress | RunEnded | ScalingSignal | JoinRefused
MESSAGE_TYPES: dict[str, type] = {
    cls.kind: cls
    for cls in (WeightsAnnounced, Heartbeat, Control, LearnerProgress, RunEnded, ScalingSignal, JoinRefused)
}
_TYPES_OK: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (float, int),
    "str": (str,),
    "dict[str, float]": (dict,),
}


def encode(msg: Message) -> bytes:
    d: dict[str, Any] = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    d["kind"] = msg.kind
    d["schema"] = CONTROL_SCHEMA
    return msgpack.packb(d)


def decode(data: bytes) -> Message:
    """Decode one message; raises :class:`MessageError` naming what is wrong."""
    try:
        d = msgpack.unpackb(data)
    except (msgpack.UnpackException, ValueError) as exc:
        raise MessageError(f"control message is not msgpack: {exc!r}") from exc
    if not isinstance(d, dict):
        raise MessageError(f"control message must be a map, got {type(d).__name__}")
    kind = d.pop("kind", None)
    d.pop("schema", None)
    cls = MESSAGE_TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise MessageError(f"control message kind {kind!r} is not one of {sorted(MESSAGE_TYPES)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise MessageError(f"{kind} message has unknown field(s) {unknown}")
    for name, value in d.items():
        ok = _TYPES_OK.get(str(fields[name].type))
        if ok is not None and (not isinstance(value, ok) or isinstance(value, bool)):
            raise MessageError(f"{kind}.{name} must be {fields[name].type}, got {value!r}")
    try:
        return cls(**d)
    except TypeError as exc:
        raise MessageError(f"{kind} message: {exc}") from exc


Handler = Callable[[Message], Awaitable[None]]


@dataclass(kw_only=True, slots=True)
class ControlPlaneConfig:
    """How a process connects to NATS."""

    connect_attempts: int = 10
    """Connection attempts before giving up (with capped exponential backoff between them)."""
    connect_timeout_s: float = 5.0
    """Time limit of one connection attempt."""
    max_backoff_s: float = 5.0
    """Cap of the backoff between connection attempts."""

    max_reconnect_attempts: int = 30
    """After a connection is lost: reconnect attempts (``reconnect_wait_s`` apart) before the connection closes
    and the process exits for its supervisor to restart it (no silent waiting)."""
    reconnect_wait_s: float = 2.0
    """Pause between reconnect attempts."""

    def __post_init__(self) -> None:
        if self.connect_attempts < 1:
            raise ValueError("control.connect_attempts must be >= 1")
        if self.max_reconnect_attempts < 1:
            raise ValueError("control.max_reconnect_attempts must be >= 1")
        if self.reconnect_wait_s <= 0:
            raise ValueError("control.reconnect_wait_s must be > 0")
        if self.max_backoff_s <= 0:
            raise ValueError("control.max_backoff_s must be > 0")
        if self.connect_timeout_s <= 0:
            raise ValueError("control.connect_timeout_s must be > 0")


class ControlPlane:
    """A NATS connection that publishes and subscribes to typed messages."""

    url: str
    name: str
    cfg: ControlPlaneConfig
    num_bad_messages: int
    num_handler_errors: int
    _nc: Any
    _closing: bool
    _lost: bool

    def __init__(self, url: str, *, name: str = "async-rl", cfg: ControlPlaneConfig | None = None) -> None:
        self.url = url
        self.name = name
        self.cfg = cfg or ControlPlaneConfig()
        self.num_bad_messages = 0
        self.num_handler_errors = 0
        self._nc = None
        self._closing = False
        self._lost = False

    async def connect(self) -> ControlPlane:
        import nats

        backoff_s = 0.1
        for attempt in range(1, self.cfg.connect_attempts + 1):
            try:
                # Reconnects after a first success are nats-py's job (bounded, buffered publishes); once they are
                # spent the connection closes and publishing raises. The time limit bounds the first connect.
                self._nc = await asyncio.wait_for(
                    nats.connect(
                        self.url,
                        name=self.name,
                        connect_timeout=self.cfg.connect_timeout_s,
                        max_reconnect_attempts=self.cfg.max_reconnect_attempts,
                        reconnect_time_wait=self.cfg.reconnect_wait_s,
                        allow_reconnect=True,
                        error_cb=self._on_error,
                        closed_cb=self._on_closed,
                    ),
                    self.cfg.connect_timeout_s,
                )
                return self
            except Exception as exc:  # retry boundary: DNS, refused, timeout, TLS, auth ...
                if attempt == self.cfg.connect_attempts:
                    raise ConnectionError(f"cannot connect to NATS at {redact_url(self.url)}: {exc!r}") from exc
                log.warning("NATS connect to %s failed (%r); retry %d in %.1fs", redact_url(self.url), exc, attempt,
                            backoff_s)  # fmt: skip
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.cfg.max_backoff_s)
        raise AssertionError("unreachable")

    async def _on_error(self, exc: Exception) -> None:
        log.warning("NATS %s: %r", redact_url(self.url), exc)

    async def _on_closed(self) -> None:
        if not self._closing:
            self._lost = True
            log.error("NATS %s: connection closed after %d reconnect attempts", redact_url(self.url),
                      self.cfg.max_reconnect_attempts)  # fmt: skip

    def check(self) -> None:
        """Raise :class:`ControlPlaneLost` once the connection has closed without :meth:`close` (loops call it, so
        a process whose NATS is gone exits for its supervisor instead of carrying on deaf)."""
        if self._lost:
            raise ControlPlaneLost(f"lost NATS at {redact_url(self.url)}: connection closed after "
                                   f"{self.cfg.max_reconnect_attempts} reconnect attempts")  # fmt: skip

    @property
    def nc(self) -> Any:
        if self._nc is None:
            raise RuntimeError("ControlPlane is not connected (call connect() first)")
        return self._nc

    async def publish(self, subject: str, msg: Message) -> None:
        await self.nc.publish(subject, encode(msg))

    async def flush(self, timeout_s: float = 5.0) -> None:
        await self.nc.flush(timeout=timeout_s)

    async def subscribe(self, subject: str, handler: Handler, *, kinds: tuple[type, ...] | None = None) -> Any:
        """Call ``handler`` for each decoded message (of ``kinds`` if given); returns the subscription."""

        async def on_msg(raw: Any) -> None:
            try:
                msg = decode(raw.data)
            except MessageError as exc:
                self.num_bad_messages += 1
                log.warning("dropped a bad control message on %s: %s", raw.subject, exc)
                return
            if kinds is not None and not isinstance(msg, kinds):
                return
            try:
                await handler(msg)
            except Exception:  # retry boundary: one bad message must not kill the subscription
                self.num_handler_errors += 1
                log.exception("control handler for %s failed on a %s message", subject, msg.kind)

        return await self.nc.subscribe(subject, cb=on_msg)

    async def close(self) -> None:
        self._closing = True
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.drain()
        self._nc = None

    async def __aenter__(self) -> ControlPlane:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
