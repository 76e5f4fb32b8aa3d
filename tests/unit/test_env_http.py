"""Environments served from another process: ``async-rl env-serve`` (a real server process on localhost) serves
``served_env.py:ServedCopy`` over OpenEnv's protocol, and ``task.name=http`` runs its prompts and episodes through the
generator's episode runner; an error of the environment reaches the generator's error path (its group is
dead-lettered), an unreachable server is named with its URL within seconds, and bad config is refused in one line."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from test_env_adapters import ScriptedTurns  # a sibling module: an engine of scripted turns

from actors.generator.engine import SamplingParams
from actors.generator.episodes import EpisodeConfig, run_group
from async_rl.model import toy_tokenizer as tt
from async_rl.tasks import TaskConfig, build_task
from async_rl.tasks.envs.config import EnvConfig
from async_rl.tasks.envs.http import HttpEnvTask, HttpEpisode

pytest.importorskip("aiohttp")

REPO = Path(__file__).resolve().parents[2]
SERVED = "tests/unit/served_env.py:ServedCopy"


def _serve(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "actors.commands", "env-serve", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    proc = _serve(SERVED, "task.args.digits=4", "port=0")
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the server says where it listens once it does
    found = re.search(r"serving 'served_copy' at (http://127\.0\.0\.1:\d+)", line)
    assert found, line + proc.stdout.read() if proc.poll() is not None else line
    yield found.group(1)
    proc.terminate()
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and "async-rl env-serve: stopped" in out, out


def scripted(texts: Sequence[str]) -> ScriptedTurns:
    """Model turns given as toy text (each followed by <eos>), in order; it keeps every context."""
    return ScriptedTurns(tt.build_tokenizer(), texts)


async def test_a_served_environment_runs_its_prompts_and_episodes(url: str) -> None:
    from served_env import ServedCopy  # the same class, built here: what the server must hand out

    task = build_task(TaskConfig(name="http", env=EnvConfig(url=url)))
    assert isinstance(task, HttpEnvTask) and task.name == "served_copy"
    assert task.max_new_tokens == 5 and task.num_prompts is None and task.held_out
    local = ServedCopy(seed=0, digits=4)
    for i in (0, 7):
        spec, want = task.prompt(i), local.prompt(i)
        assert spec.prompt_id == want.prompt_id and spec.metadata == want.metadata
        np.testing.assert_array_equal(spec.prompt_ids, want.prompt_ids)
    assert task.eval_prompt(2).metadata == local.eval_prompt(2).metadata
    assert task.prompt_text(task.prompt(0).prompt_ids) == "<bos>,"  # the server's text of it, for the learner's log
    spec = task.prompt(3)
    target = spec.metadata["target"]
    engine = scripted(["*", target])  # call the tool, then copy what it returned
    [s] = await run_group(engine, task, spec.metadata, spec.prompt_ids, SamplingParams(n=1, max_new_tokens=5),
                          EpisodeConfig())  # fmt: skip
    assert s.reward == 1.0 and s.reward_info["exact"] == 1.0 and s.reward_info["episode/end_done"] == 1.0
    reply = tt.encode(target + "=")  # the environment's tokens, from the server, in the sequence and out of the loss
    np.testing.assert_array_equal(s.response_ids[~s.model_token_mask()], reply)
    np.testing.assert_array_equal(engine.contexts[1], np.concatenate([spec.prompt_ids, engine.turns[0], reply]))
    # Episodes of a group run concurrently, each in its own session.
    engines = [scripted(["*", target]), scripted(["1", "1"])]
    got = await asyncio.gather(*(run_group(e, task, spec.metadata, spec.prompt_ids,
                                           SamplingParams(n=1, max_new_tokens=5), EpisodeConfig()) for e in engines))  # fmt: skip
    assert [g[0].reward_info["called"] for g in got] == [1.0, 0.0]


async def test_an_environment_error_on_the_server_costs_the_group(url: str) -> None:
    task = build_task(TaskConfig(name="http", env=EnvConfig(url=url)))
    spec = task.prompt(1)
    errors: list[BaseException] = []
    samples = await run_group(scripted(["-", "-"]), task, spec.metadata, spec.prompt_ids,  # type: ignore[arg-type]
                              SamplingParams(n=2, max_new_tokens=5), EpisodeConfig(), on_error=errors.append)  # fmt: skip
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) for e in errors)
    assert str(errors[0]) == f"environment server {url}: RuntimeError: boom: the turn holds a '-' (EXECUTION_ERROR)"
    assert all(s.reward_info["episode/end_env_error"] == 1.0 for s in samples)
    # The server goes on: the next episode runs.
    [s] = await run_group(scripted(["*", spec.metadata["target"]]), task, spec.metadata, spec.prompt_ids,
                          SamplingParams(n=1, max_new_tokens=5), EpisodeConfig())  # fmt: skip
    assert s.reward == 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_an_unreachable_server_is_named_with_its_url_within_seconds() -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"task.env.url: environment server {dead} does not answer \(connection "
                                         r"refused: is async-rl env-serve running there\?\)"):  # fmt: skip
        build_task(TaskConfig(name="http", env=EnvConfig(url=dead)))
    with pytest.raises(ConnectionError, match=rf"environment server {dead} does not answer"):
        await HttpEpisode(dead, {}).step(np.array([5], np.int32))
    # A host that takes the connection and never answers: named after the timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        mute = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ValueError, match=rf"environment server {mute} does not answer \(no answer within 5 s\)"):
            HttpEnvTask(mute, timeout_s=0.5)
    assert time.monotonic() - t0 < 5.0


def test_config_errors_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"task.env.url \(http://host:port of an environment server: async-rl "
                                         r"env-serve\) is required when task.name is 'http'"):  # fmt: skip
        TaskConfig(name="http")
    with pytest.raises(ValueError, match=r"task.env.url must be http://host:port of an environment server, got "):
        EnvConfig(url="ws://h:1")
    with pytest.raises(ValueError, match=r"task.env.url applies to task.name=http, not to 'tool_copy'"):
        TaskConfig(name="tool_copy", env=EnvConfig(url="http://h:1"))
    for args, said in ((["task.name=copy", "port=0"], "task.name 'copy' is not an environment (an EnvTask)"),
                       (["task.name=http", "task.env.url=http://h:1"], "task.name=http is the client of a server"),
                       (["port=70000"], "port must be in [0, 65535]")):  # fmt: skip
        proc = _serve(*args)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 2 and said in out and "Traceback" not in out, out


def test_the_server_answers_malformed_messages_with_errors(url: str) -> None:
    async def talk() -> list[dict]:
        import aiohttp

        async with aiohttp.ClientSession() as session, session.ws_connect(f"{url}/ws") as ws:
            out = []
            for msg in ("not json", {"type": "dance"}, {"type": "step", "data": {"tokens": [5]}},
                        {"type": "reset", "data": {}}, {"type": "reset", "data": {"metadata": {"target": "12"}}},
                        {"type": "step", "data": {"tokens": [*tt.encode("*"), tt.EOS_ID]}}, {"type": "state"}):  # fmt: skip
                await ws.send_str(msg if isinstance(msg, str) else json.dumps(msg))
                out.append(json.loads((await ws.receive()).data))
            return out

    answers = asyncio.run(talk())
    assert [a["data"].get("code") for a in answers[:4]] == ["INVALID_JSON", "UNKNOWN_TYPE", "VALIDATION_ERROR",
                                                           "VALIDATION_ERROR"]  # fmt: skip
    assert answers[4] == {"type": "observation", "data": {"observation": {}, "reward": None, "done": False}}
    step = answers[5]["data"]
    assert step["observation"]["tokens"] == tt.encode("12=") and step["done"] is False and step["reward"] == 0.0
    assert answers[6]["type"] == "state" and answers[6]["data"]["step_count"] == 1
