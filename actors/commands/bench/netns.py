"""The simulated hosts of ``async-rl bench fanout``: Linux network namespaces on one bridge, links shaped by tc.

Host ``k`` is the namespace ``arlfo-<run>-h<k>`` with address ``10.77.0.<k+1>`` on its ``eth0``, one end of a veth
pair; the other end is a port of the bridge ``br0`` in the switch namespace ``arlfo-<run>-sw``. Both ends of every
link are shaped: netem (rate and delay each way) where the kernel has it, else tbf (rate only). Bytes a host sent are
the rx counter of its switch port (headers included). Needs root and iproute2 (``ip``, ``tc``).
:func:`cleanup_namespaces` removes what this run made, and what a run that is gone left behind; a run still going
(its driver's pid alive) is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

NS_PREFIX = "arlfo-"


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


RUN_TAG = _base36(os.getpid())
"""This run's namespaces are ``arlfo-<tag>-h<k>`` and ``arlfo-<tag>-sw`` (the driver's pid in base 36), so that two
runs on one machine (a test beside a bench) do not remove each other's; veth names are ``af<tag>-<k>`` (at most
15 characters)."""
SWITCH_NS = f"{NS_PREFIX}{RUN_TAG}-sw"
SUBNET = "10.77.0"
# tbf's bucket must hold one TSO packet as a qdisc counts it: 64 KB of payload plus the headers of each of its
# segments, about 68 KB. With 64 KB (the floor until 2026-11-25) tbf cut every TSO packet into MTU-sized packets in
# software and throttled each on a timer: at 0.2 Gbit/s one 80 MB stream cost the machine 0.45-0.75 s of softirq
# (0.06 s with 128 KB, same 3.4 s transfer), so 16 busy links measured this machine's 2 cores, not the relay. A
# real host's NIC segments in hardware.
MIN_BURST_BYTES = 128 << 10


def _run(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip() or out.stdout.strip()}")


def host_ns(k: int) -> str:
    return f"{NS_PREFIX}{RUN_TAG}-h{k}"


def _port(k: int, tag: str = RUN_TAG) -> str:
    return f"af{tag}-{k}"


def _owner_alive(ns: str) -> bool:
    """Whether the run that made namespace ``ns`` is another one still going (its driver's pid is alive)."""
    tag, sep, _ = ns[len(NS_PREFIX) :].partition("-")
    if not sep or tag == RUN_TAG:
        return False  # a name from before run tags, or our own
    try:
        os.kill(int(tag, 36), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def host_addr(k: int) -> str:
    return f"{SUBNET}.{k + 1}"


def cleanup_namespaces() -> list[str]:
    """Kill what runs in ``arlfo-*`` namespaces left by this run or by one that is gone, and delete them (another
    run's, still going, are left alone); returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(NS_PREFIX)]
    stale = [ns for ns in names if not _owner_alive(ns)]
    for ns in stale:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for ns in stale:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():  # a veth end left in the root namespace by a run killed mid-setup
        name = line.split(":")[1].strip().partition("@")[0] if line.count(":") >= 2 else ""
        tag = name[2:].partition("-")[0]
        if (name.startswith(f"af{tag}-") and tag and not _owner_alive(f"{NS_PREFIX}{tag}-")) or (
            name.startswith(f"{NS_PREFIX}p")  # from before run tags
        ):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    return stale


def _shape(ns: str, dev: str, gbps: float, delay_ms: float) -> str:
    """Shape one end of a link: netem (rate and delay) where the kernel has it, else tbf (rate only; the kernel
    was built without CONFIG_NET_SCH_NETEM, and no other qdisc here can delay). Returns the qdisc used."""
    netem = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "rate", f"{gbps}gbit",
                            "delay", f"{delay_ms}ms", "limit", "100000"], capture_output=True, text=True)  # fmt: skip
    if netem.returncode == 0:
        return "netem"
    # Burst: two timer ticks of traffic at the rate (tbf needs at least one, 1.25 MB at 10 Gbit/s and HZ=1000),
    # and at least MIN_BURST_BYTES.
    burst = max(int(gbps * 1e9 / 8 / 1000 * 2), MIN_BURST_BYTES)
    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbps}gbit", "burst", str(burst),
         "latency", "50ms")  # fmt: skip
    return "tbf"


def setup_namespaces(num_hosts: int, gbps: float, delay_ms: float) -> str:
    """Host namespaces 0..num_hosts-1 on one bridge, every link shaped both ways; returns the qdisc used."""
    qdiscs = set()
    _run("ip", "netns", "add", SWITCH_NS)
    _run("ip", "-n", SWITCH_NS, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", SWITCH_NS, "link", "set", "br0", "up")
    for k in range(num_hosts):
        ns, port = host_ns(k), _port(k)
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", port + "h", "type", "veth", "peer", "name", port)
        _run("ip", "link", "set", port + "h", "netns", ns)
        _run("ip", "-n", ns, "link", "set", port + "h", "name", "eth0")
        _run("ip", "link", "set", port, "netns", SWITCH_NS)
        _run("ip", "-n", SWITCH_NS, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{host_addr(k)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        qdiscs.add(_shape(ns, "eth0", gbps, delay_ms))
        qdiscs.add(_shape(SWITCH_NS, port, gbps, delay_ms))
    return "+".join(sorted(qdiscs))


def link_tx_bytes(num_hosts: int) -> list[int]:
    """Bytes each host has sent (the switch port's rx counter of its link)."""
    out = subprocess.run(["ip", "-n", SWITCH_NS, "-s", "-j", "link", "show"], capture_output=True, text=True)
    by_name = {d["ifname"]: d["stats64"]["rx"]["bytes"] for d in json.loads(out.stdout)}
    return [int(by_name[_port(k)]) for k in range(num_hosts)]
