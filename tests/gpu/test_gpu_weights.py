"""The same-host GPU weight path on real GPUs: a learner-side GpuPublisher, readers in other processes (CUDA IPC).

Each reader is a separate process (``tests/gpu/ipc_reader.py``), on the learner's GPU and, where there is one,
on the other GPU; what it applies must equal the published tensors bit for bit. A reader SIGKILLed in the middle
of its copies leaves the learner's buffers and the versions after it intact; a reader in another network
namespace (another "host") is refused the path and takes the host transport instead.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.weights.background import BackgroundPublisher
from async_rl.weights.config import PublisherConfig
from async_rl.weights.gpu.publisher import GpuPublisher, local_slots
from async_rl.weights.publisher import WeightPublisher
from async_rl.weights.reader import WeightReader
from async_rl.weights.transport import TransportConfig, make_transport

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _weights(seed: int, scale_mb: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = scale_mb << 18  # float32 elements: scale_mb MB in fp32, half in bf16
    return {
        "model.embed_tokens.weight": torch.randn(1000, 256, generator=g, device="cuda"),
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(8, n // (8 * 512), 512, generator=g, device="cuda"),
        "model.layers.0.input_layernorm.weight": torch.randn(256, generator=g, device="cuda"),
        "lm_head.weight": torch.randn(1000, 256, generator=g, device="cuda"),
    }


def _reader(servers: ServerSet, names: Names, device: str, out: Path, *args: str, prefix_cmd: tuple[str, ...] = ()
            ) -> subprocess.Popen:  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [*prefix_cmd, sys.executable, "-m", "tests.gpu.ipc_reader", servers.redis_url, names.prefix, device,
           str(out), *args]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check(out: Path, version: int, expected: dict[str, torch.Tensor]) -> dict:
    got = torch.load(out, weights_only=True)
    assert got["version"] == version
    assert set(got["tensors"]) == set(expected)
    for name, t in expected.items():
        want = t.to(torch.bfloat16).cpu()
        assert torch.equal(got["tensors"][name].view(torch.int16), want.view(torch.int16)), name
    return got


def _can_unshare_ipc() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-i", "true"]).returncode == 0


def _devices() -> list[str]:
    return [f"cuda:{i}" for i in range(min(2, torch.cuda.device_count()))]


async def test_readers_in_other_processes_get_every_version_bit_for_bit(servers, names, redis_client, tmp_path):
    cfg = PublisherConfig(gpu_dtype="bfloat16", gpu_bucket_bytes=16 << 20)
    pub = GpuPublisher(redis_client, names, cfg, local_slots("cuda:0", cfg))
    await pub.clean()
    for version in (1, 2, 3):
        w = _weights(version)
        assert await pub.offer(version, lambda w=w: w.items())
        await pub.wait_idle()
        assert await pub.latest_version() == version
        for device in _devices():
            out = tmp_path / f"v{version}-{device.replace(':', '')}.pt"
            proc = _reader(servers, names, device, out, "--version", str(version))
            _, err = await asyncio.to_thread(proc.communicate, timeout=120)
            assert proc.returncode == 0, err
            got = _check(out, version, w)
            print(f"v{version} into {device}: {got['total_s'] * 1e3:.1f} ms (copy + checksum {got['transfer_s'] * 1e3:.1f})")
    assert pub.versions_skipped == 0
    await pub.aclose()


async def test_a_reader_maps_each_slot_once_and_lets_a_restarted_learner_s_go(servers, names, redis_client, tmp_path):
    """Versions of 100 buckets (two slots: 200 handles): a reader following them, as a generator does, maps each slot's
    buckets once, not every version again; after the learner restarts with new buffers, the old ones are unmapped
    once they are four versions behind (a mapping would keep the dead learner's memory)."""
    cfg = PublisherConfig(gpu_dtype="bfloat16", gpu_bucket_bytes=64 << 10)

    def weights(seed: int) -> dict[str, torch.Tensor]:  # 100 tensors of 64 KiB in bf16: a bucket each
        g = torch.Generator(device="cuda").manual_seed(seed)
        return {f"model.layers.{i}.w": torch.randn(32768, generator=g, device="cuda") for i in range(100)}

    pub = GpuPublisher(redis_client, names, cfg, local_slots("cuda:0", cfg))
    await pub.clean()
    w = weights(1)
    await pub.flush(1, lambda: w.items())
    out = tmp_path / "last.pt"
    proc = _reader(servers, names, _devices()[-1], out, "--until", "10")
    assert proc.stdout is not None
    for version in range(2, 11):
        line = await asyncio.to_thread(proc.stdout.readline)  # the reader took the version before
        assert line.startswith(f"read v{version - 1} "), (line, proc.stderr.read() if not line and proc.stderr else "")
        if version == 7:  # the learner restarts: new slots, new buffers
            await pub.aclose()
            pub = GpuPublisher(redis_client, names, cfg, local_slots("cuda:0", cfg))
            await pub.clean()
        w = weights(version)
        await pub.flush(version, lambda w=w: w.items())
    _, err = await asyncio.to_thread(proc.communicate, timeout=120)
    assert proc.returncode == 0, err
    got = _check(out, 10, w)
    assert got["read"] == list(range(1, 11)), got["read"]
    assert got["opened"] == 400, got["opened"]  # 2 x 2 slots x 100 buckets, each mapped once
    assert got["mapped"] == 200, got["mapped"]  # the first learner's unmapped
    await pub.aclose()


async def test_reader_killed_mid_copy_leaves_the_buffers_and_the_next_version_intact(servers, names, redis_client,
                                                                                    tmp_path):  # fmt: skip
    cfg = PublisherConfig(gpu_dtype="bfloat16", gpu_bucket_bytes=8 << 20)
    pub = GpuPublisher(redis_client, names, cfg, local_slots("cuda:0", cfg))
    await pub.clean()
    w1 = _weights(11, scale_mb=256)
    assert await pub.offer(1, lambda: w1.items())
    await pub.wait_idle()
    looping = _reader(servers, names, _devices()[-1], tmp_path / "never.pt", "--loop")
    deadline = time.monotonic() + 120
    assert looping.stdout is not None
    while "read v1" not in looping.stdout.readline():  # it maps and copies v1 again and again
        assert time.monotonic() < deadline and looping.poll() is None, looping.stderr.read() if looping.stderr else ""
    await asyncio.sleep(0.05)
    looping.send_signal(signal.SIGKILL)  # somewhere in a lease, a map or a copy
    looping.wait()
    for version in (2, 3, 4):  # a leased slot frees itself when the killed reader's short lease runs out
        w = _weights(version * 7, scale_mb=256)
        await pub.flush(version, lambda w=w: w.items())
    out = tmp_path / "after.pt"
    proc = _reader(servers, names, _devices()[0], out)
    _, err = await asyncio.to_thread(proc.communicate, timeout=120)
    assert proc.returncode == 0, err
    _check(out, 4, w)
    await pub.aclose()


async def test_another_namespace_is_refused_the_path_and_reads_the_host_transport(servers, names, redis_client,
                                                                                  tmp_path):  # fmt: skip
    if not _can_unshare_ipc():
        pytest.skip("cannot create an IPC namespace here")
    cfg = PublisherConfig(gpu_dtype="bfloat16", gpu_bucket_bytes=16 << 20)
    transport = make_transport(TransportConfig(), servers.redis_url, names)
    host = BackgroundPublisher(WeightPublisher(redis_client, transport, names, cfg))
    pub = GpuPublisher(redis_client, names, cfg, local_slots("cuda:0", cfg), host=host)
    await pub.clean()
    w = _weights(5)
    await pub.flush(1, lambda: w.items())  # GPU-held and, from its slot, on the host transport
    # Another IPC namespace (a container of its own; a network namespace counts the same): Redis is still reachable
    # on loopback, but the host key differs, so the reader refuses the path before any byte moves.
    proc = _reader(servers, names, _devices()[0], tmp_path / "x.pt", prefix_cmd=("unshare", "-i"))
    _, err = await asyncio.to_thread(proc.communicate, timeout=120)
    assert proc.returncode == 3 and "another host" in err, err
    fetched = await WeightReader(redis_client, transport, names).fetch(1)
    for name, t in w.items():
        assert torch.equal(fetched.tensors[name].view(torch.int16), t.to(torch.bfloat16).cpu().view(torch.int16))
    await pub.aclose()
    await transport.close()


async def test_host_versions_are_encoded_on_the_gpu_as_deltas_bit_for_bit(servers, names, redis_client):
    """Through the GPU publisher: other hosts' versions are encoded from the slots on the GPU, full then sparse deltas
    (a 1 % change of the bit patterns), and a host reader applies each one bit for bit."""
    cfg = PublisherConfig(gpu_dtype="bfloat16", gpu_bucket_bytes=16 << 20, full_every=100, link_gbps=10)
    transport = make_transport(TransportConfig(), servers.redis_url, names)
    host = BackgroundPublisher(WeightPublisher(redis_client, transport, names, cfg))
    pub = GpuPublisher(redis_client, names, cfg, local_slots("cuda:0", cfg), host=host)
    assert pub.encoder is not None
    await pub.clean()
    reader = WeightReader(redis_client, transport, names)
    w = _weights(21)
    held = None
    kinds = []
    for version in range(1, 5):
        if version > 1:
            g = torch.Generator(device="cuda").manual_seed(version)
            w = {k: torch.where(torch.rand(v.shape, generator=g, device="cuda") < 0.01, v * 1.1, v) for k, v in w.items()}
        await pub.flush(version, lambda w=w: w.items())
        held = await reader.fetch(version, held)
        kinds.append(held.manifest.kind)
        for name, t in w.items():
            assert torch.equal(held.tensors[name].view(torch.int16), t.to(torch.bfloat16).cpu().view(torch.int16)), name
        record = [r for r in host.take_records() if r.version == version][-1]
        print(f"v{version} {record.kind}: {record.bytes_sent / 1e6:.1f} of {record.full_bytes / 1e6:.1f} MB, "
              f"encoded in {record.stats.pack_s * 1e3:.1f} ms")
    assert kinds == ["full", "delta", "delta", "delta"]
    assert {p.encoding for t in held.manifest.tensors for p in t.pieces} == {"sparse"}
    await pub.aclose()
    await transport.close()
