"""Adapter: an environment served by another process or host (``task.name=http``, ``task.env.url``), over OpenEnv's
protocol, so that a slow or unsafe environment does not share the generator's process.

The server is ``async-rl env-serve`` (:mod:`.env_server`), which serves any of our environments (a built-in one or
``file.py:Class``). The protocol is OpenEnv's (``meta-pytorch/OpenEnv``, ``openenv.core.env_server``), its actions
and observations ours, in token ids (:data:`PROTOCOL`):

* ``GET /health`` -> ``{"status": "healthy"}``; ``GET /metadata`` -> ``{"name", "description", "version",
  "protocol", "num_prompts", "max_new_tokens", "held_out"}``.
* ``POST /reset`` (stateless, as OpenEnv's: a prompt is a fresh episode's first observation) with
  ``{"prompt_index": i}`` (or ``{"eval_index": j}``, the held-out split) -> ``{"observation": {"prompt_id",
  "prompt_ids", "metadata", "text"}, "reward": null, "done": false}``: the learner's prompts (``text``: as the
  model reads it, for the learner's log).
* ``WS /ws``, one episode per connection, JSON messages: ``{"type": "reset", "data": {"metadata": {...}}}`` opens the
  episode of the prompt whose metadata that is; ``{"type": "step", "data": {"tokens": [...]}}`` hands it the model's
  turn and is answered ``{"type": "observation", "data": {"observation": {"tokens": [...], "info": {...}},
  "reward": r, "done": d}}``; ``{"type": "state"}`` -> ``{"type": "state", "data": {"episode_id", "step_count"}}``;
  ``{"type": "close"}`` ends it. A failure is ``{"type": "error", "data": {"message", "code"}}``.

Errors. The learner and every generator contact the server when the task is built: one that does not answer within
:data:`CONNECT_TIMEOUT_S` ends the process in one line naming ``task.env.url`` and the reason, before the run starts.
In an episode, an error answered by the server (the environment raised), a refused connection or a dropped session
raise from :meth:`HttpEpisode.step`: the episode ends ``env_error`` and its group is dead-lettered with the server's
message, as for an environment in the generator's own process; a step slower than ``episode.env_timeout_s`` ends its
episode (``env_timeout``). The learner asks for each prompt with a short blocking request (a kept-alive connection).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Mapping
from typing import Any

import numpy as np

from async_rl.tasks.envs.base import EnvReply, EnvTask, Episode, as_tokens
from async_rl.wire import PromptSpec

PROTOCOL = "async-rl-tokens/1"
"""The actions and observations spoken over OpenEnv's protocol (token ids; see the module docstring)."""
CONNECT_TIMEOUT_S = 5.0
"""Longest wait for a server to answer a connection or a request of the learner (seconds): an unreachable server is
named within that."""
TEXTS_KEPT = 8
"""Prompts whose text (from the server) is kept for :meth:`HttpEnvTask.prompt_text`: the learner shows its first."""


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, path prefix) of an ``http://`` URL; ValueError naming ``task.env.url`` otherwise."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ValueError(f"task.env.url must be http://host:port of an environment server (async-rl env-serve), "
                         f"got {url!r}")  # fmt: skip
    return parsed.hostname, parsed.port or 80, parsed.path.rstrip("/")


class _Http:
    """Blocking JSON requests to one server over a kept-alive connection (the learner's side)."""

    url: str
    _conn: http.client.HTTPConnection
    _prefix: str

    def __init__(self, url: str, timeout_s: float) -> None:
        host, port, self._prefix = split_url(url)
        self.url = url
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout_s)

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile is opened again once
            try:
                self._conn.request(method, self._prefix + path, body=data, headers={"Content-Type": "application/json"})
                resp = self._conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._conn.close()
                if attempt:
                    raise ConnectionError(f"environment server {self.url} dropped the connection ({exc!r})") from exc
            except OSError as exc:  # refused, unreachable, timed out
                self._conn.close()
                raise ConnectionError(f"environment server {self.url} does not answer ({_reason(exc)})") from exc
        try:
            out = json.loads(raw)
        except ValueError:
            raise ConnectionError(f"{self.url}{path} answered HTTP {resp.status} with no JSON: is it an environment "
                                  "server (async-rl env-serve)?") from None  # fmt: skip
        if resp.status != 200:
            detail = out.get("detail") if isinstance(out, dict) else out
            raise RuntimeError(f"environment server {self.url}: {method} {path} failed (HTTP {resp.status}): {detail}")
        return out


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused: is async-rl env-serve running there?"
    return f"{type(exc).__name__}: {exc}"


