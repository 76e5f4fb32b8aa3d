"""Adapter: ``verifiers`` environments (prime-rl's ecosystem) run unchanged, rollout loop, stop conditions and rubric.

Tested with ``verifiers`` 0.3.1 and its classic API (``import verifiers as vf``: ``vf.MultiTurnEnv``,
``vf.ToolEnv``, ``vf.SingleTurnEnv``, ``vf.Rubric``, an environment package's ``load_environment``), the one the
environments of the Environments Hub are written against. (0.4.0 drops it for the ``verifiers.v1`` harness
stack, which drives a model through an HTTP interception server: refused by name, see :func:`classic_api_missing`.)
Installing it brings some 45 packages (``datasets``, ``pyarrow``, ``openai``, ``anthropic``, ``mcp``, ...; no torch).

How it runs. The environment keeps its own loop: the generator starts ``env.rollout(row, client, ...)`` with a
client (:class:`EngineClient`, verifiers' own OpenAI chat-completions client with the episode in place of the
server) whose request hands the conversation to the episode and waits for the model's turn. Each model turn the
generator samples is decoded, its tool calls parsed out of the text (``task.env.tool_parser``: Hermes, Llama 3 JSON,
Mistral, or any of vLLM's parsers, :mod:`async_rl.tasks.envs.tool_calls`), and returned as the completion an OpenAI-compatible server with that tool
parser returns: ``content`` and structured ``tool_calls``, so a ``vf.ToolEnv`` runs its tools. The environment
then runs ``env_response`` and its stop conditions, and either asks for the next turn (its new messages, tool
results included, are rendered with the task's codec and appended to the sequence) or ends, after which the
rubric scores the rollout (``rubric.score_rollout``): its ``reward`` is the episode's reward and its numeric
``metrics`` go to the learner's metrics as ``reward/env/<name>``. A rollout that ends with ``state["error"]``
ends the episode as an environment error.

Prompts: the environment's dataset (``env.get_dataset()``), loaded by the learner with the same
``task.env.id`` and ``task.env.args``; each row travels whole in the prompt's metadata. The held-out split
(evaluation) is the environment's ``eval_dataset``; without one, evaluation is refused at start. The prompt is
rendered with the row's tools (``info["tool_defs"]``, else the environment's ``tool_defs``, as ``init_state`` resolves
them) passed to the chat template. The rollout's first request must be what the learner rendered, conversation
and tools: a rollout that asks for another is refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from async_rl.tasks.base import load_reward_fn
from async_rl.tasks.envs.base import EnvReply, Episode, RowsEnvTask
from async_rl.tasks.envs.skyrl_gym import numeric_info
from async_rl.tasks.envs.text import ChatTemplateCodec, Message, TextCodec, Tool, as_messages
from async_rl.tasks.envs.tool_calls import VLLM_PREFIX, ParsedTurn, ToolParser, make_tool_parser, resolve_auto
from async_rl.tasks.envs.vllm_tool_parsers import vllm_available

log = logging.getLogger(__name__)

_ROW_FIELDS = ("prompt", "answer", "info", "task", "example_id")
"""The fields of a verifiers dataset row that make a rollout's input."""


def _import_verifiers() -> Any:
    try:
        import verifiers as vf
    except ImportError as exc:
        raise RuntimeError("task.name=verifiers needs the verifiers package: pip install 'async-rl[verifiers]'") from exc
    problem = classic_api_missing(getattr(vf, "__version__", "?"), hasattr(vf, "MultiTurnEnv"))
    if problem:
        raise ValueError(problem)
    return vf


def classic_api_missing(version: str, has_classic: bool) -> str | None:
    """Why the installed verifiers (``version``; ``has_classic``: whether ``verifiers.MultiTurnEnv`` exists) cannot
    run here, or None. 0.4.0 ships only ``verifiers.v1``: its episodes are harness programs (PEP 723 scripts that uv
    installs and runs in a runtime) calling the model through an interception server, their first prompt built at run
    time by the harness, not an environment the generator can step turn by turn from a prompt the learner issued."""
    if has_classic:
        return None
    return (f"task.name=verifiers drives verifiers' classic API (vf.MultiTurnEnv, vf.ToolEnv, ...; verifiers 0.3.x), "
            f"and the installed verifiers {version} has only the verifiers.v1 stack (harness programs behind an "
            "interception server; docs/environments.md): pip install 'verifiers>=0.3.1,<0.4'")  # fmt: skip


def plain_messages(messages: Any) -> list[Message]:
    """verifiers or OpenAI messages (pydantic models or dicts) as chat-template dicts: ``role`` and text
    ``content``, with an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` where present."""
    out = []
    for m in messages:
        d = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        content = d.get("content")
        msg: Message = {"role": str(d.get("role", "user")), "content": content if isinstance(content, str) else
                        ("" if content is None else str(content))}  # fmt: skip
        if d.get("tool_calls"):
            msg["tool_calls"] = list(d["tool_calls"])
        if d.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(d["tool_call_id"])
        out.append(msg)
    return out


