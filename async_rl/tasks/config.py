"""Task configuration and the one function that builds a :class:`~async_rl.tasks.base.Task` from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from async_rl.tasks.base import Task, load_reward_fn
from async_rl.tasks.envs.config import EnvConfig
from async_rl.tasks.jsonl import BUILTIN_REWARDS, MATH_ANSWER_FORMAT, JsonlTask
from async_rl.tasks.mixture import MixtureTask, check_members
from async_rl.tasks.text import PromptFormat, prompt_format
from async_rl.tasks.toy import TOY_TASKS, ToyTask
from async_rl.tasks.user import build_user_task, check_task_args, has_held_out, is_user_task, load_task_class

ENV_TASKS = ("tool_copy", "python_tool", "skyrl_gym", "verifiers", "http")
"""Tasks whose prompts open episodes of several turns (:mod:`async_rl.tasks.envs`)."""
TEXT_TASKS = ("jsonl", "reasoning_gym")
"""Tasks whose prompts are text, rendered through the tokenizer's chat template or raw (``task.chat_template``)."""
TASK_NAMES = (*TOY_TASKS, *TEXT_TASKS, *ENV_TASKS)


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """Which prompts to issue and how responses are rewarded."""

    name: str = "copy"
    """copy | reverse | sort | add (built-in toy tasks), jsonl (prompts from ``jsonl_path``), reasoning_gym (a
    reasoning-gym dataset, ``dataset``) or tool_copy (a toy environment of two turns: call a tool, then copy what it
    returned), python_tool (questions answered with a sandboxed Python tool, rows from ``jsonl_path``), skyrl_gym or
    verifiers (environments of those packages, through their adapters), http (an environment served by another process
or host, ``task.env.url``; see docs/environments.md); or your own task or
    environment, ``path/to/file.py:Class`` or ``module:Class``: a subclass of ``async_rl.tasks.Task`` or
    ``async_rl.tasks.envs.EnvTask``, built as ``Class(seed=seed, tokenizer=<tokenizer loaded, or None>, **args)``
    (``async_rl/tasks/user.py``, docs/environments.md)."""
    seed: int = 0
    """Seed of the prompt stream (prompt i depends only on seed and i). In a member of ``task.mix``: added to the
    mixture's ``task.seed`` (members of the same task with different seeds draw different prompts)."""
    min_digits: int = 5
    """Toy tasks and tool_copy: fewest digits per operand (tool_copy: of the hidden string)."""
    max_digits: int = 5
    """Toy tasks: most digits per operand."""
    strict_length: bool = True
    """Toy tasks: a wrong response length costs reward, so the reward is 1.0 only for the exact answer (False: a
    right prefix earns full credit whatever follows; see ``async_rl.tasks.base.positional_credit``)."""
    jsonl_path: str = ""
    """jsonl: the prompt file."""
    eval_jsonl_path: str = ""
    """jsonl, python_tool, skyrl_gym: a file of held-out prompts for evaluation (learner.eval), in the layout of
    ``jsonl_path``; the toy tasks, tool_copy and reasoning_gym have a held-out split built in, verifiers takes the
    environment's ``eval_dataset``."""
    prompt_field: str = "prompt"
    """jsonl: field holding the prompt text."""
    dataset: str = ""
    """reasoning_gym: the dataset's name (``basic_arithmetic``, ``chain_sum``, ... any of reasoning-gym's)."""
    dataset_config: dict[str, Any] = field(default_factory=dict)
    """reasoning_gym: keyword arguments of the dataset's config (e.g. ``{min_terms = 2, max_terms = 2}``)."""
    template: str = "{question}\n"
    """reasoning_gym: the prompt text around the dataset's ``{question}``."""
    tokenizer: str = ""
    """jsonl, reasoning_gym, the environment adapters and a task of your own (its constructor's ``tokenizer``): the
    tokenizer of prompt text, a preset or HF directory (jsonl, adapters: '' = the toy char tokenizer; a task of your
    own: '' = None; reasoning_gym needs one, e.g. a directory from ``async-rl init-model``)."""
    add_bos: bool = True
    """jsonl, reasoning_gym: put the tokenizer's bos token in front of raw text prompts (a chat template places its
    own)."""
    chat_template: bool | None = None
    """jsonl, reasoning_gym: render each text prompt through the tokenizer's chat template, as a user message ready
    for the assistant's turn (true), or use it as raw text (false); unset: the chat template when the tokenizer has
    one (a directory from ``async-rl init-model`` has one; the presets' toy tokenizer has none)."""
    system_prompt: str = ""
    """jsonl, reasoning_gym with the chat template: the system message before each prompt ('' = none)."""
    answer_format: str | None = None
    """jsonl, reasoning_gym with the chat template: the instruction after each prompt's text, telling the model the
    answer format the scorer reads; unset: the task's own (reasoning_gym: answer between <answer> and </answer> tags;
    jsonl with math_verify: put the final answer within \\boxed{}; otherwise none), '' = none."""
    shuffle: bool = True
    """jsonl: reshuffle every epoch (deterministically from seed and epoch)."""
    reward: str = ""
    """'module:function' of a user's reward, or for jsonl a built-in (exact_match, positional, math_verify);
    '' = the task's own (reasoning_gym: the dataset's scorer)."""
    max_new_tokens: int = 0
    """Response budget the generators use (0: the task's own, e.g. digits + 1 for copy; 32 for jsonl and
    reasoning_gym; per model turn for environments, 128 for skyrl_gym and verifiers)."""
    args: dict[str, Any] = field(default_factory=dict)
    """A task given as ``file.py:Class`` or ``module:Class``: the keyword arguments of its constructor besides
    ``seed`` and ``tokenizer`` (e.g. ``task.args.max_number=100``); checked against its signature at start."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """skyrl_gym / verifiers: which environment, built with which arguments; http: the server's ``url``; python_tool:
    ``args`` are the sandbox's limits (``async_rl.tasks.envs.sandbox.SandboxConfig``)."""
    source: str = ""
    """The name the task's prompts and metrics go by (``eval/<source>/...``; in a mixture also
    ``train/<source>/...``): '' = the reasoning-gym dataset, else the task's name (a task of your own: its class's
    ``name``)."""
    weight: float = 1.0
    """A member of ``task.mix``: its share of the training prompts, relative to the other members' (0: none, its
    held-out split still evaluated)."""
    mix: list[TaskConfig] = field(default_factory=list)
    """Several tasks in one run: each member a task of its own (``[[task.mix]]`` tables in TOML, or
    ``task.mix='[{"name": "copy", "weight": 2}, {"name": "reverse"}]'``) with its ``weight`` and ``source``; each
    prompt is drawn from a member by weight, from ``task.seed`` and its index (``async_rl/tasks/mixture.py``).
    Empty: the one task ``task.name``."""

    def __post_init__(self) -> None:
        if self.mix or self.name == MIX:
            self._check_mix()
            return
        if is_user_task(self.name):
            check_task_args(self.name, load_task_class(self.name), self.args)  # imports it: errors name the key
            if self.reward:
                raise ValueError(f"task.reward cannot be set for task.name {self.name!r}: a task of your own scores "
                                 "its responses (score) or its episodes")  # fmt: skip
            if self.max_new_tokens:
                raise ValueError(f"task.max_new_tokens cannot be set for task.name {self.name!r}: its max_new_tokens "
                                 "property says it (pass a value of your own through task.args)")  # fmt: skip
        elif self.name not in TASK_NAMES:
            raise ValueError(f"task.name must be one of {list(TASK_NAMES)}, or a task of your own as "
                             f"'path/to/file.py:Class' or 'module:Class', got {self.name!r}")  # fmt: skip
        elif self.args:
            raise ValueError("task.args applies to a task of your own (task.name=file.py:Class or module:Class); "
                             f"{self.name!r} takes its own task.* keys (an adapter's environment: task.env.args)")  # fmt: skip
        if self.min_digits < 1:
            raise ValueError("task.min_digits must be >= 1")
        if self.max_digits < self.min_digits:
            raise ValueError("task.max_digits must be >= task.min_digits")
        if self.name in ("jsonl", "skyrl_gym", "python_tool") and not self.jsonl_path:
            raise ValueError(f"task.jsonl_path is required when task.name is {self.name!r}")
        if self.name == "verifiers" and not self.env.id:
            raise ValueError("task.env.id ('module:function' returning the vf.Environment) is required when "
                             "task.name is 'verifiers'")
        if self.name == "http" and not self.env.url:
            raise ValueError("task.env.url (http://host:port of an environment server: async-rl env-serve) is required "
                             "when task.name is 'http'")  # fmt: skip
        if self.env.url and self.name != "http":
            raise ValueError(f"task.env.url applies to task.name=http, not to {self.name!r}")
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError("task.dataset is required when task.name is 'reasoning_gym'")
        if self.name == "reasoning_gym" and not self.tokenizer:
            raise ValueError("task.tokenizer is required when task.name is 'reasoning_gym' (a model directory with "
                             "a tokenizer, e.g. from 'async-rl init-model DIR')")  # fmt: skip
        builtin_ok = self.name == "jsonl" and self.reward in BUILTIN_REWARDS
        if self.reward and ":" not in self.reward and not builtin_ok:
            also = f" or one of {list(BUILTIN_REWARDS)}" if self.name == "jsonl" else ""
            raise ValueError(f"task.reward must be 'module:function'{also}, got {self.reward!r}")
        if self.max_new_tokens < 0:
            raise ValueError("task.max_new_tokens must be >= 0")
        formatted = {"task.chat_template": self.chat_template is not None, "task.system_prompt": bool(self.system_prompt),
                     "task.answer_format": self.answer_format is not None}  # fmt: skip
        if self.name not in TEXT_TASKS and any(formatted.values()):
            field = next(k for k, v in formatted.items() if v)
            raise ValueError(f"{field} applies to the text tasks {list(TEXT_TASKS)}, not to {self.name!r}")
        if self.chat_template is False and (self.system_prompt or self.answer_format):
            field = "task.system_prompt" if self.system_prompt else "task.answer_format"
            raise ValueError(f"{field} is set, but task.chat_template is false: it goes into the chat template's "
                             "messages, raw text prompts have none")  # fmt: skip

    def _check_mix(self) -> None:
        """A mixture: members that are tasks (checked as such when built), each source once; the mixture's own keys
        left at their defaults but ``seed`` (each member has its own)."""
        if not self.mix:
            raise ValueError("task.mix is required when task.name is 'mix' (a list of tasks, each with its weight)")
        if self.name not in (MIX, "copy"):  # "copy": task.name left at its default
            raise ValueError(f"task.name {self.name!r} and task.mix are both set: with task.mix, each member names "
                             "its task (task.mix[j].name)")  # fmt: skip
        self.name = MIX
        default = TaskConfig()
        for f in fields(self):
            if f.name not in ("name", "seed", "mix") and getattr(self, f.name) != getattr(default, f.name):
                raise ValueError(f"task.{f.name} applies to one task: with task.mix, set it on the members "
                                 f"(task.mix[j].{f.name})")  # fmt: skip
        for j, member in enumerate(self.mix):
            if member.mix:
                raise ValueError(f"task.mix[{j}].mix: a member of a mixture cannot be a mixture (list its tasks in "
                                 "task.mix itself)")  # fmt: skip
            if member.tokenizer != self.mix[0].tokenizer:
                raise ValueError(f"task.mix[{j}].tokenizer {member.tokenizer!r} differs from task.mix[0].tokenizer "
                                 f"{self.mix[0].tokenizer!r}: the model reads one vocabulary")  # fmt: skip
        check_members([source_of(m) for m in self.mix], [m.weight for m in self.mix])


