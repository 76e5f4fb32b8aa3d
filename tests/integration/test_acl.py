"""``async-rl acl`` on a real Valkey: each role runs its own code paths with its credentials; a generator's
credentials cannot write prompts, delete keys, write weights, or touch another prefix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
import torch
from redis.exceptions import NoPermissionError, ResponseError

from actors.commands.acl import main as acl_main
from async_rl.run.lease import LeaseConfig, RunLease
from async_rl.run.names import Names
from async_rl.servers.embedded import EmbeddedServer, _spawn, free_port, valkey_binary
from async_rl.weights import WeightPublisher, WeightReader
from async_rl.weights.peer.topology import RelayEntry, Topology
from async_rl.weights.redis_transport import RedisTransport
from async_rl.wire import PromptSpec
from buffer.audit import audit_run
from buffer.entry_checks import EntryChecker, ModelFacts
from buffer.evals import EvalQueue, EvalResult
from buffer.prompts import PromptQueue, PromptQueueConfig
from buffer.rollout_writer import RolloutWriter, RolloutWriterConfig
from buffer.rollouts import RolloutReader
from buffer.stats import buffer_stats
from tests.integration.poison import valid_record

FACTS = ModelFacts(vocab_size=22, max_seq_len=64, num_moe_layers=2, top_k=2, num_experts=4)


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[tuple[Names, dict[str, str]]]:
    """A Valkey loaded with the ACL file ``async-rl acl`` wrote for a fresh run prefix; role -> URL."""
    names = Names(prefix=f"t-acl-{uuid.uuid4().hex[:8]}")
    assert acl_main(["--run", names.prefix, "--out", str(tmp_path / "acl")]) == 0
    acl = tmp_path / "acl" / "users.acl"
    port = free_port()
    proc = _spawn("valkey", [str(valkey_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--aclfile", str(acl)], port, tmp_path)  # fmt: skip
    server = EmbeddedServer("valkey", f"redis://127.0.0.1:{port}/0", proc, tmp_path / "data", tmp_path / "valkey.log")
    urls = {}
    for role in ("learner", "generator", "reader", "admin"):
        password = (tmp_path / "acl" / f"{role}.password").read_text().strip()
        assert (tmp_path / "acl" / f"{role}.password").stat().st_mode & 0o077 == 0
        assert password not in acl.read_text()  # only its hash is in the ACL file
        urls[role] = f"redis://{names.prefix}-{role}:{password}@127.0.0.1:{port}/0"
    yield names, urls
    server.stop()


async def test_each_role_runs_its_code_paths_and_nothing_more(locked: tuple[Names, dict[str, str]],
                                                              tmp_path: Path) -> None:  # fmt: skip
    names, urls = locked
    learner = aioredis.Redis.from_url(urls["learner"])
    gen = aioredis.Redis.from_url(urls["generator"])
    reader_client = aioredis.Redis.from_url(urls["reader"])
    lease = RunLease(urls["learner"], names, LeaseConfig(), run_dir=tmp_path)
    try:
        # Learner: takes the run's lease, issues prompts and publishes weights under its fence.
        lease.take()
        fence = lease.fence
        specs = [PromptSpec(f"p{i}", np.array([1, 2, 3], dtype=np.int32)) for i in range(4)]
        await PromptQueue(learner, names, fence=fence).issue(specs, version=0)
        # A poison prompt, issued by hand (undecodable spec): the generator's dead letter gives it its fate.
        await learner.hset(names.audit_open, "p-bad", "0-0|0|0")
        await learner.hincrby(names.audit_counters, "issued", 1)
        await learner.xadd(names.prompts_stream, {b"spec": b"\x93bad", b"pid": b"p-bad"})
        weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
        await WeightPublisher(learner, RedisTransport(urls["learner"], names), names, fence=fence).publish(weights, 0)
        # Generator: reads (and sets the poison prompt aside), appends inline and by key, acks, touches, releases,
        # reads weights under a lease.
        q = PromptQueue(gen, names, PromptQueueConfig(reclaim_idle_ms=1))
        got = await q.read("gen-a", count=10)
        assert [e.spec.prompt_id for e in got] == ["p0", "p1", "p2", "p3"]
        assert await q.touch("gen-a", got[:1]) == 1
        small = RolloutWriter(gen, names)
        large = RolloutWriter(gen, names, RolloutWriterConfig(inline_max_bytes=0))
        for i, e in enumerate(got[:3]):
            rec = valid_record(e.spec.prompt_id, e.spec.prompt_ids, FACTS, version=0, num_samples=2, seed=i)
            await (large if i == 2 else small).append(rec)
        assert await q.ack(got[:3]) == 3
        assert await q.release(got[3:]) == 1
        # Evaluation: the learner issues a round; the generator scores it (result, ack and fate in one transaction).
        await EvalQueue(learner, names).issue([PromptSpec("e0@v0", np.array([1, 2], dtype=np.int32))], version=0)
        evals = EvalQueue(gen, names)
        (entry,) = await evals.read("gen-a", 10)
        await evals.finish(entry, EvalResult(prompt_id="e0@v0", round=0, label="copy", rewards=[1.0]))
        assert [r.prompt_id for r in (await EvalQueue(learner, names).results("0-0"))[0]] == ["e0@v0"]
        gen_reader = WeightReader(gen, RedisTransport(urls["generator"], names), names)
        fetched = await gen_reader.fetch()
        assert torch.equal(fetched.tensors["w"], weights["w"])
        assert await gen_reader.request_full()  # a late joiner may ask for a full version, and nothing else
        assert await learner.zcard(names.weights_want_full) == 1
        # Peer relay: two generators register as sources of v0 and one picks the other as its parent.
        sync_gen = redis.Redis.from_url(urls["generator"])
        try:
            a = Topology(sync_gen, names.weights_relays, "gen-a", ttl_s=30)
            b = Topology(sync_gen, names.weights_relays, "gen-b", ttl_s=30)
            a.put(0, RelayEntry(tcp="10.0.0.1:1", unix="", host="h1", fanout=2, have=1, done=1, lo=0, hi=1))
            b.put(0, RelayEntry(tcp="10.0.0.2:1", unix="", host="h2", fanout=2))
            src = b.pick(0, want=0, exclude=set())
            assert src is not None and src.peer_id == "gen-a"
            b.leave(0)
        finally:
            sync_gen.close()
        # Learner: reads, checks, commits.
        r = RolloutReader(learner, names, checker=EntryChecker(FACTS, num_samples=2, max_version=0),
                          check_issued=True, fence=fence)  # fmt: skip
        entries = await r.read("learner", count=10)
        assert len(entries) == 3
        await r.ack(entries, fates=[(e.record.prompt_id, "step 1") for e in entries])
        # Reader (status, audit): reads everything of the run, writes nothing.
        report = await audit_run(reader_client, names)
        assert report["ok"] and report["counters"] == {"issued": 5, "trained": 3, "dropped_stale": 0,
                                                       "dead_lettered": 1, "in_flight": 1}  # fmt: skip
        assert (await buffer_stats(reader_client, names))["rollouts"]["consumed"] == 3
        with pytest.raises(NoPermissionError):
            await reader_client.xadd(names.rollouts_stream, {b"x": b"1"})
        assert lease.release()
    finally:
        for c in (learner, gen, reader_client):
            await c.aclose()


def test_a_generator_cannot_write_prompts_delete_keys_or_leave_its_prefix(
    locked: tuple[Names, dict[str, str]],
) -> None:
    names, urls = locked
    admin = redis.Redis.from_url(urls["admin"])
    other = Names(prefix="t-other-run")
    admin.set(other.weights_latest, b"7")
    admin.set(names.rollout_payload("ab" * 16), b"payload")
    admin.set(names.weights_manifest(0), b"manifest")
    gen = redis.Redis.from_url(urls["generator"])
    denied = [
        ("XADD", names.prompts_stream, "*", "spec", "x"),  # write prompts
        ("DEL", names.rollout_payload("ab" * 16)),  # delete keys
        ("UNLINK", names.rollouts_stream),
        ("SET", names.weights_latest, "99"),  # write weights
        ("SET", names.weights_bucket(0, 0), "x"),
        ("HSET", names.learner_state, "step", "1"),
        ("GET", other.weights_latest),  # another prefix
        ("SET", other.rollout_payload("cd" * 16), "x"),
        ("XADD", other.rollouts_stream, "*", "rec", "x"),
        ("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "*"), ("SCAN", "0"), ("ACL", "LIST"),  # administration
        ("EVAL", "return redis.call('DEL', KEYS[1])", "1", names.rollout_payload("ab" * 16)),  # through a script
        ("EVAL", "return redis.call('PEXPIREAT', KEYS[1], 1)", "2", names.weights_manifest(0), names.weights_readers(0)),
        ("EVAL", "return redis.call('SET', KEYS[1], 'x')", "2", names.weights_manifest(0), names.weights_readers(0)),
        ("PEXPIREAT", names.weights_manifest(0), "1"),
    ]
    for cmd in denied:
        with pytest.raises((NoPermissionError, ResponseError)) as info:
            gen.execute_command(*cmd)
        assert "permission" in str(info.value).lower() or "NOPERM" in str(info.value), (cmd, info.value)
    assert admin.get(other.weights_latest) == b"7" and admin.get(names.rollout_payload("ab" * 16)) == b"payload"
    assert admin.get(names.weights_manifest(0)) == b"manifest" and admin.ttl(names.weights_manifest(0)) == -1
    # Wrong password: refused.
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(urls["generator"].replace(":", ":x", 2).replace("redis:x//", "redis://")).ping()
    gen.close()
    admin.close()


async def test_nats_users_give_each_role_only_its_subjects(tmp_path: Path) -> None:
    """The NATS half of ``async-rl acl`` on a real nats-server: the generator publishes heartbeats and hears weights and
    control, and is refused publishing weights or control, listening to heartbeats, or any other run's subjects."""
    import asyncio

    import nats

    from async_rl.servers.control import ControlPlane, Heartbeat, Message, WeightsAnnounced
    from async_rl.servers.embedded import nats_binary

    names = Names(prefix=f"t-nacl-{uuid.uuid4().hex[:8]}")
    out = tmp_path / "acl"
    assert acl_main(["--run", names.prefix, "--out", str(out)]) == 0
    conf = out / "nats-users.conf"
    assert conf.stat().st_mode & 0o077 == 0
    port = free_port()
    server = EmbeddedServer("nats", "", _spawn("nats", [str(nats_binary()), "-a", "127.0.0.1", "-p", str(port), "-c",
                                                        str(conf)], port, tmp_path), tmp_path, tmp_path / "nats.log")  # fmt: skip

    def url(role: str) -> str:
        return f"nats://{names.prefix}-{role}:{(out / f'{role}.password').read_text().strip()}@127.0.0.1:{port}"

    try:
        # Allowed paths, through the project's own control plane: heartbeats reach the learner, weights the generator.
        async with ControlPlane(url("learner")) as learner, ControlPlane(url("generator")) as gen:
            got: asyncio.Queue[Message] = asyncio.Queue()

            async def put(m: Message) -> None:
                await got.put(m)

            await learner.subscribe(names.heartbeat_subject, put)
            await gen.subscribe(names.weights_subject, put)
            await learner.flush()
            await gen.flush()
            await gen.publish(names.heartbeat_subject, Heartbeat(generator_id="g", engine="torch", version=0))
            await learner.publish(names.weights_subject, WeightsAnnounced(version=1, manifest_key="k", total_bytes=1))
            kinds = {type(await asyncio.wait_for(got.get(), 10)).__name__ for _ in range(2)}
            assert kinds == {"Heartbeat", "WeightsAnnounced"}

        # Refused: every violation comes back from the server as a permissions error.
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        other = Names(prefix="another-run")
        nc = await nats.connect(url("generator"), error_cb=on_error, allow_reconnect=False)
        try:
            for subject in (names.weights_subject, names.control_subject, other.heartbeat_subject):
                await nc.publish(subject, b"x")
            for subject in (names.heartbeat_subject, other.weights_subject):
                await nc.subscribe(subject)
            await nc.flush(timeout=5)
            await asyncio.sleep(0.5)
        finally:
            await nc.close()
        joined = "\n".join(errors).lower()
        for subject in (names.weights_subject, names.control_subject, other.heartbeat_subject):
            assert f'publish to "{subject}"' in joined, errors
        for subject in (names.heartbeat_subject, other.weights_subject):
            assert f'subscription to "{subject}"' in joined, errors
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url("generator").replace("@", "x@"), allow_reconnect=False, max_reconnect_attempts=0)
    finally:
        server.stop()
