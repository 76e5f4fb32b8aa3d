"""The generator's side of an episode of several turns: run it on the engine, return one sample.

:func:`run_episode` alternates model turns (:meth:`Engine.generate` on the whole context so far, one
sample) and environment steps (:meth:`async_rl.tasks.envs.Episode.step`), and assembles what the learner
trains on as one :class:`~async_rl.wire.types.Sample`:

* ``response_ids``: every token after the prompt, the model's and the environment's, in order;
* ``loss_mask``: 1 on the model's tokens, 0 on the environment's (never in the loss);
* ``logprobs``: the behaviour logprob of each model token, 0 on the environment's;
* ``versions``: the weight version of each model token (a swap between or inside turns shows); an
  environment token carries the version that ran its prefill: that of the next turn's first token;
* ``routes``: for each position, the experts of the forward pass that first ran it: the prompt in the
  first turn's prefill, a model token in its turn's decode, an environment reply in the next turn's
  prefill (the positions a KV-caching engine would run once). Where a turn recorded no routes for a
  position the routes stop there (positions past ``routes.shape[0]`` are not replayed).

Limits (:class:`EpisodeConfig`): model turns, response tokens per episode (model and environment
together), and a timeout per environment step. An environment that raises or times out ends its
episode only (one that raises also costs its group: the generator dead-letters it, :mod:`actors.generator.scoring`);
why an episode ended is in the sample's ``reward_info`` (``episode/end_<reason>``, one
of :data:`END_REASONS`, 1.0 for the reason that applied), with ``episode/turns`` and
``episode/env_tokens``, so the learner's metrics show them as ``reward/episode/...``.
Episodes of one prompt group and of several prompts run concurrently; the torch engine batches
the turns that wait together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from async_rl.tasks.envs.base import EnvTask, as_tokens
from async_rl.wire.types import Sample

if TYPE_CHECKING:  # the generator's config imports EpisodeConfig from here before anything heavy
    from actors.generator.engine import Engine, SamplingParams

log = logging.getLogger(__name__)

END_REASONS = ("done", "max_turns", "token_budget", "env_error", "env_timeout", "abort")
"""Why an episode ended: the environment said done; the turn limit; the token budget; the environment raised; an
environment step took longer than ``env_timeout_s``; the engine aborted the turn (shutdown)."""


@dataclass(kw_only=True, slots=True)
class EpisodeConfig:
    """Limits of the episodes an environment task runs (``episode``); single-turn tasks ignore them."""

    max_turns: int = 8
    """Model turns per episode; the episode ends (``max_turns``) after this many."""
    max_tokens: int = 1024
    """Response tokens per episode, the model's and the environment's together (prompt + this must fit the
    model's context); the last model turn is cut to what is left, and a reply that would leave no room for one
    more model token ends the episode (``token_budget``)."""
    env_timeout_s: float = 30.0
    """Longest one environment step may take; a slower one ends the episode (``env_timeout``)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError("generator.episode.max_turns must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("generator.episode.max_tokens must be >= 1")
        if self.env_timeout_s <= 0:
            raise ValueError("generator.episode.env_timeout_s must be > 0")


async def run_group(engine: Engine, task: EnvTask, metadata: Mapping[str, Any], prompt_ids: np.ndarray,
                    params: SamplingParams, cfg: EpisodeConfig,
                    on_error: Callable[[BaseException], None] | None = None) -> list[Sample]:  # fmt: skip
    """``params.n`` episodes of one prompt, concurrently; one sample each, in order."""
    one = dataclasses.replace(params, n=1)
    return list(await asyncio.gather(*(run_episode(engine, task, metadata, prompt_ids, one, cfg, on_error)
                                       for _ in range(params.n))))  # fmt: skip


async def run_episode(engine: Engine, task: EnvTask, metadata: Mapping[str, Any], prompt_ids: np.ndarray,
                      params: SamplingParams, cfg: EpisodeConfig,
                      on_error: Callable[[BaseException], None] | None = None) -> Sample:  # fmt: skip
    """One episode of ``task`` from ``prompt_ids`` (see the module docstring); ``params.n`` must be 1.

    Engine errors propagate (the generator's own failure); environment errors end the episode and go to
    ``on_error`` (the generator's :class:`~actors.generator.scoring.Scoring`: the group is dead-lettered), else to
    the log."""

    def env_error(exc: BaseException, what: str) -> None:
        if on_error is not None:
            on_error(exc)
        else:
            log.warning("task %s: %s %r; episode ended", task.name, what, exc)

    assert params.n == 1, "one episode samples one response per turn"
    prompt = as_tokens(prompt_ids, "prompt_ids")
    trace = _Trace(prompt)
    reward, info = 0.0, {}
    end, finish = "", "stop"
    try:
        episode = task.episode(metadata)
    except Exception as exc:  # no episode: an empty sample (never trained on) says why
        env_error(exc, "could not open an episode:")
        return trace.sample(0.0, "abort", _info({}, "env_error", trace))
    try:
        while True:
            left = cfg.max_tokens - trace.num_tokens
            turn = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, left))
            [[c]] = await engine.generate([trace.context()], turn)
            trace.model_turn(c.token_ids, c.logprobs, c.versions, c.routes)
            finish = c.finish_reason
            if finish == "abort":
                end = "abort"
                break
            try:
                reply = await asyncio.wait_for(episode.step(np.asarray(c.token_ids, dtype=np.int32)),
                                               cfg.env_timeout_s)  # fmt: skip
                tokens = as_tokens(reply.tokens, "the environment's reply tokens")
                reward += _finite(reply.reward, "the environment's reward")
                info.update({str(k): _finite(v, f"info[{k!r}]") for k, v in reply.info.items()})
            except TimeoutError:
                end, finish = "env_timeout", "abort"
                log.warning("task %s: an environment step took over %.1fs; episode ended", task.name,
                            cfg.env_timeout_s)  # fmt: skip
                break
            except Exception as exc:  # an environment's failure ends its episode, never the generator
                end, finish = "env_error", "abort"
                env_error(exc, "the environment raised")
                break
            if reply.done:
                end = "done"
                break
            if trace.num_turns >= cfg.max_turns:
                end, finish = "max_turns", "length"
                break
            if trace.num_tokens + tokens.size >= cfg.max_tokens:
                end, finish = "token_budget", "length"
                break
            trace.env_reply(tokens)
    finally:
        try:
            await episode.close()
        except Exception as exc:  # closing is best effort; the sample is already whole
            log.warning("task %s: closing an episode raised %r", task.name, exc)
    return trace.sample(reward, finish, _info(info, end, trace))