MIX = "mix"
"""``task.name`` of a mixture (``task.mix``)."""


def source_of(config: TaskConfig) -> str:
    """The source name of a task that is not a mixture: ``task.source``, else the reasoning-gym dataset, a task of your
    own's class ``name``, or ``task.name``."""
    if config.source:
        return config.source
    if config.name == "reasoning_gym" and config.dataset:
        return config.dataset
    if is_user_task(config.name):
        return str(load_task_class(config.name).name)
    return config.name


def sources_of(config: TaskConfig) -> dict[str, TaskConfig]:
    """Every source of the task ``config`` describes, with its task's config: a mixture's members, else the task."""
    if config.mix:
        return {source_of(m): m for m in config.mix}
    return {source_of(config): config}


def held_out_missing(config: TaskConfig) -> str | None:
    """Why the task ``config`` (not a mixture) has no held-out split, as far as its config tells (a verifiers
    environment's is known once it is built), in words after ``task.name '<name>'``; None when it has one."""
    if config.name in ("jsonl", "python_tool", "skyrl_gym") and not config.eval_jsonl_path:
        return "has no held-out split: set task.eval_jsonl_path (a file of held-out prompts, in the layout of jsonl_path)"
    if is_user_task(config.name) and not has_held_out(load_task_class(config.name)):
        return "has no eval_prompt(index) of its own (define it, or leave evaluation off)"
    return None


