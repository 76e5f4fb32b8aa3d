"""The environment server: any of our environments (an :class:`~async_rl.tasks.envs.base.EnvTask`) served over
OpenEnv's protocol to the ``http`` adapter of learners and generators on other processes or hosts
(``async-rl env-serve``; the protocol is described in :mod:`.http`).

One aiohttp application: ``/health``, ``/metadata``, ``/reset`` (stateless: a prompt by index) and ``/ws`` (one
episode per WebSocket session, opened by ``reset`` with the prompt's metadata, driven by ``step``, ended by ``close``
or by the connection's end; the episode's ``close()`` runs however it ends). Episodes of all connections run
concurrently in the server's event loop, as in a generator. An environment that raises answers that message with an
``error`` (``EXECUTION_ERROR``: the exception's type and message; logged once per kind with its traceback, then
counted) and its session stays open; the client makes its group a dead letter. A malformed message is answered an
``error`` too (``INVALID_JSON``, ``UNKNOWN_TYPE``, ``VALIDATION_ERROR``), never a crash of the server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web

from async_rl.process.repeated import RepeatedLine
from async_rl.tasks.envs.base import EnvTask, Episode, as_tokens
from async_rl.tasks.envs.http import PROTOCOL
from async_rl.tasks.user import has_held_out
from async_rl.wire import PromptSpec

log = logging.getLogger(__name__)


def _error(message: str, code: str) -> dict[str, Any]:
    return {"type": "error", "data": {"message": message, "code": code}}


class EnvServer:
    """Serves one task's prompts and episodes (module docstring)."""

    task: EnvTask
    _ids: itertools.count
    _errors: dict[str, RepeatedLine]
    """Per kind of environment error (exception type and where), its log line (once, then counted)."""
    num_sessions: int
    """Episodes open now."""

    def __init__(self, task: EnvTask) -> None:
        if not isinstance(task, EnvTask):
            raise ValueError(f"async-rl env-serve serves environments (an EnvTask), and {task.name!r} is a "
                             f"{type(task).__name__}: one answer per prompt, scored where it is generated")  # fmt: skip
        self.task = task
        self._ids = itertools.count()
        self._errors = {}
        self.num_sessions = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metadata", self._metadata)
        app.router.add_post("/reset", self._reset)
        app.router.add_get("/ws", self._ws)
        return app

    def metadata(self) -> dict[str, Any]:
        doc = (type(self.task).__doc__ or "").strip().split("\n\n")[0]
        return {"name": self.task.name, "description": " ".join(doc.split()), "version": _version(),
                "protocol": PROTOCOL, "num_prompts": self.task.num_prompts,
                "max_new_tokens": self.task.max_new_tokens, "held_out": has_held_out(type(self.task))}  # fmt: skip

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy"})

    async def _metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self.metadata())

    async def _reset(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"detail": "the body must be JSON"}, status=422)
        index = body.get("prompt_index", body.get("eval_index")) if isinstance(body, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            return web.json_response({"detail": "reset needs {\"prompt_index\": i} or {\"eval_index\": j}, i, j >= 0 "
                                                f"integers; got {body!r:.200}"}, status=422)  # fmt: skip
        try:
            spec = self.task.prompt(index) if "prompt_index" in body else self.task.eval_prompt(index)
            payload = _prompt_payload(self.task, spec)
        except Exception as exc:  # the task's own failure: the client gets its message, the server goes on
            self._log_error(exc, "prompt")
            return web.json_response({"detail": f"{type(exc).__name__}: {exc}"}, status=500)
        return web.json_response({"observation": payload, "reward": None, "done": False})

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        episode: Episode | None = None
        episode_id, steps = "", 0
        self.num_sessions += 1
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                try:
                    message = json.loads(msg.data)
                except ValueError as exc:
                    await ws.send_json(_error(f"Invalid JSON: {exc}", "INVALID_JSON"))
                    continue
                kind = message.get("type") if isinstance(message, dict) else None
                data = message.get("data") if isinstance(message, dict) else None
                if kind == "close":
                    break
                if kind == "state":
                    await ws.send_json({"type": "state", "data": {"episode_id": episode_id, "step_count": steps}})
                elif kind == "reset":
                    if not isinstance(data, dict) or not isinstance(data.get("metadata"), dict):
                        await ws.send_json(_error('reset needs data {"metadata": {...}}', "VALIDATION_ERROR"))
                        continue
                    if episode is not None:
                        await _close(episode)
                        episode = None
                    try:
                        episode = self.task.episode(data["metadata"])
                    except Exception as exc:
                        await ws.send_json(_error(self._log_error(exc, "episode"), "EXECUTION_ERROR"))
                        continue
                    episode_id, steps = f"{self.task.name}-{next(self._ids)}", 0
                    await ws.send_json({"type": "observation", "data": {"observation": {}, "reward": None,
                                                                        "done": False}})  # fmt: skip
                elif kind == "step":
                    tokens = data.get("tokens") if isinstance(data, dict) else None
                    if episode is None or tokens is None:
                        why = "no episode: reset first" if episode is None else 'step needs data {"tokens": [...]}'
                        await ws.send_json(_error(why, "VALIDATION_ERROR"))
                        continue
                    try:
                        reply = await episode.step(as_tokens(tokens, "step tokens"))
                        steps += 1
                        answer = {"observation": {"tokens": np.asarray(reply.tokens).tolist(),
                                                  "info": {k: float(v) for k, v in reply.info.items()}},
                                  "reward": float(reply.reward), "done": bool(reply.done)}  # fmt: skip
                    except Exception as exc:  # the environment's failure: this step's answer, the session goes on
                        await ws.send_json(_error(self._log_error(exc, "step"), "EXECUTION_ERROR"))
                        continue
                    await ws.send_json({"type": "observation", "data": answer})
                else:
                    await ws.send_json(_error(f"Unknown message type: {kind!r}", "UNKNOWN_TYPE"))
        finally:
            self.num_sessions -= 1
            if episode is not None:
                await _close(episode)
        return ws

    def _log_error(self, exc: Exception, where: str) -> str:
        """Log ``exc`` (once per kind, with its traceback, then counted); the message the client gets."""
        message = f"{type(exc).__name__}: {exc}"
        kind = f"{where} raised {type(exc).__name__}"
        line = self._errors.get(kind)
        if line is None:
            first = message.replace("{", "{{").replace("}", "}}")
            line = self._errors[kind] = RepeatedLine(
                log, f"task {self.task.name}: {kind} on {{n}} request(s), answered as errors: {first}",
                level=logging.WARNING)  # fmt: skip
        line.add(exc_info=exc)
        return message


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("async-rl")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "unknown"


def _prompt_payload(task: EnvTask, spec: PromptSpec) -> dict[str, Any]:
    json.dumps(spec.metadata)  # what cannot travel as JSON is the task's error, named here
    return {"prompt_id": spec.prompt_id, "prompt_ids": np.asarray(spec.prompt_ids).tolist(),
            "metadata": spec.metadata, "text": task.prompt_text(spec.prompt_ids)}  # fmt: skip


async def _close(episode: Episode) -> None:
    try:
        await episode.close()
    except Exception as exc:  # closing is best effort, as in the generator's episode runner
        log.warning("closing an episode raised %r", exc)


async def serve(task: EnvTask, host: str, port: int, stop: asyncio.Event, on_ready: Any = None) -> None:
    """Serve ``task`` on ``host:port`` (0: a free port) until ``stop`` is set; ``on_ready(url)`` once listening."""
    runner = web.AppRunner(EnvServer(task).app(), handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        if on_ready is not None:
            on_ready(f"http://{host}:{bound}")
        await stop.wait()
    finally:
        await runner.cleanup()
