"""The NATS control plane: message codec, and round trips through a real NATS server."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from async_rl.run.names import Names
from async_rl.servers.control import (
    Control,
    ControlPlane,
    ControlPlaneConfig,
    Heartbeat,
    JoinRefused,
    LearnerProgress,
    Message,
    MessageError,
    RunEnded,
    ScalingSignal,
    WeightsAnnounced,
    decode,
    encode,
)
from async_rl.servers.embedded import ServerSet, free_port


def test_every_message_kind_round_trips() -> None:
    msgs: list[Message] = [
        WeightsAnnounced(version=3, manifest_key="p:weights:3:manifest", total_bytes=10, num_buckets=1),
        Heartbeat(generator_id="g1", engine="torch", version=3, tokens_per_s=12.5, in_flight=4, started_at=1.0),
        Control(action="drain", target="g1", reason="scale down"),
        LearnerProgress(step=7, version=3, metrics={"reward": 0.5, "loss": 1.25}),
        RunEnded(step=40, version=40, reason="max_steps"),
        JoinRefused(generator_id="g2", reason="model 'small-moe' does not match run 'mc'"),
        ScalingSignal(step=9, wait_share=0.4, backlog_groups=3, backlog_batches=0.375, generators=2,
                      suggested_generators=4, decision="up", reason="wait share 0.40 > 0.20"),
    ]
    for msg in msgs:
        back = decode(encode(msg))
        assert back == msg and type(back) is type(msg)
    hb = decode(encode(msgs[1]))
    assert isinstance(hb, Heartbeat) and hb.host and hb.pid > 0 and hb.sent_at > 0


def test_bad_messages_are_refused_with_a_reason() -> None:
    with pytest.raises(MessageError, match="not msgpack"):
        decode(b"\xc1")
    with pytest.raises(MessageError, match="must be a map"):
        decode(msgpack.packb([1, 2]))
    with pytest.raises(MessageError, match="kind 'nope'"):
        decode(msgpack.packb({"kind": "nope"}))
    with pytest.raises(MessageError, match=r"unknown field\(s\) \['extra'\]"):
        decode(msgpack.packb({"kind": "control", "action": "stop", "extra": 1}))
    with pytest.raises(MessageError, match="weights.version must be int"):
        decode(msgpack.packb({"kind": "weights", "version": "3", "manifest_key": "k", "total_bytes": 1}))
    with pytest.raises(MessageError, match="missing"):
        decode(msgpack.packb({"kind": "weights", "version": 3}))
    with pytest.raises(MessageError, match="control.action"):
        decode(msgpack.packb({"kind": "control", "action": "explode"}))
    with pytest.raises(MessageError, match="control.action"):
        Control(action="reboot")


def test_control_targets() -> None:
    assert Control(action="stop").applies_to("g7")
    assert Control(action="stop", target="g7").applies_to("g7")
    assert not Control(action="stop", target="g7").applies_to("g8")


async def test_heartbeats_and_commands_round_trip(servers: ServerSet, names: Names) -> None:
    beats: asyncio.Queue[Message] = asyncio.Queue()
    commands: asyncio.Queue[Message] = asyncio.Queue()

    async def on_beat(msg: Message) -> None:
        await beats.put(msg)

    async def on_command(msg: Message) -> None:
        await commands.put(msg)

    async with ControlPlane(servers.nats_url, name="status") as status, ControlPlane(servers.nats_url) as gen:
        await status.subscribe(names.heartbeat_subject, on_beat, kinds=(Heartbeat,))
        await gen.subscribe(names.control_subject, on_command, kinds=(Control,))
        await status.flush()
        await gen.flush()
        sent = Heartbeat(generator_id="gen-a", engine="torch", version=2, tokens_per_s=100.0, in_flight=3)
        await gen.publish(names.heartbeat_subject, sent)
        # A message of another kind on the same subject is filtered out, a garbage one is counted.
        await gen.publish(names.heartbeat_subject, LearnerProgress(step=1, version=1))
        await gen.nc.publish(names.heartbeat_subject, b"garbage")
        await gen.publish(names.heartbeat_subject, Heartbeat(generator_id="gen-b"))
        got = [await asyncio.wait_for(beats.get(), 5), await asyncio.wait_for(beats.get(), 5)]
        assert got[0] == sent and isinstance(got[1], Heartbeat) and got[1].generator_id == "gen-b"
        assert status.num_bad_messages == 1
        await status.publish(names.control_subject, Control(action="pause", target="gen-a"))
        cmd = await asyncio.wait_for(commands.get(), 5)
        assert isinstance(cmd, Control) and cmd.action == "pause" and cmd.applies_to("gen-a")


async def test_a_failing_handler_does_not_kill_the_subscription(servers: ServerSet, names: Names) -> None:
    seen: asyncio.Queue[int] = asyncio.Queue()

    async def handler(msg: Message) -> None:
        assert isinstance(msg, LearnerProgress)
        if msg.step == 1:
            raise RuntimeError("handler bug")
        await seen.put(msg.step)

    async with ControlPlane(servers.nats_url) as cp:
        await cp.subscribe(names.learner_subject, handler)
        await cp.flush()
        for step in (1, 2):
            await cp.publish(names.learner_subject, LearnerProgress(step=step, version=step))
        assert await asyncio.wait_for(seen.get(), 5) == 2
        assert cp.num_handler_errors == 1


async def test_connect_gives_up_with_a_clear_error() -> None:
    cp = ControlPlane(
        f"nats://127.0.0.1:{free_port()}",
        cfg=ControlPlaneConfig(connect_attempts=2, max_backoff_s=0.1, connect_timeout_s=0.5),
    )
    with pytest.raises(ConnectionError, match="cannot connect to NATS"):
        await cp.connect()
    with pytest.raises(RuntimeError, match="not connected"):
        await cp.publish("x", Control(action="stop"))
    with pytest.raises(ValueError, match="control.connect_attempts"):
        ControlPlaneConfig(connect_attempts=0)