def _info(info: dict[str, float], end: str, trace: _Trace) -> dict[str, float]:
    """The episode's own components, then why it ended and its size (every key in every sample)."""
    ends = {f"episode/end_{r}": float(r == end) for r in END_REASONS}
    stats = {"episode/turns": float(trace.num_turns), "episode/env_tokens": float(trace.num_env_tokens)}
    return {**info, **ends, **stats}

class _Trace:
    """The growing sequence of one episode: tokens, loss mask, logprobs, versions and routes."""

    prompt: np.ndarray
    ids: list[np.ndarray]
    mask: list[np.ndarray]
    logprobs: list[np.ndarray]
    versions: list[np.ndarray]
    routes: list[np.ndarray]
    routed: int
    """Positions (prompt included) whose routes are in ``routes``."""
    routes_broken: bool
    """A turn recorded fewer routes than it ran: later positions are not replayed."""
    num_turns: int
    num_tokens: int
    num_env_tokens: int
    _pending_env: list[np.ndarray]
    """Versions of the environment tokens waiting for the next turn's first version."""

    def __init__(self, prompt: np.ndarray) -> None:
        self.prompt = prompt
        self.ids, self.mask, self.logprobs, self.versions, self.routes = [], [], [], [], []
        self.routed = 0
        self.routes_broken = False
        self.num_turns = self.num_tokens = self.num_env_tokens = 0
        self._pending_env = []

    def context(self) -> np.ndarray:
        return np.concatenate([self.prompt, *self.ids]) if self.ids else self.prompt

    def model_turn(self, ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray,
                   routes: np.ndarray | None) -> None:  # fmt: skip
        n = int(ids.size)
        context_len = self.prompt.size + self.num_tokens
        if n and self._pending_env:
            for v in self._pending_env:
                v[:] = int(versions[0])  # the environment's reply was prefilled by the model that sampled this
            self._pending_env = []
        # Routes of the positions first run in this turn: the unrouted context (its prefill) and this turn's
        # tokens fed back (all but the last, which the next turn's prefill runs).
        upto = context_len + n - 1
        if routes is not None and not self.routes_broken:
            have = min(int(routes.shape[0]), upto)
            if have > self.routed:
                self.routes.append(np.asarray(routes[self.routed : have]))
                self.routed = have
            self.routes_broken = have < upto
        elif routes is None and self.routes:
            self.routes_broken = True
        self.ids.append(np.asarray(ids, dtype=np.int32))
        self.mask.append(np.ones(n, dtype=np.uint8))
        self.logprobs.append(np.asarray(logprobs, dtype=np.float32))
        self.versions.append(np.asarray(versions, dtype=np.int32))
        self.num_turns += 1
        self.num_tokens += n

    def env_reply(self, tokens: np.ndarray) -> None:
        n = int(tokens.size)
        self.ids.append(tokens)
        self.mask.append(np.zeros(n, dtype=np.uint8))
        self.logprobs.append(np.zeros(n, dtype=np.float32))
        versions = np.zeros(n, dtype=np.int32)
        self.versions.append(versions)
        self._pending_env.append(versions)
        self.num_tokens += n
        self.num_env_tokens += n

    def sample(self, reward: float, finish: str, info: dict[str, float]) -> Sample:
        assert not self._pending_env, "an environment reply is always followed by a model turn"
        routes = np.concatenate(self.routes) if self.routes else None
        if not self.ids:  # no turn ran (the episode could not open)
            empty = np.zeros(0, dtype=np.int32)
            return Sample(response_ids=empty, logprobs=np.zeros(0, dtype=np.float32), versions=empty, reward=reward,
                          finish_reason=finish, reward_info=info)  # fmt: skip
        mask = np.concatenate(self.mask)
        return Sample(response_ids=np.concatenate(self.ids), logprobs=np.concatenate(self.logprobs),
                      versions=np.concatenate(self.versions), reward=reward, finish_reason=finish, routes=routes,
                      reward_info=info, loss_mask=None if mask.all() else mask)  # fmt: skip


def _finite(value: Any, what: str) -> float:
    v = float(value)
    if not np.isfinite(v):
        raise ValueError(f"{what} must be finite, got {v}")
    return v
