"""Tasks and rewards: the :class:`Task` interface, built-in toy tasks, JSONL prompts, user rewards, and a user's own
task or environment named by ``task.name=file.py:Class`` (:mod:`.user`); a group shown as text (:mod:`.transcript`).

May import: model, wire, process.
"""

from async_rl.tasks.base import RewardFn, Score, Task, call_reward_fn, load_reward_fn, positional_credit
from async_rl.tasks.config import TASK_NAMES, TaskConfig, build_task
from async_rl.tasks.jsonl import BUILTIN_REWARDS, JsonlTask
from async_rl.tasks.toy import TOY_TASKS, ToyTask, response_text

__all__ = [
    "BUILTIN_REWARDS",
    "TASK_NAMES",
    "TOY_TASKS",
    "JsonlTask",
    "RewardFn",
    "Score",
    "Task",
    "TaskConfig",
    "ToyTask",
    "build_task",
    "call_reward_fn",
    "load_reward_fn",
    "positional_credit",
    "response_text",
]
