"""Environments: episodes of several turns (:mod:`.base`), the ``tool_copy`` toy, and adapters for environments
written for other systems (``verifiers``, Gymnasium-style ``skyrl-gym``), imported only when used."""

from async_rl.tasks.envs.base import EnvReply, EnvTask, Episode, RowsEnvTask, as_tokens
from async_rl.tasks.envs.tool_copy import ToolCopyEpisode, ToolCopyTask

__all__ = ["EnvReply", "EnvTask", "Episode", "RowsEnvTask", "ToolCopyEpisode", "ToolCopyTask", "as_tokens"]
