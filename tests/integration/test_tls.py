"""TLS and credentials to both servers: a Redis with TLS and a password (``rediss://:pw@...?ssl_ca_certs=``) carries
the buffer and the weight buckets; a NATS with TLS and a user carries the control plane; a client that does not
trust the server's CA is refused with one line naming the URL."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, Heartbeat, Message
from async_rl.servers.embedded import EmbeddedServer, _spawn, free_port, nats_binary
from async_rl.servers.reach import Unreachable, probe_nats, probe_redis
from async_rl.weights import WeightPublisher, WeightReader
from async_rl.weights.redis_transport import RedisTransport
from async_rl.wire import PromptSpec
from buffer.prompts import PromptQueue

SECRET = "tls-pw-never-shown"


def _certs(d: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 signed by it (openssl)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=async-rl test CA")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.crt", "-days", "1", "-extfile", "ext.cnf")  # fmt: skip
    return d / "ca.crt", d / "server.crt", d / "server.key"


@pytest.fixture(scope="module")
def tls_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """(rediss URL, tls NATS URL, CA file): redis-server with TLS and a password, nats-server with TLS and a user."""
    redis_server = shutil.which("redis-server")
    if redis_server is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server (built with TLS) and openssl")
    d = tmp_path_factory.mktemp("tls")
    ca, cert, key = _certs(d)
    rport, nport = free_port(), free_port()
    try:
        rproc = _spawn("redis", [redis_server, "--port", "0", "--tls-port", str(rport), "--tls-cert-file", str(cert),
                                 "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
                                 "--requirepass", SECRET, "--save", "", "--appendonly", "no", "--dir", str(d)],
                       rport, d)  # fmt: skip
    except RuntimeError as exc:
        if "TLS" in str(exc):
            pytest.skip(f"this redis-server has no TLS support: {str(exc)[-200:]}")
        raise
    nproc = _spawn("nats", [str(nats_binary()), "-a", "127.0.0.1", "-p", str(nport), "--tls", "--tlscert", str(cert),
                            "--tlskey", str(key), "--user", "gen", "--pass", SECRET], nport, d)  # fmt: skip
    servers = [EmbeddedServer("redis", "", rproc, d / "r", d / "redis.log"),
               EmbeddedServer("nats", "", nproc, d / "n", d / "nats.log")]  # fmt: skip
    yield (f"rediss://:{SECRET}@127.0.0.1:{rport}/0?ssl_ca_certs={ca}", f"tls://gen:{SECRET}@127.0.0.1:{nport}", ca)
    for s in servers:
        s.stop()


async def test_buffer_and_weights_over_tls_with_a_password(tls_servers: tuple[str, str, Path]) -> None:
    redis_url, _, _ = tls_servers
    probe_redis(redis_url)
    names = Names(prefix="t-tls")
    client = aioredis.Redis.from_url(redis_url)
    try:
        q = PromptQueue(client, names)
        await q.issue([PromptSpec("p0", np.array([1, 2], dtype=np.int32))], version=0)
        assert [e.spec.prompt_id for e in await q.read("gen-a", count=1)] == ["p0"]
        weights = {"w": torch.arange(1 << 16, dtype=torch.float32)}
        await WeightPublisher(client, RedisTransport(redis_url, names), names).publish(weights, 0)
        fetched = await WeightReader(client, RedisTransport(redis_url, names), names).fetch(0)
        assert torch.equal(fetched.tensors["w"], weights["w"])  # the raw-RESP bucket transport, over TLS
    finally:
        await client.aclose()


async def test_control_plane_over_tls_with_a_user(tls_servers: tuple[str, str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    _, nats_url, ca = tls_servers
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # a private CA for NATS: the default context reads it
    await asyncio.to_thread(probe_nats, nats_url)  # a sync probe (it runs its own loop), as entry points call it
    got: list[Message] = []
    plane = await ControlPlane(nats_url, name="tls-test").connect()
    try:
        async def on(msg: Message) -> None:
            got.append(msg)

        await plane.subscribe("t-tls.heartbeat", on, kinds=(Heartbeat,))
        await plane.publish("t-tls.heartbeat", Heartbeat(generator_id="g"))
        await plane.flush()
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.02)
        assert got and isinstance(got[0], Heartbeat)
    finally:
        await plane.close()


def test_an_untrusted_certificate_or_a_plain_client_is_refused(tls_servers: tuple[str, str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    redis_url, nats_url, _ = tls_servers
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    hostport = redis_url.split("@")[1].split("/")[0]
    for fn, url, found in [
        (probe_redis, redis_url.split("?")[0], "TLS handshake failed"),  # the system CAs do not know ours
        (probe_redis, f"redis://:{SECRET}@{hostport}/0", "use rediss://"),  # plain text to a TLS port
        (probe_nats, nats_url, "TLS"),
    ]:
        with pytest.raises(Unreachable) as info:
            fn(url)
        msg = str(info.value)
        assert found in msg and SECRET not in msg and "\n" not in msg, msg
