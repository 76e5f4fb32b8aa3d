"""The ``peer://`` transport against real servers and processes: a relay chain, a corrupt peer, a relay killed
mid-transfer, a late joiner, and the network-namespace fan-out bench on a tiny configuration."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis
import torch
import xxhash

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.weights import PublisherConfig, WeightPublisher, WeightReader
from async_rl.weights.peer.store import Bucket, new_bucket_memory
from async_rl.weights.peer.topology import RelayEntry
from async_rl.weights.peer.transport import PeerTransport
from async_rl.weights.transport import TransportConfig, TransportError, make_transport

REPO = Path(__file__).resolve().parents[2]
BUCKET_BYTES = 64 << 10


def _model(seed: int, num: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layer.{i}.w": torch.randn(96, 160 + i, generator=g).to(torch.bfloat16) for i in range(num)}
    out["head.int"] = torch.randint(-9, 9, (300, 7), generator=g).to(torch.int32)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a
    )


def _peer(servers: ServerSet, names: Names, fanout: int, same_host: str = "tcp") -> PeerTransport:
    t = make_transport(
        TransportConfig(url=f"peer://127.0.0.1:0?fanout={fanout}&same_host={same_host}&ttl_s=5", timeout_s=20),
        servers.redis_url, names,
    )  # fmt: skip
    assert isinstance(t, PeerTransport)
    return t


def _publisher(r: aioredis.Redis, t: PeerTransport, names: Names) -> WeightPublisher:
    return WeightPublisher(r, t, names, PublisherConfig(bucket_bytes=BUCKET_BYTES, background=False, delta=False))


@pytest.mark.parametrize("same_host", ["tcp", "fd"])
async def test_relay_chain_is_bit_exact_and_the_publisher_sends_one_copy(
    servers: ServerSet, names: Names, redis_client: aioredis.Redis, same_host: str
) -> None:
    src = _model(1)
    pub_t = _peer(servers, names, fanout=1, same_host=same_host)
    kids = [_peer(servers, names, fanout=1, same_host=same_host) for _ in range(3)]
    try:
        manifest = await _publisher(redis_client, pub_t, names).publish(src, 1)
        assert manifest.num_buckets >= 4
        got = await asyncio.gather(*(WeightReader(redis_client, k, names).fetch(1) for k in kids))
        assert all(_same(src, f.tensors) for f in got)
        if same_host == "tcp":  # the publisher feeds one peer (fan-out 1); the peers feed the others
            assert await _settled(lambda: pub_t.bytes_sent, manifest.total_bytes) == manifest.total_bytes
            assert sorted(k.topology.entries[1].depth for k in kids)[:2] == [1, 2]
            relayed = await _settled(lambda: sum(k.bytes_sent for k in kids), 2 * manifest.total_bytes)
            assert relayed == 2 * manifest.total_bytes
        else:  # one host: memfds handed over, no bytes sent
            assert pub_t.bytes_sent == 0 and all(k.bytes_received == 0 for k in kids)
    finally:
        for t in [*kids, pub_t]:
            await t.close()


async def test_corrupt_bucket_from_a_peer_is_refused_and_fetched_from_another(
    servers: ServerSet, names: Names, redis_client: aioredis.Redis
) -> None:
    src = _model(2)
    pub_t = _peer(servers, names, fanout=1)
    bad = _peer(servers, names, fanout=1)
    child = _peer(servers, names, fanout=1)
    try:
        manifest = await _publisher(redis_client, pub_t, names).publish(src, 1)
        # A real peer that holds the version with bucket 2 flipped, and claims to be a finished generator (preferred).
        for i in range(manifest.num_buckets):
            fd, view = new_bucket_memory(manifest.buckets[i].nbytes, "bad")
            view[:] = pub_t.store.get(1, i).view  # type: ignore[union-attr]
            if i == 2:
                view[17] ^= 0xFF
            bad.store.add(1, i, Bucket(fd, view, view.nbytes, 0))
        bad.topology.put(1, RelayEntry(tcp=bad.tcp_address, unix=bad.server.unix_name, host=bad.host, fanout=1,
                                       depth=1, have=manifest.num_buckets, done=1))  # fmt: skip
        fetched = await WeightReader(redis_client, child, names).fetch(1)
        assert _same(src, fetched.tensors)
        assert child.num_corrupt == 1 and child.num_reattaches == 1
        bad_part = sum(b.nbytes for b in manifest.buckets[:3])
        assert await _settled(lambda: bad.bytes_sent, bad_part) >= bad_part  # buckets 0-2 (and what its socket took)
        rest = sum(b.nbytes for b in manifest.buckets[2:])
        assert await _settled(lambda: pub_t.bytes_sent, rest) == rest  # resumed at the bad bucket
    finally:
        for t in (child, bad, pub_t):
            await t.close()


async def _write_manifest(r: aioredis.Redis, names: Names, version: int, buckets: list[bytes]) -> None:
    body = {"checksum": "xxh3_64", "buckets": [[i, len(b), xxhash.xxh3_64_intdigest(b)] for i, b in enumerate(buckets)]}
    await r.set(names.weights_manifest(version), msgpack.packb(body))


def _start_relay(redis_url: str, prefix: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.peer_relay_proc", redis_url, prefix, "1",
         "peer://127.0.0.1:0?fanout=1&same_host=tcp&ttl_s=5"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


async def _settled(count: Callable[[], int], want: int, timeout_s: float = 10.0) -> int:
    """``count()`` once it reached ``want`` (or the deadline passed): a peer's server thread counts a bucket in
    ``bytes_sent`` after its last byte left the socket, so the child can hold the bucket before the count moves."""
    for _ in range(int(timeout_s / 0.01)):
        if count() >= want:
            break
        await asyncio.sleep(0.01)
    return count()


def _readline(proc: subprocess.Popen, want: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"relay process ended (rc {proc.poll()}) before {want!r}")
        if line.strip() == want:
            return
    raise AssertionError(f"relay process did not say {want!r} within {timeout_s}s")


async def test_relay_killed_mid_transfer_child_reattaches_and_resumes(
    servers: ServerSet, names: Names, redis_client: aioredis.Redis
) -> None:
    buckets = [os.urandom(BUCKET_BYTES + i) for i in range(8)]
    await _write_manifest(redis_client, names, 1, buckets)
    pub_t = _peer(servers, names, fanout=1)
    child = _peer(servers, names, fanout=1)
    relay = None
    try:
        for i in range(4):  # the publisher holds half of the version; the rest comes later
            await pub_t.put(1, i, memoryview(buckets[i]))
        relay = _start_relay(servers.redis_url, names.prefix)
        await asyncio.to_thread(_readline, relay, "have 3", 30)
        gets = [asyncio.create_task(child.get_checked(1, i, "xxh3_64", len(b))) for i, b in enumerate(buckets)]
        await asyncio.wait_for(asyncio.gather(*gets[:4]), 20)  # from the relay: the publisher's one slot is taken
        assert child.topology.entries[1].depth == 2
        relay.kill()
        relay.wait()
        t0 = time.monotonic()
        for i in range(4, 8):
            await pub_t.put(1, i, memoryview(buckets[i]))
        got = await asyncio.wait_for(asyncio.gather(*gets), 20)
        assert time.monotonic() - t0 < 10  # one re-attach, not a TTL expiry
        assert [bytes(view) for view, _ in got] == buckets
        assert [c for _, c in got] == [xxhash.xxh3_64_intdigest(b) for b in buckets]
        assert child.num_reattaches >= 1 and len(child.reattach_s) == 1 and child.reattach_s[0] < 5
        # Resumed at the bucket it was on: the publisher sent the relay the first half, the child the second.
        want = sum(len(b) for b in buckets[:4]) + sum(len(b) for b in buckets[4:])
        assert await _settled(lambda: pub_t.bytes_sent, want) == want
    finally:
        if relay is not None and relay.poll() is None:
            relay.kill()
            relay.wait()
        await child.close()
        await pub_t.close()


async def test_each_publishing_rank_serves_its_own_buckets(
    servers: ServerSet, names: Names, redis_client: aioredis.Redis
) -> None:
    buckets = [os.urandom(BUCKET_BYTES - 7 * i) for i in range(6)]
    await _write_manifest(redis_client, names, 1, buckets)
    ranks = [_peer(servers, names, fanout=1) for _ in range(2)]  # rank r writes buckets 3r..3r+2
    kids = [_peer(servers, names, fanout=1) for _ in range(2)]
    try:
        for i, b in enumerate(buckets):
            await ranks[i // 3].put(1, i, memoryview(b))
        got = await asyncio.gather(
            *(asyncio.gather(*(k.get(1, i) for i in range(len(buckets)))) for k in kids)
        )  # fmt: skip
        assert all([bytes(v) for v in views] == buckets for views in got)
        want = [sum(map(len, buckets[:3])), sum(map(len, buckets[3:]))]
        assert [await _settled(lambda r=r: r.bytes_sent, w) for r, w in zip(ranks, want, strict=True)] == want
        assert all(k.num_reattaches == 0 for k in kids)  # moving to the next rank is not a failure
    finally:
        for t in [*kids, *ranks]:
            await t.close()


async def test_buckets_larger_than_the_wakeup_size_arrive_whole_and_progress_reaches_redis(
    servers: ServerSet, names: Names, redis_client: aioredis.Redis
) -> None:
    """Buckets of several RECV_LOWAT_BYTES and an odd tail (the socket's low-water mark moves within a bucket and
    back for the next header), one empty; the child's progress is written off its receiving thread."""
    from async_rl.weights.peer.pull import RECV_LOWAT_BYTES

    sizes = [3 * RECV_LOWAT_BYTES + 12_345, RECV_LOWAT_BYTES, 0, RECV_LOWAT_BYTES - 1, 77]
    buckets = [os.urandom(n) for n in sizes]
    await _write_manifest(redis_client, names, 1, buckets)
    pub_t, child = _peer(servers, names, fanout=1), _peer(servers, names, fanout=1)
    try:
        for i, b in enumerate(buckets):
            await pub_t.put(1, i, memoryview(b))
        got = await asyncio.wait_for(
            asyncio.gather(*(child.get_checked(1, i, "xxh3_64", len(b)) for i, b in enumerate(buckets))), 20
        )
        assert [bytes(view) for view, _ in got] == buckets
        assert [c for _, c in got] == [xxhash.xxh3_64_intdigest(b) for b in buckets]
        assert child.bytes_received == sum(sizes)
        deadline = time.monotonic() + 10  # the pull writes "done" just after handing over its last bucket
        while (entry := json.loads(await redis_client.hget(names.weights_relays(1), child.peer_id)))["done"] != 1:
            assert time.monotonic() < deadline, entry
            await asyncio.sleep(0.05)
        assert entry["have"] == len(buckets) and entry["depth"] == 1
    finally:
        await child.close()
        await pub_t.close()


