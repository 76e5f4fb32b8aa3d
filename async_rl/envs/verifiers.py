"""Adapter: ``verifiers`` environments (prime-rl's ecosystem) run unchanged, rollout loop, stop conditions and rubric.

Tested with ``verifiers`` 0.3.1 and its classic API (``import verifiers as vf``: ``vf.MultiTurnEnv``,
``vf.ToolEnv``, ``vf.SingleTurnEnv``, ``vf.Rubric``, an environment package's ``load_environment``), the one the
environments of the Environments Hub are written against. (0.4.0 drops it for the ``verifiers.v1`` harness
stack, which drives a model through an HTTP interception server: not covered here.) Installing it brings some
45 packages (``datasets``, ``pyarrow``, ``openai``, ``anthropic``, ``mcp``, ...; no torch).

How it runs. The environment keeps its own loop: the generator starts ``env.rollout(row, client, ...)`` with a
client (:class:`EngineClient`) whose ``get_response`` hands the conversation to the episode and waits for the
model's turn. Each model turn the generator samples is decoded and returned as the assistant's message; the
environment then runs ``env_response`` and its stop conditions, and either asks for the next turn (its new
messages are rendered with the task's codec and appended to the sequence) or ends, after which the rubric scores
the rollout (``rubric.score_rollout``): its ``reward`` is the episode's reward and its numeric ``metrics`` go to
the learner's metrics as ``reward/env/<name>``. A rollout that ends with ``state["error"]`` ends the episode as
an environment error.

Prompts: the environment's dataset (``env.get_dataset()``), loaded by the learner with the same
``task.env.id`` and ``task.env.args``; each row travels whole in the prompt's metadata. Its first
conversation must be what the learner rendered: a rollout that asks for another first turn is refused.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from async_rl.envs.base import EnvReply, Episode, RowsEnvTask
from async_rl.envs.skyrl_gym import numeric_info
from async_rl.envs.text import Message, TextCodec, as_messages
from async_rl.tasks.base import load_reward_fn

_ROW_FIELDS = ("prompt", "answer", "info", "task", "example_id")
"""The fields of a verifiers dataset row that make a rollout's input."""


def _import_verifiers() -> Any:
    try:
        import verifiers as vf
    except ImportError as exc:
        raise RuntimeError("task.name=verifiers needs the verifiers package: pip install 'async-rl[verifiers]'") from exc
    return vf


def plain_messages(messages: Any) -> list[Message]:
    """verifiers messages (pydantic models or dicts) as ``{"role", "content"}`` dicts."""
    out = []
    for m in messages:
        d = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        content = d.get("content")
        out.append({"role": str(d.get("role", "user")), "content": content if isinstance(content, str) else
                    ("" if content is None else str(content))})  # fmt: skip
    return out


class _Turns:
    """The meeting point of the environment's rollout (asks for turns) and the episode (answers them)."""

    asks: asyncio.Queue[tuple[list[Message], asyncio.Future[str]]]

    def __init__(self) -> None:
        self.asks = asyncio.Queue()

    async def ask(self, messages: Any) -> str:
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        await self.asks.put((plain_messages(messages), fut))
        return await fut


def _engine_client(turns: _Turns) -> Any:
    """A ``vf.Client`` whose responses are the episode's model turns (the class is built once verifiers is
    imported: it subclasses the package's own)."""
    from verifiers.clients import Client
    from verifiers.types import Response, ResponseMessage, Usage

    class EngineClient(Client):
        """Answers ``get_response`` with the model turn the generator sampled (see the module docstring)."""

        def setup_client(self, config: Any) -> Any:
            raise TypeError("EngineClient is built around an episode, not from a ClientConfig")

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> Any:  # fmt: skip
            return await self.client.ask(prompt)

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            text = str(response)
            return Response(id=uuid.uuid4().hex, created=int(time.time()), model="async-rl",
                            usage=Usage(prompt_tokens=0, reasoning_tokens=0, completion_tokens=0, total_tokens=0),
                            message=ResponseMessage(content=text, finish_reason="stop", is_truncated=False))  # fmt: skip

        async def close(self) -> None:
            return None

    return EngineClient(turns)