class HttpEpisode(Episode):
    """One episode on the server: a WebSocket session opened at the first step (see the module docstring)."""

    url: str
    metadata: dict[str, Any]
    _session: Any
    _ws: Any

    def __init__(self, url: str, metadata: Mapping[str, Any]) -> None:
        self.url, self.metadata = url.rstrip("/"), dict(metadata)
        self._session = self._ws = None

    async def _open(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S))
        try:
            self._ws = await self._session.ws_connect(f"{self.url}/ws", max_msg_size=0)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise ConnectionError(f"environment server {self.url} does not answer ({_reason(exc)})") from exc
        await self._send({"type": "reset", "data": {"metadata": self.metadata}})

    async def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        await self._ws.send_str(json.dumps(message))
        msg = await self._ws.receive()
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise ConnectionError(f"environment server {self.url} closed the episode's session ({msg.type.name})")
        answer = json.loads(msg.data)
        if answer.get("type") == "error":
            data = answer.get("data", {})
            raise RuntimeError(f"environment server {self.url}: {data.get('message')} ({data.get('code')})")
        return answer["data"]

    async def step(self, action_ids: np.ndarray) -> EnvReply:
        if self._ws is None:
            await self._open()
        data = await self._send({"type": "step", "data": {"tokens": np.asarray(action_ids).tolist()}})
        obs = data.get("observation", {})
        return EnvReply(tokens=as_tokens(obs.get("tokens", []), "the server's reply tokens"),
                        reward=float(data.get("reward") or 0.0), done=bool(data.get("done")),
                        info={str(k): float(v) for k, v in (obs.get("info") or {}).items()})  # fmt: skip

    async def close(self) -> None:
        try:
            if self._ws is not None and not self._ws.closed:
                await self._ws.send_str(json.dumps({"type": "close"}))
                await self._ws.close()
        finally:
            if self._session is not None:
                await self._session.close()


class HttpEnvTask(EnvTask):
    """The prompts and episodes of an environment server (``task.name=http``; module docstring). Its ``name`` is the
    served task's (it labels prompts and metrics)."""

    name = "http"
    url: str
    description: str
    held_out: bool
    _num_prompts: int | None
    _max_new_tokens: int
    _http: _Http
    _texts: dict[bytes, str]
    """The server's text of the first prompts fetched (the learner logs its first prompt as the model reads it)."""

    def __init__(self, url: str, *, max_new_tokens: int = 0, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self._http = _Http(self.url, timeout_s)
        try:
            meta = self._http.request("GET", "/metadata")
        except (ConnectionError, RuntimeError) as exc:
            raise ValueError(f"task.env.url: {exc}") from None
        if not isinstance(meta, dict) or meta.get("protocol") != PROTOCOL:
            got = meta.get("protocol") if isinstance(meta, dict) else None
            raise ValueError(f"task.env.url: {self.url} is a server of protocol {got!r}, not {PROTOCOL!r} (an "
                             "environment served by async-rl env-serve of the same version)")  # fmt: skip
        self.name, self.description = str(meta["name"]), str(meta.get("description", ""))
        self._num_prompts = meta.get("num_prompts")
        self._max_new_tokens = max_new_tokens or int(meta["max_new_tokens"])
        self.held_out = bool(meta.get("held_out"))
        self._texts = {}

    @property
    def num_prompts(self) -> int | None:
        return self._num_prompts

    @property
    def max_new_tokens(self) -> int:
        return self._max_new_tokens

    def _prompt(self, body: dict[str, int]) -> PromptSpec:
        obs = self._http.request("POST", "/reset", body)["observation"]
        ids = as_tokens(obs["prompt_ids"], f"{self.url} prompt {body}")
        if len(self._texts) < TEXTS_KEPT:
            self._texts[ids.tobytes()] = str(obs.get("text", ""))
        return PromptSpec(prompt_id=str(obs["prompt_id"]), prompt_ids=ids, metadata=dict(obs["metadata"]))

    def prompt(self, index: int) -> PromptSpec:
        return self._prompt({"prompt_index": index})

    def eval_prompt(self, index: int) -> PromptSpec:
        if not self.held_out:
            raise ValueError(f"the environment served at {self.url} ({self.name}) has no held-out split")
        return self._prompt({"eval_index": index})

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        return self._texts.get(np.asarray(prompt_ids, dtype=np.int32).tobytes()) or super().prompt_text(prompt_ids)

    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        return HttpEpisode(self.url, metadata)
