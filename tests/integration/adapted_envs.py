"""Environments written against other systems' APIs (not ours), for the adapter tests: each is the ``tool_copy`` game
(call the tool with ``*``, get the hidden digits, copy them) in the toy vocabulary, as a user of that system would
write it. The generator process imports them by name (``tests.integration.adapted_envs:...``)."""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class DigitLookupEnv(BaseTextEnv):
    """A skyrl-gym ``BaseTextEnv``: the ground truth comes in ``extras["reward_spec"]``, as in SkyRL's datasets."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.target = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = 2
        self.called = False

    def init(self, prompt):  # type: ignore[no-untyped-def]
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        if self.turns == 1:
            self.called = "*" in action
            content = (self.target if self.called else "") + "="
            return BaseTextEnvStepOutput(observations=[{"role": "tool", "content": content}], reward=0.0, done=False,
                                         metadata={"called": self.called})  # fmt: skip
        correct = action.strip() == self.target
        return BaseTextEnvStepOutput(observations=[], reward=0.5 * self.called + 0.5 * correct, done=True,
                                     metadata={"correct": correct, "note": "not a number: left out"})  # fmt: skip

    def get_metrics(self) -> dict[str, Any]:
        return {"steps": self.turns}