async def test_progress_is_noted_here_and_written_by_flush(servers: ServerSet, names: Names) -> None:
    import redis

    from async_rl.weights.peer.topology import Topology

    client = redis.Redis.from_url(servers.redis_url)
    topo = Topology(client, names.weights_relays, "peer-a", ttl_s=5)
    try:
        topo.put(1, RelayEntry(tcp="127.0.0.1:1", unix="u", host="h", fanout=1, have=0))

        def stored() -> int:
            return int(json.loads(client.hget(names.weights_relays(1), "peer-a"))["have"])

        topo.note(1, have=3)
        topo.note(1, have=4)
        assert stored() == 0 and topo.entries[1].have == 4  # nothing written yet
        topo.flush()
        assert stored() == 4
        topo.note(2, have=1)  # not an entry of this peer: ignored
        topo.flush()
        assert client.hget(names.weights_relays(2), "peer-a") is None
    finally:
        client.close()


async def test_late_joiner_pulls_from_a_peer_even_with_the_publisher_gone(
    servers: ServerSet, names: Names, redis_client: aioredis.Redis
) -> None:
    src = _model(3)
    pub_t = _peer(servers, names, fanout=1)
    first = _peer(servers, names, fanout=2)
    late = _peer(servers, names, fanout=2)
    try:
        manifest = await _publisher(redis_client, pub_t, names).publish(src, 1)
        assert _same(src, (await WeightReader(redis_client, first, names).fetch(1)).tensors)
        await pub_t.close()  # the learner's side is gone: only the first generator holds version 1
        fetched = await WeightReader(redis_client, late, names).fetch(1)
        assert _same(src, fetched.tensors)
        assert late.topology.entries[1].depth == 2
        assert await _settled(lambda: first.bytes_sent, manifest.total_bytes) == manifest.total_bytes
    finally:
        for t in (late, first, pub_t):
            await t.close()


