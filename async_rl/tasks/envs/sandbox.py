"""A sandboxed Python tool: run a model's code in a child process with time, memory and output limits, no network.

What bounds a run (:class:`SandboxConfig`):

* CPU time: ``RLIMIT_CPU`` (the kernel kills the child with SIGXCPU/SIGKILL), and wall time: the parent kills
  the child's process group once ``timeout_s`` passed (a child asleep uses no CPU);
* memory: ``RLIMIT_AS`` (an allocation past it raises ``MemoryError`` in the child);
* files: ``RLIMIT_FSIZE`` (no file larger than ``max_file_bytes``), ``RLIMIT_NOFILE``, a fresh temporary
  working directory removed afterwards, an empty environment, ``python -I`` (no user site, no ``PYTHON*``
  variables, the script's directory not on ``sys.path``);
* processes: ``RLIMIT_NPROC`` is left alone (it counts the user's processes machine-wide), but the child runs in
  its own session and the whole group is killed at the end;
* network: the child runs under ``unshare -rn`` (new user and network namespaces: only a loopback that is
  down, so every connect fails), when the host allows unprivileged namespaces. Where it does not (some
  container runtimes), :func:`network_isolation` says so and the tool runs *with* network: put the generator
  in a network-less container or pod then (``docs/environments.md``).
* output: stdout and stderr are cut at ``max_output_bytes`` each.

This is a sandbox against accidents and sloppy code (an endless loop, a runaway allocation, a stray download),
not a security boundary against a determined attacker: the child shares the kernel and the filesystem's
readable parts. Use gVisor, Firecracker or a remote sandbox service for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class SandboxConfig:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock limit; the CPU-time limit is the same, rounded up to whole seconds."""
    memory_bytes: int = 512 << 20
    """Address-space limit of the child (``RLIMIT_AS``); Python itself needs about 30 MB."""
    max_file_bytes: int = 1 << 20
    """Largest file the child may write."""
    max_output_bytes: int = 16 << 10
    """stdout and stderr are each cut to this many bytes."""
    isolate_network: bool = True
    """Run under ``unshare -rn`` when the host allows it (see :func:`network_isolation`)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError("sandbox.timeout_s must be > 0")
        if self.memory_bytes < 64 << 20:
            raise ValueError("sandbox.memory_bytes must be >= 64 MiB (the interpreter needs some)")
        if self.max_file_bytes < 0 or self.max_output_bytes < 1:
            raise ValueError("sandbox.max_file_bytes must be >= 0 and sandbox.max_output_bytes >= 1")


@dataclass(slots=True)
class SandboxResult:
    """What a run produced."""

    stdout: str
    stderr: str
    returncode: int
    """The child's exit status (negative: killed by that signal)."""
    timed_out: bool
    """Killed at the wall-clock limit."""
    network_isolated: bool
    """The child ran in a network namespace of its own."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.cache
def network_isolation() -> bool:
    """Whether ``unshare -rn`` works here (probed once): the sandbox's network isolation is available."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limit(cfg: SandboxConfig) -> None:
    """In the child, before exec: its own session (one group to kill) and the resource limits."""
    os.setsid()
    cpu = max(1, int(cfg.timeout_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg.memory_bytes, cfg.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.max_file_bytes, cfg.max_file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


async def run_python(code: str, cfg: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` with ``python -I`` in a sandboxed child (see the module docstring); never raises for what the
    code does (errors are in ``stderr`` and ``returncode``)."""
    cfg = cfg or SandboxConfig()
    isolated = cfg.isolate_network and network_isolation()
    argv = [sys.executable, "-I", "-c", code]
    if isolated:
        argv = [shutil.which("unshare") or "unshare", "-rn", *argv]
    with tempfile.TemporaryDirectory(prefix="async-rl-sandbox-") as cwd:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=cwd, env={"PATH": "/usr/bin:/bin", "HOME": cwd},
            preexec_fn=functools.partial(_limit, cfg),
        )  # fmt: skip
        timed_out = False
        try:
            out, err = await asyncio.wait_for(_read(proc, cfg.max_output_bytes), cfg.timeout_s)
        except TimeoutError:
            timed_out = True
            out, err = b"", b""
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the child's whole session, whatever it started
            await proc.wait()
    # The CPU limit (the same seconds) can fire before the wall clock on a loaded machine: a timeout all the same.
    timed_out = timed_out or proc.returncode == -signal.SIGXCPU
    return SandboxResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                         returncode=int(proc.returncode or 0), timed_out=timed_out,
                         network_isolated=isolated)  # fmt: skip


async def _read(proc: asyncio.subprocess.Process, limit: int) -> tuple[bytes, bytes]:
    """Both pipes to their end, keeping the first ``limit`` bytes of each (the rest is read and dropped, so a chatty
    child never blocks on a full pipe)."""

    async def drain(stream: asyncio.StreamReader | None) -> bytes:
        kept = bytearray()
        while stream is not None:
            chunk = await stream.read(1 << 16)
            if not chunk:
                break
            kept += chunk[: max(0, limit - len(kept))]
        return bytes(kept)

    out, err = await asyncio.gather(drain(proc.stdout), drain(proc.stderr))
    await proc.wait()
    return out, err
