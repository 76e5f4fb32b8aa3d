"""Episodes of several turns on the real torch engine: the sample's tokens, loss mask, logprobs, versions and routes
line up per turn (a weight swap between turns shows in the versions), and every way an episode ends (done, turn
limit, token budget, an environment that raises or hangs, one that cannot open) is named in its metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from actors.generator.engine import SamplingParams
from actors.generator.episodes import END_REASONS, EpisodeConfig, run_episode, run_group
from async_rl.model import toy_tokenizer as tt
from async_rl.model.presets import build_model
from async_rl.tasks.envs import EnvReply, EnvTask, Episode, ToolCopyTask
from async_rl.wire import decode_group, encode_group
from async_rl.wire.types import GroupRecord
from tests.unit.test_torch_engine import assert_routes_match, make_engine, reference_logprobs, router_topk

PARAMS = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)


class _Scripted(EnvTask):
    """Replies ``reply`` to every turn; ``fail_at`` / ``hang_at``: that step raises / never returns."""

    name = "scripted"

    def __init__(self, reply: str = "12=", done_at: int = 99, fail_at: int = 0, hang_at: int = 0,
                 on_step: Any = None, cannot_open: bool = False) -> None:  # fmt: skip
        self.reply, self.done_at, self.fail_at, self.hang_at = reply, done_at, fail_at, hang_at
        self.on_step, self.cannot_open = on_step, cannot_open
        self.closed = 0

    @property
    def num_prompts(self) -> int | None:
        return None

    @property
    def max_new_tokens(self) -> int:
        return 4

    def prompt(self, index: int):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        if self.cannot_open:
            raise RuntimeError("no sandbox today")
        return _ScriptedEpisode(self)


class _ScriptedEpisode(Episode):
    def __init__(self, task: _Scripted) -> None:
        self.task, self.turn = task, 0

    async def step(self, action_ids: np.ndarray) -> EnvReply:
        self.turn += 1
        if self.turn == self.task.fail_at:
            raise ValueError("the tool crashed")
        if self.turn == self.task.hang_at:
            await asyncio.sleep(3600)
        if self.task.on_step is not None:
            await self.task.on_step(self.turn)
        done = self.turn >= self.task.done_at
        return EnvReply(tokens=np.array(tt.encode(self.task.reply), np.int32), reward=float(self.turn), done=done,
                        info={"turn_seen": float(self.turn)})  # fmt: skip

    async def close(self) -> None:
        self.task.closed += 1


PROMPT = np.array([tt.BOS_ID, *tt.encode(",")], dtype=np.int32)


def _ended(s) -> str:  # type: ignore[no-untyped-def]
    (reason,) = [r for r in END_REASONS if s.reward_info[f"episode/end_{r}"] == 1.0]
    return reason


async def test_tool_copy_episode_lines_up_with_a_full_forward():
    """Tokens, mask, logprobs and routes of a tool_copy episode agree with one uncached forward of the whole
    sequence; the sample survives the wire."""
    model = build_model("tiny-moe", seed=3)
    engine = make_engine(model)
    engine.stage_weights({k: v.clone() for k, v in model.state_dict().items()}, 0)
    assert await engine.wait_applied(0, timeout_s=30)
    task = ToolCopyTask(min_digits=3, max_digits=3)
    spec = task.prompt(7)
    params = SamplingParams(n=8, max_new_tokens=task.max_new_tokens, temperature=1.0, seed=None)
    samples = await run_group(engine, task, spec.metadata, spec.prompt_ids, params, EpisodeConfig())
    cfg = engine.model.config
    ties = 0
    for s in samples:
        assert _ended(s) == "done" and s.reward_info["episode/turns"] == 2.0
        mask = s.model_token_mask()
        env = np.flatnonzero(~mask)
        called = s.reward_info["called"] == 1.0
        reply = tt.encode((spec.metadata["target"] if called else "") + "=")
        assert env.size == len(reply) and np.array_equal(s.response_ids[env], reply)  # one contiguous reply
        assert np.all(np.diff(env) == 1) and env[0] > 0 and env[-1] < s.response_ids.size - 1
        assert np.all(s.logprobs[env] == 0.0) and np.all(s.versions == 0)
        # Behaviour logprobs of the model's tokens are the model's, read from the full sequence.
        full = reference_logprobs(engine.model, spec.prompt_ids, s.response_ids, params)
        np.testing.assert_allclose(s.logprobs[mask], full[mask], atol=1e-4)
        run = np.concatenate([spec.prompt_ids, s.response_ids[:-1]])  # every position but the last was run
        assert s.routes is not None and s.routes.shape == (run.size, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        expected, probs = router_topk(engine.model, run, cfg.num_experts_per_tok)
        ties += assert_routes_match(s.routes, expected, probs)
    assert ties <= 2
    rec = GroupRecord(group_id="g", prompt_id=spec.prompt_id, generator_id="t", created_at=1.0,
                      prompt_ids=spec.prompt_ids, samples=samples)  # fmt: skip
    back = decode_group(encode_group(rec))
    for a, b in zip(samples, back.samples, strict=True):
        np.testing.assert_array_equal(a.model_token_mask(), b.model_token_mask())
    await engine.close()


async def test_a_weight_swap_between_turns_shows_in_the_versions():
    """The environment's step stages version 1 and waits until it is loaded: turn 1 ran on version 0, the reply's
    prefill and turn 2 on version 1."""
    model = build_model("tiny-moe", seed=0)
    engine = make_engine(model, stop_on_eos=False)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    engine.stage_weights(sd, 0)
    assert await engine.wait_applied(0, timeout_s=30)

    async def swap(turn: int) -> None:
        if turn == 1:
            engine.stage_weights({k: v.clone() for k, v in sd.items()}, 1)
            assert await engine.wait_applied(1, timeout_s=30)  # the engine is idle between turns: swapped at once

    task = _Scripted(reply="55=", done_at=2, on_step=swap)
    s = await run_episode(engine, task, {}, PROMPT, PARAMS, EpisodeConfig())
    assert _ended(s) == "done" and s.reward == 1.0 + 2.0 and s.reward_info["turn_seen"] == 2.0
    np.testing.assert_array_equal(s.loss_mask, [1] * 4 + [0] * 3 + [1] * 4)
    np.testing.assert_array_equal(s.versions, [0] * 4 + [1] * 3 + [1] * 4)
    assert s.routes is not None and s.routes.shape[0] == PROMPT.size + s.response_ids.size - 1
    assert task.closed == 1
    await engine.close()


@pytest.mark.parametrize(
    ("task", "cfg", "reason", "turns"),
    [
        (_Scripted(done_at=3), EpisodeConfig(), "done", 3),
        (_Scripted(), EpisodeConfig(max_turns=2), "max_turns", 2),
        (_Scripted(), EpisodeConfig(max_tokens=10), "token_budget", 2),  # 4 + 3 + (3 < 4 left) and no room after
        (_Scripted(fail_at=2), EpisodeConfig(), "env_error", 2),
        (_Scripted(hang_at=1), EpisodeConfig(env_timeout_s=0.2), "env_timeout", 1),
        (_Scripted(cannot_open=True), EpisodeConfig(), "env_error", 0),
    ],
    ids=["done", "max_turns", "token_budget", "env_error", "env_timeout", "cannot_open"],
)
async def test_every_end_is_named(task: _Scripted, cfg: EpisodeConfig, reason: str, turns: int):
    engine = make_engine(build_model("tiny-moe", seed=0), stop_on_eos=False)
    s = await run_episode(engine, task, {}, PROMPT, PARAMS, cfg)
    assert _ended(s) == reason and s.reward_info["episode/turns"] == turns
    assert s.finish_reason == {"done": "length", "max_turns": "length", "token_budget": "length"}.get(reason, "abort")
    assert s.response_ids.size <= cfg.max_tokens
    assert s.response_ids.size == 0 or s.loss_mask is None or s.model_token_mask()[-1]  # ends on a model turn
    assert task.closed == (0 if task.cannot_open else 1)
    await engine.close()
