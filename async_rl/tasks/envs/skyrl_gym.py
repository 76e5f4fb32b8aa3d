"""Adapter: Gymnasium-style text environments of ``skyrl-gym`` (SkyRL's ``BaseTextEnv``) run unchanged.

Tested with ``skyrl-gym`` 0.4.0 (``pip install 'async-rl[skyrl-gym]'``: it needs only ``func_timeout``,
``pandas``, ``requests`` and ``omegaconf``). What a SkyRL environment needs, and where it comes from here:

* prompts: a JSONL file (``task.jsonl_path``) in SkyRL's dataset layout, one row per line: ``"prompt"``
  (text or chat messages), optionally ``"env_class"`` (else ``task.env.id``), ``"reward_spec"``,
  ``"extra_info"`` and any other field; ``"id"`` names the row. The learner renders the prompt with the
  task's codec (``task.tokenizer``: '' = the toy character tokenizer, else a chat template);
* ``skyrl_gym.make(env_class, env_config=task.env.args, extras=<the row less prompt and env_class>)``
  makes one environment per episode in the generator; ``init(prompt)`` runs before the first step and must
  hand back the prompt it was given (an environment that rewrites its prompt is refused by name: the
  learner issued the prompt's tokens already);
* each model turn is decoded to text and given to ``step``; its ``observations`` (chat messages) are
  rendered with the codec and appended; ``reward`` adds to the episode's reward; ``done`` ends it.
  Numeric ``metadata`` of the last step and ``get_metrics()`` at the end go to the learner's metrics as
  ``reward/env/<name>``.

SkyRL environments are synchronous: every call runs in a worker thread, so a slow tool does not stall the
generator, and the episode's ``env_timeout_s`` bounds each step.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.tasks.envs.base import EnvReply, Episode, RowsEnvTask
from async_rl.tasks.envs.text import Message, TextCodec, as_messages


def _make_env(env_class: str, env_args: Mapping[str, Any], extras: Mapping[str, Any]) -> Any:
    """``skyrl_gym.make`` of ``env_class`` (a registered id, or ``module:Class``, registered on first use)."""
    try:
        import skyrl_gym
        from omegaconf import OmegaConf
    except ImportError as exc:
        raise RuntimeError("task.name=skyrl_gym needs the skyrl-gym package: pip install 'async-rl[skyrl-gym]'") from exc
    if env_class not in skyrl_gym.registry:
        if ":" not in env_class:
            known = ", ".join(sorted(skyrl_gym.registry))
            raise ValueError(f"skyrl_gym: no environment {env_class!r} (registered: {known}; or name 'module:Class')")
        skyrl_gym.register(id=env_class, entry_point=env_class)
    return skyrl_gym.make(env_class, env_config=OmegaConf.create(dict(env_args)), extras=dict(extras))


def numeric_info(values: Mapping[str, Any] | None, prefix: str) -> dict[str, float]:
    """The finite numbers of ``values`` (bools as 0/1), keys prefixed; everything else is left out."""
    out = {}
    for k, v in (values or {}).items():
        if isinstance(v, (bool, int, float, np.integer, np.floating)) and math.isfinite(float(v)):
            out[f"{prefix}{k}"] = float(v)
    return out


class SkyrlGymEpisode(Episode):
    """One SkyRL environment instance driven turn by turn (see the module docstring)."""

    env: Any
    codec: TextCodec
    prompt: list[Message]
    _started: bool

    def __init__(self, env: Any, codec: TextCodec, prompt: list[Message]) -> None:
        self.env, self.codec, self.prompt = env, codec, prompt
        self._started = False

    async def step(self, action_ids: np.ndarray) -> EnvReply:
        if not self._started:
            self._started = True
            first, _ = await asyncio.to_thread(self.env.init, [dict(m) for m in self.prompt])
            if as_messages(first, "init()'s prompt") != self.prompt:
                raise ValueError(f"{type(self.env).__name__}.init() rewrote the prompt; the adapter takes "
                                 "environments that keep the prompt they are given")  # fmt: skip
        out = await asyncio.to_thread(self.env.step, self.codec.decode(action_ids))
        done = bool(out["done"])
        observations = out.get("observations") or []
        tokens = np.zeros(0, dtype=np.int32) if done or not observations else self.codec.reply_ids(observations)
        info = numeric_info(out.get("metadata"), "env/")
        if done:
            info |= numeric_info(await asyncio.to_thread(self.env.get_metrics), "env/")
        return EnvReply(tokens=tokens, reward=float(out["reward"] or 0.0), done=done, info=info)

    async def close(self) -> None:
        await asyncio.to_thread(self.env.close)


class SkyrlGymTask(RowsEnvTask):
    """Prompts from a SkyRL-layout JSONL file, each opening an episode of its ``env_class``."""

    name = "skyrl_gym"
    path: Path
    env_id: str
    env_args: dict[str, Any]
    codec: TextCodec

    def __init__(self, path: str | Path, *, env_id: str, env_args: Mapping[str, Any], codec: TextCodec,
                 seed: int = 0, shuffle: bool = True, max_new_tokens: int = 256,
                 eval_path: str | Path | None = None) -> None:  # fmt: skip
        """``eval_path``: a second file of the same layout, the held-out split (``task.eval_jsonl_path``; SkyRL's
        datasets ship a validation file beside the training one)."""
        self.path = Path(path)
        self.env_id, self.env_args, self.codec = env_id, dict(env_args), codec
        self.seed, self.shuffle, self._max_new_tokens = seed, shuffle, max_new_tokens
        self.rows = self._read(self.path, "task.jsonl_path")
        self.eval_rows = self._read(Path(eval_path), "task.eval_jsonl_path") if eval_path else []

    def _read(self, path: Path, key: str) -> list[tuple[np.ndarray, dict[str, Any]]]:
        if not path.is_file():
            raise ValueError(f"{key} {str(path)!r} is not a file")
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    rows.append(self._parse(line, f"{path}:{lineno}", lineno))
        if not rows:
            raise ValueError(f"{key} {str(path)!r} has no prompts")
        return rows

    def _parse(self, line: str, where: str, lineno: int) -> tuple[np.ndarray, dict[str, Any]]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(row, dict) or "prompt" not in row:
            raise ValueError(f"{where}: each line must be a JSON object with a 'prompt'")
        try:
            messages = as_messages(row.pop("prompt"), f"{where}: 'prompt'")
            ids = self.codec.prompt_ids(messages)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        env_class = str(row.pop("env_class", "") or self.env_id)
        if not env_class:
            raise ValueError(f"{where}: no 'env_class', and task.env.id is not set")
        meta = {"task": self.name, "row": str(row.pop("id", lineno)), "env_class": env_class, "messages": messages,
                "extras": row}  # fmt: skip
        return ids, meta


    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        return self.codec.show(prompt_ids)

    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        env = _make_env(str(metadata["env_class"]), self.env_args, metadata.get("extras") or {})
        return SkyrlGymEpisode(env, self.codec, as_messages(metadata["messages"], "metadata['messages']"))