def openai_tool(tool: Any) -> Tool:
    """A ``vf.Tool`` as chat templates (and OpenAI's API) take it, as verifiers' OpenAI client converts it."""
    function: dict[str, Any] = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def row_tools(env: Any, row: Mapping[str, Any]) -> list[Tool]:
    """The tools a rollout of ``row`` offers the model: the row's ``info["tool_defs"]``, else the environment's
    ``tool_defs`` (the order of verifiers' ``init_state``)."""
    vf = _import_verifiers()
    info = row.get("info")
    if isinstance(info, str):
        info = json.loads(info)
    defs = info["tool_defs"] if isinstance(info, dict) and "tool_defs" in info else env.tool_defs
    return [openai_tool(d if isinstance(d, vf.Tool) else vf.Tool.model_validate(d)) for d in defs or []]


class _Turns:
    """The meeting point of the environment's rollout (asks for turns) and the episode (answers them)."""

    asks: asyncio.Queue[tuple[list[Message], list[Tool], asyncio.Future[ParsedTurn]]]

    def __init__(self) -> None:
        self.asks = asyncio.Queue()

    async def ask(self, messages: Any, tools: Any) -> ParsedTurn:
        fut: asyncio.Future[ParsedTurn] = asyncio.get_running_loop().create_future()
        await self.asks.put((plain_messages(messages), [dict(t) for t in tools or []], fut))
        return await fut


def chat_completion(turn: ParsedTurn) -> Any:
    """The ``ChatCompletion`` an OpenAI-compatible server with a tool parser returns for ``turn``."""
    from openai.types.chat import ChatCompletion

    return ChatCompletion.model_validate({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": "async-rl", "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        "choices": [{"index": 0, "finish_reason": "tool_calls" if turn.tool_calls else "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": turn.content,
                                 "tool_calls": turn.tool_calls or None}}],
    })  # fmt: skip


def _engine_client(turns: _Turns) -> Any:
    """A ``vf.Client`` whose responses are the episode's model turns (the class is built once verifiers is
    imported: it subclasses the package's own OpenAI chat-completions client, so that messages, tools and
    responses are converted by verifiers' code, as with a real server)."""
    from verifiers.clients import OpenAIChatCompletionsClient

    class EngineClient(OpenAIChatCompletionsClient):
        """Answers a request with the model turn the generator sampled (see the module docstring)."""

        def setup_client(self, config: Any) -> Any:
            raise TypeError("EngineClient is built around an episode, not from a ClientConfig")

        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> Any:  # fmt: skip
            return chat_completion(await self.client.ask(prompt, tools))

        async def raise_from_native_response(self, response: Any) -> None:
            return None  # an empty turn is the model's answer, not a server's failure

        async def close(self) -> None:
            return None

    return EngineClient(turns)


MALFORMED_KEY = "tool_calls/malformed"
"""The episode's ``info`` key counting the tool-call blocks its turns had that did not parse (``reward/...``)."""


class VerifiersEpisode(Episode):
    """One rollout of a verifiers environment, its turns taken from the generator (see the module docstring)."""

    env: Any
    codec: TextCodec
    row: dict[str, Any]
    tool_parser: ToolParser
    prompt: list[Message]
    _turns: _Turns
    _rollout: asyncio.Task | None
    _answer: asyncio.Future[ParsedTurn] | None
    _seen: int
    """Messages of the conversation already in the sequence."""
    _tools: list[Tool]
    """The tools the rollout offers (handed to the parser)."""
    _num_turns: int
    _num_malformed: int

    def __init__(self, env: Any, codec: TextCodec, row: dict[str, Any], tool_parser: ToolParser) -> None:
        self.env, self.codec, self.row, self.tool_parser = env, codec, row, tool_parser
        self.prompt = as_messages(row["prompt"], "the row's prompt")
        self._turns = _Turns()
        self._rollout = None
        self._answer = None
        self._seen = self._num_turns = self._num_malformed = 0
        self._tools = []

    async def _run(self) -> Any:
        env = self.env
        state = await env.rollout(dict(self.row), _engine_client(self._turns), "async-rl", {})
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
        return state

    async def _next_ask(self) -> tuple[list[Message], list[Tool], asyncio.Future[ParsedTurn]] | None:
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
            messages, tools, self._answer = first
            if messages != plain_messages(self.prompt):
                raise ValueError("the verifiers rollout asked for its first turn on another conversation than the "
                                 "prompt the learner issued (an environment that rewrites its prompt)")  # fmt: skip
            if tools != row_tools(self.env, self.row):
                raise ValueError("the verifiers rollout offered other tools than the prompt the learner issued lists "
                                 f"({[t['function']['name'] for t in tools]}; an environment that sets its tools "
                                 "per rollout)")  # fmt: skip
            self._seen, self._tools = len(messages), tools
        assert self._answer is not None
        text = self.codec.decode(action_ids, keep=self.tool_parser.keep_tokens)
        turn = self.tool_parser.parse(text, id_prefix=f"call_{self._num_turns}_", tools=self._tools)
        self._num_turns += 1
        self._num_malformed += turn.num_malformed
        self._answer.set_result(turn)
        info = {} if self.tool_parser.read is None else {MALFORMED_KEY: float(self._num_malformed)}
        nxt = await self._next_ask()
        if nxt is None:
            state = self._rollout.result()
            if state.get("error") is not None:
                raise RuntimeError(f"the verifiers rollout failed: {state['error']!r}")
            reward = state.get("reward")
            return EnvReply(tokens=np.zeros(0, dtype=np.int32), reward=float(reward or 0.0), done=True,
                            info={**numeric_info(state.get("metrics"), "env/"), **info})  # fmt: skip
        messages, _, self._answer = nxt
        added = messages[self._seen + 1 :]  # after the assistant's message (the model's own tokens, in already)
        self._seen = len(messages)
        return EnvReply(tokens=self.codec.reply_ids(added) if added else np.zeros(0, dtype=np.int32), info=info)

    async def close(self) -> None:
        if self._rollout is not None and not self._rollout.done():
            self._rollout.cancel()
            await asyncio.wait({self._rollout})  # its outcome no longer matters (wait does not raise it)


