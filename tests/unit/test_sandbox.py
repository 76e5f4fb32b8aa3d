"""The sandboxed Python tool: output, errors, and each limit (wall time, memory, file size, output, network); and the
``python_tool`` environment around it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from async_rl.tasks.envs.python_tool import PythonToolTask
from async_rl.tasks.envs.sandbox import SandboxConfig, network_isolation, run_python
from async_rl.tasks.envs.text import TextCodec


async def test_runs_code_and_reports_errors():
    r = await run_python("print(6 * 7)")
    assert r.ok and r.stdout == "42\n" and r.stderr == ""
    r = await run_python("raise ValueError('nope')")
    assert not r.ok and r.returncode == 1 and "ValueError: nope" in r.stderr


async def test_limits():
    r = await run_python("import time\nwhile True: time.sleep(1)", SandboxConfig(timeout_s=0.5))
    assert r.timed_out and not r.ok  # asleep: only the wall-clock limit can end it
    r = await run_python("x = bytearray(400 << 20)\nprint('allocated')", SandboxConfig(memory_bytes=128 << 20))
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout
    r = await run_python("with open('f', 'wb') as f:\n    f.write(b'x' * 4096)", SandboxConfig(max_file_bytes=1024))
    assert not r.ok and "File too large" in r.stderr
    r = await run_python("print('y' * 100000)", SandboxConfig(max_output_bytes=100))
    assert r.ok and r.stdout == "y" * 100
    r = await run_python("import os; print(sorted(os.environ))")
    assert r.stdout.strip() in ("['HOME', 'PATH']", "['HOME', 'LC_CTYPE', 'PATH']")  # nothing of the parent's


async def test_no_network():
    if not network_isolation():
        pytest.skip("this host does not allow unshare -rn (the sandbox then runs with network; see its docstring)")
    code = ("import socket\ns = socket.socket()\ns.settimeout(2)\n"
            "try:\n    s.connect(('1.1.1.1', 53))\n    print('connected')\nexcept OSError as e:\n    print('blocked')")  # fmt: skip
    r = await run_python(code)
    assert r.ok and r.network_isolated and r.stdout.strip() == "blocked", r


class ByteCodec(TextCodec):
    """Text as its UTF-8 bytes (ids 0-255), 256 the end of a turn: a codec that can write code, for the tests."""

    def prompt_ids(self, messages):  # type: ignore[no-untyped-def]
        return self.reply_ids(messages)

    def reply_ids(self, messages):  # type: ignore[no-untyped-def]
        return np.frombuffer("".join(m["content"] for m in messages).encode(), dtype=np.uint8).astype(np.int32)

    def decode(self, ids):  # type: ignore[no-untyped-def]
        out = [int(i) for i in ids]
        return bytes(out[: out.index(256)] if 256 in out else out).decode()


async def test_python_tool_episode(tmp_path):
    """A scripted model turn by turn: a tool call that prints, one that raises, one that hangs, then the answer."""
    rows = tmp_path / "q.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 6 * 7?", "answer": "42"}) + "\n")
    task = PythonToolTask(rows, codec=ByteCodec(), sandbox=SandboxConfig(timeout_s=1.0))
    spec = task.prompt(0)
    assert ByteCodec().decode(spec.prompt_ids) == "What is 6 * 7?"
    episode = task.episode(spec.metadata)
    codec = ByteCodec()

    async def turn(text: str):  # type: ignore[no-untyped-def]
        return await episode.step(np.array([*text.encode(), 256], dtype=np.int32))

    r = await turn("Let me compute.\n```python\nprint(6 * 7)\n```")
    assert not r.done and codec.decode(r.tokens) == "<output>42\n</output>"
    r = await turn("```python\n1 / 0\n```")
    assert codec.decode(r.tokens) == "<output>ZeroDivisionError: division by zero</output>"
    r = await turn("```python\nwhile True: pass\n```")
    assert codec.decode(r.tokens) == "<output>timed out after 1s</output>"
    r = await turn("It is <answer> 42 </answer>.")
    assert r.done and r.reward == 1.0
    assert r.info == {"correct": 1.0, "tool_calls": 3.0, "tool_errors": 1.0, "tool_timeouts": 1.0}