def build_task(config: TaskConfig) -> Task:
    """The task ``config`` describes (imports a user's reward function; ValueError if it cannot)."""
    if config.mix:
        members = [(source_of(m), m.weight, build_task(dataclasses.replace(m, seed=config.seed + m.seed)))
                   for m in config.mix]  # fmt: skip
        return MixtureTask(members, seed=config.seed)
    if is_user_task(config.name):
        return build_user_task(config.name, seed=config.seed, tokenizer=config.tokenizer, args=config.args)
    if config.name == "tool_copy":
        from async_rl.tasks.envs.tool_copy import ToolCopyTask

        if config.reward:
            raise ValueError("task.reward cannot be set for tool_copy: its environment scores the episode")
        return ToolCopyTask(seed=config.seed, min_digits=config.min_digits, max_digits=config.max_digits)
    if config.name in ("skyrl_gym", "verifiers", "python_tool"):
        return _adapted_task(config)
    if config.name == "http":
        from async_rl.tasks.envs.http import HttpEnvTask

        if config.reward:
            raise ValueError("task.reward cannot be set for http: the served environment scores the episode")
        return HttpEnvTask(config.env.url, max_new_tokens=config.max_new_tokens)
    reward_fn = load_reward_fn(config.reward) if ":" in config.reward else None
    if config.name == "jsonl":
        tokenizer = None
        if config.tokenizer:
            from async_rl.model.presets import load_tokenizer

            tokenizer = load_tokenizer(config.tokenizer)
        return JsonlTask(
            config.jsonl_path,
            seed=config.seed,
            prompt_field=config.prompt_field,
            reward=config.reward if config.reward in BUILTIN_REWARDS else "exact_match",
            reward_fn=reward_fn,
            tokenizer=tokenizer,
            prompt_format=_prompt_format(config, tokenizer, MATH_ANSWER_FORMAT if config.reward == "math_verify" else ""),
            shuffle=config.shuffle,
            max_new_tokens=config.max_new_tokens or 32,
            eval_path=config.eval_jsonl_path or None,
        )
    if config.name == "reasoning_gym":
        from async_rl.model.presets import load_tokenizer
        from async_rl.tasks.reasoning_gym import ANSWER_FORMAT, ReasoningGymTask

        tokenizer = load_tokenizer(config.tokenizer)
        return ReasoningGymTask(
            config.dataset, tokenizer=tokenizer, seed=config.seed, dataset_config=config.dataset_config,
            template=config.template, prompt_format=_prompt_format(config, tokenizer, ANSWER_FORMAT),
            max_new_tokens=config.max_new_tokens or 32, reward_fn=reward_fn,
        )  # fmt: skip
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


