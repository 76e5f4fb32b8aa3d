"""Configuration of an adapted environment (``task.env``): which one, and the arguments it is built with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from async_rl.tasks.envs.tool_calls import check_tool_parser


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    """An environment written for another system (``task.name=skyrl_gym`` or ``verifiers``) or served by another
    process (``http``; docs/environments.md)."""

    id: str = ""
    """skyrl_gym: a registered environment id (``gsm8k_multi_turn``) or ``module:Class`` of a user's
    ``BaseTextEnv`` (registered under that name), used for rows without an ``env_class``; verifiers: the
    ``module:function`` that returns the ``vf.Environment`` (``load_environment`` of an installed environment
    package, e.g. ``my_env:load_environment``)."""
    args: dict[str, Any] = field(default_factory=dict)
    """skyrl_gym: the ``env_config`` every environment is made with; verifiers: keyword arguments of the
    function named by ``id``."""
    url: str = ""
    """http: ``http://host:port`` of an environment server (``async-rl env-serve``) whose prompts and episodes the run
    uses, over OpenEnv's protocol (``async_rl/tasks/envs/http.py``)."""
    tool_parser: str = "hermes"
    """verifiers: how tool calls are read out of a model turn's text and handed to the environment as structured
    ``tool_calls`` (``vf.ToolEnv`` needs them), as ``vllm serve --tool-call-parser`` reads them: ``hermes``
    (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, Qwen2.5/Qwen3), ``llama3_json`` (Llama 3.x),
    ``mistral`` (``[TOOL_CALLS]``), ``auto`` (the format the chat template of ``task.tokenizer`` teaches),
    ``vllm:<name>`` (any other parser of vLLM's, vLLM installed) or ``none`` (the text as it is); vLLM's own parser
    where vLLM is installed, else ours (``async_rl/tasks/envs/tool_calls.py``)."""

    def __post_init__(self) -> None:
        if self.id and (" " in self.id or self.id.count(":") > 1):
            raise ValueError(f"task.env.id must be an environment id or 'module:name', got {self.id!r}")
        check_tool_parser(self.tool_parser)
        if self.url and not self.url.startswith("http://"):
            raise ValueError(f"task.env.url must be http://host:port of an environment server, got {self.url!r}")