class VerifiersEpisode(Episode):
    """One rollout of a verifiers environment, its turns taken from the generator (see the module docstring)."""

    env: Any
    codec: TextCodec
    row: dict[str, Any]
    prompt: list[Message]
    _turns: _Turns
    _rollout: asyncio.Task | None
    _answer: asyncio.Future[str] | None
    _seen: int
    """Messages of the conversation already in the sequence."""

    def __init__(self, env: Any, codec: TextCodec, row: dict[str, Any]) -> None:
        self.env, self.codec, self.row = env, codec, row
        self.prompt = as_messages(row["prompt"], "the row's prompt")
        self._turns = _Turns()
        self._rollout = None
        self._answer = None
        self._seen = 0

    async def _run(self) -> Any:
        env = self.env
        state = await env.rollout(dict(self.row), _engine_client(self._turns), "async-rl", {})
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
        return state

    async def _next_ask(self) -> tuple[list[Message], asyncio.Future[str]] | None:
        """The rollout's next request for a model turn, or None once it has ended (its error raised)."""
        assert self._rollout is not None
        ask = asyncio.ensure_future(self._turns.asks.get())
        try:
            done, _ = await asyncio.wait({ask, self._rollout}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not ask.done():
                ask.cancel()
        if ask in done:
            return ask.result()
        self._rollout.result()  # the environment's own exception ends the episode
        return None

    async def step(self, action_ids: np.ndarray) -> EnvReply:
        if self._rollout is None:
            self._rollout = asyncio.create_task(self._run(), name="verifiers-rollout")
            first = await self._next_ask()
            if first is None:
                raise RuntimeError("the verifiers rollout ended before asking for the model's first turn")
            messages, self._answer = first
            if messages != plain_messages(self.prompt):
                raise ValueError("the verifiers rollout asked for its first turn on another conversation than the "
                                 "prompt the learner issued (an environment that rewrites its prompt)")  # fmt: skip
            self._seen = len(messages)
        assert self._answer is not None
        self._answer.set_result(self.codec.decode(action_ids))
        nxt = await self._next_ask()
        if nxt is None:
            state = self._rollout.result()
            if state.get("error") is not None:
                raise RuntimeError(f"the verifiers rollout failed: {state['error']!r}")
            reward = state.get("reward")
            return EnvReply(tokens=np.zeros(0, dtype=np.int32), reward=float(reward or 0.0), done=True,
                            info=numeric_info(state.get("metrics"), "env/"))  # fmt: skip
        messages, self._answer = nxt
        added = messages[self._seen + 1 :]  # after the assistant's message (the model's own tokens, in already)
        self._seen = len(messages)
        return EnvReply(tokens=self.codec.reply_ids(added) if added else np.zeros(0, dtype=np.int32))

    async def close(self) -> None:
        if self._rollout is not None and not self._rollout.done():
            self._rollout.cancel()
            await asyncio.wait({self._rollout})  # its outcome no longer matters (wait does not raise it)


class VerifiersTask(RowsEnvTask):
    """The dataset of a verifiers environment as prompts, each opening a rollout of that environment."""

    name = "verifiers"
    env: Any
    codec: TextCodec

    def __init__(self, env_id: str, *, env_args: Mapping[str, Any], codec: TextCodec, seed: int = 0,
                 shuffle: bool = True, max_new_tokens: int = 128) -> None:  # fmt: skip
        _import_verifiers()
        load: Any = load_reward_fn(env_id)  # the same 'module:function' import, errors named
        self.env = load(**dict(env_args))
        self.codec, self.seed, self.shuffle, self._max_new_tokens = codec, seed, shuffle, max_new_tokens
        dataset = self.env.get_dataset()
        self.rows = []
        for i, raw in enumerate(dataset):
            row = {k: raw[k] for k in _ROW_FIELDS if k in raw and raw[k] is not None}
            row.setdefault("example_id", i)
            try:
                ids = codec.prompt_ids(as_messages(row["prompt"], f"row {i}: 'prompt'"))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"task.env.id {env_id!r}: dataset row {i}: {exc}") from exc
            self.rows.append((ids, {"task": self.name, "row": str(row["example_id"]), "input": row}))
        if not self.rows:
            raise ValueError(f"task.env.id {env_id!r}: the environment's dataset is empty")


    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        return VerifiersEpisode(self.env, self.codec, dict(metadata["input"]))