async def test_no_source_names_what_it_tried(servers: ServerSet, names: Names, redis_client: aioredis.Redis) -> None:
    buckets = [os.urandom(1000)]
    await _write_manifest(redis_client, names, 1, buckets)
    child = make_transport(TransportConfig(url="peer://127.0.0.1:0?fanout=1", timeout_s=1), servers.redis_url, names)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="no peer could serve bucket 0 of weights version 1"):
            await child.get_checked(1, 0, "xxh3_64", 1000)
        assert time.monotonic() - t0 < 5
    finally:
        await child.close()


def test_peer_url_errors_name_the_part() -> None:
    with pytest.raises(ValueError, match="unknown parameter"):
        TransportConfig(url="peer://0.0.0.0:0?fan_out=2")
    with pytest.raises(ValueError, match="fanout must be >= 0"):
        TransportConfig(url="peer://0.0.0.0:0?fanout=-1")
    with pytest.raises(ValueError, match="same_host"):
        TransportConfig(url="peer://0.0.0.0:0?same_host=rdma")


@pytest.mark.skipif(os.geteuid() != 0, reason="bench fanout needs root (network namespaces, veth, tc)")
def test_fanout_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    proc = subprocess.run(
        [sys.executable, "-m", "actors.commands.cli", "bench", "fanout", "--hosts", "1,2", "--model-gb", "0.004",
         "--bucket-mb", "1", "--link-gbps", "0.1", "--json", str(out), "--kill-relay"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert set(d["results"]) == {"redis", "direct", "relay"}
    for mode in ("redis", "direct", "relay"):
        for n in ("1", "2"):
            r = d["results"][mode][n]
            assert r["bit_exact"] and r["all_applied_s"] > 0 and r["publisher_bytes"] >= d["model_bytes"]
    assert d["results"]["relay"]["2"]["publisher_copies"] < 1.5  # one copy out of the publisher, the peer relays
    assert d["results"]["direct"]["2"]["publisher_copies"] > 1.9
    assert d["relay_ratio_16_vs_1"] is not None and d["kill_relay"]["bit_exact"]
    assert d["namespace_prefix"].startswith("arlfo-")  # its own run's; another run's may be going beside it
    assert not subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(d["namespace_prefix"])