class VerifiersTask(RowsEnvTask):
    """The dataset of a verifiers environment as prompts, each opening a rollout of that environment."""

    name = "verifiers"
    env: Any
    codec: TextCodec
    tool_parser: str
    """``task.env.tool_parser``, ``auto`` resolved to the format the chat template teaches."""
    _parser: ToolParser | None
    """Built with the task, except a ``vllm:<name>`` parser on a host without vLLM (a learner's: it never parses),
    which is built at the first episode and fails there."""

    def __init__(self, env_id: str, *, env_args: Mapping[str, Any], codec: TextCodec, seed: int = 0,
                 shuffle: bool = True, max_new_tokens: int = 128, tool_parser: str = "hermes") -> None:  # fmt: skip
        _import_verifiers()
        load: Any = load_reward_fn(env_id)  # the same 'module:function' import, errors named
        self.env = load(**dict(env_args))
        self.codec, self.seed, self.shuffle, self._max_new_tokens = codec, seed, shuffle, max_new_tokens
        tokenizer = codec.tokenizer if isinstance(codec, ChatTemplateCodec) else None
        self.tool_parser, self._parser = resolve_auto(tool_parser, tokenizer), None
        if not self.tool_parser.startswith(VLLM_PREFIX) or vllm_available():
            self._build_parser()  # now: its errors end the process at start
        self.rows, with_tools = self._rows(self.env.get_dataset(), env_id, "dataset")
        if not self.rows:
            raise ValueError(f"task.env.id {env_id!r}: the environment's dataset is empty")
        self.no_held_out = f"the environment of task.env.id {env_id!r} has no eval_dataset"
        self.env.build_eval_dataset()  # the held-out split: the environment's eval_dataset, when it has one
        if self.env.eval_dataset is not None:
            self.eval_rows, _ = self._rows(self.env.eval_dataset, env_id, "eval_dataset")
        if with_tools and isinstance(codec, ChatTemplateCodec) and not codec.lists_tools():
            log.warning("task.env.id %r: %d rows offer tools, but the chat template of task.tokenizer does not list "
                        "tools: the model is not shown them", env_id, with_tools)  # fmt: skip

    def _rows(self, dataset: Any, env_id: str, what: str) -> tuple[list[tuple[np.ndarray, dict[str, Any]]], int]:
        """The rows of ``dataset`` rendered as prompts, and how many offer tools."""
        rows, with_tools = [], 0
        for i, raw in enumerate(dataset):
            row = {k: raw[k] for k in _ROW_FIELDS if k in raw and raw[k] is not None}
            row.setdefault("example_id", i)
            try:
                tools = row_tools(self.env, row)
                ids = self.codec.prompt_ids(as_messages(row["prompt"], f"row {i}: 'prompt'"), tools)
            except (KeyError, ValueError) as exc:
                raise ValueError(f"task.env.id {env_id!r}: {what} row {i}: {exc}") from exc
            with_tools += bool(tools)
            rows.append((ids, {"task": self.name, "row": str(row["example_id"]), "input": row}))
        return rows, with_tools

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        return self.codec.show(prompt_ids)

    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        parser = self._parser or self._build_parser()
        return VerifiersEpisode(self.env, self.codec, dict(metadata["input"]), parser)

    def _build_parser(self) -> ToolParser:
        tokenizer = self.codec.tokenizer if isinstance(self.codec, ChatTemplateCodec) else None
        self._parser = make_tool_parser(self.tool_parser, tokenizer)
        log.info("task.env.tool_parser=%s: tool calls read by %s parser", self.tool_parser,
                 "vLLM's" if self._parser.backend == "vllm" else "our own")  # fmt: skip
        return self._parser