def _prompt_format(config: TaskConfig, tokenizer: Any, default_answer_format: str) -> PromptFormat:
    return prompt_format(tokenizer, chat_template=config.chat_template, system_prompt=config.system_prompt,
                         answer_format=config.answer_format, default_answer_format=default_answer_format,
                         add_bos=config.add_bos)  # fmt: skip


def _adapted_task(config: TaskConfig) -> Task:
    """An environment of skyrl-gym or verifiers behind its adapter (those packages are imported only here), or
    python_tool."""
    from async_rl.tasks.envs.text import make_codec

    if config.reward:
        raise ValueError(f"task.reward cannot be set for {config.name}: its environment scores the episode")
    codec = make_codec(config.tokenizer)
    max_new = config.max_new_tokens or 128
    if config.name == "python_tool":
        from async_rl.tasks.envs.python_tool import PythonToolTask
        from async_rl.tasks.envs.sandbox import SandboxConfig

        try:
            sandbox = SandboxConfig(**config.env.args)
        except TypeError as exc:
            raise ValueError(f"task.env.args of python_tool must be sandbox limits: {exc}") from exc
        return PythonToolTask(config.jsonl_path, codec=codec, sandbox=sandbox, seed=config.seed,
                              shuffle=config.shuffle, max_new_tokens=max_new,
                              eval_path=config.eval_jsonl_path or None)  # fmt: skip
    if config.name == "skyrl_gym":
        from async_rl.tasks.envs.skyrl_gym import SkyrlGymTask

        return SkyrlGymTask(config.jsonl_path, env_id=config.env.id, env_args=config.env.args, codec=codec,
                            seed=config.seed, shuffle=config.shuffle, max_new_tokens=max_new,
                            eval_path=config.eval_jsonl_path or None)  # fmt: skip
    from async_rl.tasks.envs.verifiers import VerifiersTask

    return VerifiersTask(config.env.id, env_args=config.env.args, codec=codec, seed=config.seed,
                         shuffle=config.shuffle, max_new_tokens=max_new, tool_parser=config.env.tool_parser)  # fmt: skip
