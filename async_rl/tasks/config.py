"""Task configuration and the one function that builds a :class:`~async_rl.tasks.base.Task` from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from async_rl.envs.config import EnvConfig
from async_rl.tasks.base import Task, load_reward_fn
from async_rl.tasks.jsonl import BUILTIN_REWARDS, JsonlTask
from async_rl.tasks.toy import TOY_TASKS, ToyTask

ENV_TASKS = ("tool_copy", "python_tool", "skyrl_gym", "verifiers")
"""Tasks whose prompts open episodes of several turns (:mod:`async_rl.envs`)."""
TASK_NAMES = (*TOY_TASKS, "jsonl", *ENV_TASKS)


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """Which prompts to issue and how responses are rewarded."""

    name: str = "copy"
    """copy | reverse | sort | add (built-in toy tasks), jsonl (prompts from ``jsonl_path``) or tool_copy (a toy
    environment of two turns: call a tool, then copy what it returned), python_tool (questions answered with a
    sandboxed Python tool, rows from ``jsonl_path``), skyrl_gym or verifiers (environments of those packages,
    through their adapters; see docs/environments.md)."""
    seed: int = 0
    """Seed of the prompt stream (prompt i depends only on seed and i)."""
    min_digits: int = 5
    """Toy tasks and tool_copy: fewest digits per operand (tool_copy: of the hidden string)."""
    max_digits: int = 5
    """Toy tasks: most digits per operand."""
    strict_length: bool = True
    """Toy tasks: a wrong response length costs reward, so the reward is 1.0 only for the exact answer (False: a
    right prefix earns full credit whatever follows; see ``async_rl.tasks.base.positional_credit``)."""
    jsonl_path: str = ""
    """jsonl: the prompt file."""
    prompt_field: str = "prompt"
    """jsonl: field holding the prompt text."""
    tokenizer: str = ""
    """jsonl: tokenizer for prompt text, a preset or HF directory ('' = the toy char tokenizer)."""
    add_bos: bool = True
    """jsonl: put the tokenizer's bos token in front of text prompts."""
    shuffle: bool = True
    """jsonl: reshuffle every epoch (deterministically from seed and epoch)."""
    reward: str = ""
    """'module:function' of a user's reward, or for jsonl a built-in (exact_match, positional); '' = default."""
    max_new_tokens: int = 0
    """Response budget the generators use (0: the task's own, e.g. digits + 1 for copy; 32 for jsonl; per model
    turn for environments, 128 for skyrl_gym and verifiers)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """skyrl_gym / verifiers: which environment, built with which arguments; python_tool: ``args`` are the
    sandbox's limits (``async_rl.envs.sandbox.SandboxConfig``)."""

    def __post_init__(self) -> None:
        if self.name not in TASK_NAMES:
            raise ValueError(f"task.name must be one of {list(TASK_NAMES)}, got {self.name!r}")
        if self.min_digits < 1:
            raise ValueError("task.min_digits must be >= 1")
        if self.max_digits < self.min_digits:
            raise ValueError("task.max_digits must be >= task.min_digits")
        if self.name in ("jsonl", "skyrl_gym", "python_tool") and not self.jsonl_path:
            raise ValueError(f"task.jsonl_path is required when task.name is {self.name!r}")
        if self.name == "verifiers" and not self.env.id:
            raise ValueError("task.env.id ('module:function' returning the vf.Environment) is required when "
                             "task.name is 'verifiers'")
        builtin_ok = self.name == "jsonl" and self.reward in BUILTIN_REWARDS
        if self.reward and ":" not in self.reward and not builtin_ok:
            also = f" or one of {list(BUILTIN_REWARDS)}" if self.name == "jsonl" else ""
            raise ValueError(f"task.reward must be 'module:function'{also}, got {self.reward!r}")
        if self.max_new_tokens < 0:
            raise ValueError("task.max_new_tokens must be >= 0")


def build_task(config: TaskConfig) -> Task:
    """The task ``config`` describes (imports a user's reward function; ValueError if it cannot)."""
    if config.name == "tool_copy":
        from async_rl.envs.tool_copy import ToolCopyTask

        if config.reward:
            raise ValueError("task.reward cannot be set for tool_copy: its environment scores the episode")
        return ToolCopyTask(seed=config.seed, min_digits=config.min_digits, max_digits=config.max_digits)
    if config.name in ("skyrl_gym", "verifiers", "python_tool"):
        return _adapted_task(config)
    reward_fn = load_reward_fn(config.reward) if ":" in config.reward else None
    if config.name == "jsonl":
        tokenizer = None
        if config.tokenizer:
            from async_rl.models import load_tokenizer

            tokenizer = load_tokenizer(config.tokenizer)
        return JsonlTask(
            config.jsonl_path,
            seed=config.seed,
            prompt_field=config.prompt_field,
            reward=config.reward if config.reward in BUILTIN_REWARDS else "exact_match",
            reward_fn=reward_fn,
            tokenizer=tokenizer,
            add_bos=config.add_bos,
            shuffle=config.shuffle,
            max_new_tokens=config.max_new_tokens or 32,
        )
    task = ToyTask(
        config.name,
        seed=config.seed,
        min_digits=config.min_digits,
        max_digits=config.max_digits,
        strict_length=config.strict_length,
        reward_fn=reward_fn,
        max_new_tokens=config.max_new_tokens or None,
    )
    return task


def _adapted_task(config: TaskConfig) -> Task:
    """An environment of skyrl-gym or verifiers behind its adapter (those packages are imported only here), or
    python_tool."""
    from async_rl.envs.text import make_codec

    if config.reward:
        raise ValueError(f"task.reward cannot be set for {config.name}: its environment scores the episode")
    codec = make_codec(config.tokenizer)
    max_new = config.max_new_tokens or 128
    if config.name == "python_tool":
        from async_rl.envs.python_tool import PythonToolTask
        from async_rl.envs.sandbox import SandboxConfig

        try:
            sandbox = SandboxConfig(**config.env.args)
        except TypeError as exc:
            raise ValueError(f"task.env.args of python_tool must be sandbox limits: {exc}") from exc
        return PythonToolTask(config.jsonl_path, codec=codec, sandbox=sandbox, seed=config.seed,
                              shuffle=config.shuffle, max_new_tokens=max_new)  # fmt: skip
    if config.name == "skyrl_gym":
        from async_rl.envs.skyrl_gym import SkyrlGymTask

        return SkyrlGymTask(config.jsonl_path, env_id=config.env.id, env_args=config.env.args, codec=codec,
                            seed=config.seed, shuffle=config.shuffle, max_new_tokens=max_new)  # fmt: skip
    from async_rl.envs.verifiers import VerifiersTask

    return VerifiersTask(config.env.id, env_args=config.env.args, codec=codec, seed=config.seed,
                         shuffle=config.shuffle, max_new_tokens=max_new)  # fmt: skip
