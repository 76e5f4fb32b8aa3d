"""``python_tool``: a tool-calling environment whose tool runs the model's Python in a sandbox (:mod:`.sandbox`).

Prompts come from a JSONL file (``task.jsonl_path``): ``"prompt"`` (text or chat messages), ``"answer"`` and an
optional ``"id"``. In each turn the model either calls the tool, by writing a fenced block::

    ```python
    print(sum(range(10)))
    ```

which runs in a sandboxed child process (time and memory limits, no network; ``task.env.args`` sets the
:class:`~async_rl.tasks.envs.sandbox.SandboxConfig` fields, e.g. ``task.env.args.timeout_s=2``) and whose output comes
back as a ``tool`` message (``<output>...</output>``, the error's last line, or ``timed out``), or it answers:
the text inside ``<answer>...</answer>`` (else the whole turn), compared with the row's answer after stripping
whitespace. The episode ends at the answer (reward 1.0 when right) or at the episode's turn limit
(``generator.episode.max_turns``: reward 0).

Components: ``correct``, ``tool_calls``, ``tool_errors`` (a run that raised or was killed) and
``tool_timeouts``. The model needs a tokenizer that can write code (``task.tokenizer``: a Hugging Face model
directory with a chat template); the toy character vocabulary cannot.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.tasks.envs.base import EnvReply, Episode, RowsEnvTask
from async_rl.tasks.envs.sandbox import SandboxConfig, run_python
from async_rl.tasks.envs.text import TextCodec, as_messages

CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
"""A tool call: the first fenced Python block of a turn."""
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
"""A final answer, when the turn marks one."""


class PythonToolEpisode(Episode):
    """One episode: tool calls until an answer (see the module docstring)."""

    answer: str
    codec: TextCodec
    sandbox: SandboxConfig
    info: dict[str, float]

    def __init__(self, answer: str, codec: TextCodec, sandbox: SandboxConfig) -> None:
        self.answer, self.codec, self.sandbox = answer, codec, sandbox
        self.info = {"correct": 0.0, "tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0}

    async def step(self, action_ids: np.ndarray) -> EnvReply:
        text = self.codec.decode(action_ids)
        call = CODE_BLOCK.search(text)
        if call is None:
            marked = ANSWER.search(text)
            given = (marked.group(1) if marked else text).strip()
            self.info["correct"] = float(given == self.answer.strip())
            return EnvReply(tokens=np.zeros(0, dtype=np.int32), reward=self.info["correct"], done=True,
                            info=dict(self.info))  # fmt: skip
        result = await run_python(call.group(1), self.sandbox)
        self.info["tool_calls"] += 1
        if result.timed_out:
            self.info["tool_timeouts"] += 1
            output = f"timed out after {self.sandbox.timeout_s:g}s"
        elif not result.ok:
            self.info["tool_errors"] += 1
            lines = result.stderr.strip().splitlines()
            output = lines[-1] if lines else f"exit status {result.returncode}"
        else:
            output = result.stdout
        reply = [{"role": "tool", "content": f"<output>{output}</output>"}]
        return EnvReply(tokens=self.codec.reply_ids(reply), info=dict(self.info))


class PythonToolTask(RowsEnvTask):
    """Questions from a JSONL file, answered with the help of a sandboxed Python tool."""

    name = "python_tool"
    codec: TextCodec
    sandbox: SandboxConfig

    def __init__(self, path: str | Path, *, codec: TextCodec, sandbox: SandboxConfig, seed: int = 0,
                 shuffle: bool = True, max_new_tokens: int = 128, eval_path: str | Path | None = None) -> None:  # fmt: skip
        """``eval_path``: a second file of the same form, the held-out split (``task.eval_jsonl_path``)."""
        self.codec, self.sandbox, self.seed, self.shuffle = codec, sandbox, seed, shuffle
        self._max_new_tokens = max_new_tokens
        self.rows = self._read(Path(path), "task.jsonl_path")
        self.eval_rows = self._read(Path(eval_path), "task.eval_jsonl_path") if eval_path else []

    def _read(self, path: Path, key: str) -> list[tuple[np.ndarray, dict[str, Any]]]:
        if not path.is_file():
            raise ValueError(f"{key} {str(path)!r} is not a file")
        rows = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
                    raise ValueError("each line must be a JSON object with a 'prompt' and an 'answer'")
                ids = self.codec.prompt_ids(as_messages(row["prompt"]))
            except (json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{where}: {exc}") from exc
            rows.append((ids, {"task": self.name, "row": str(row.get("id", lineno)), "answer": str(row["answer"])}))
        if not rows:
            raise ValueError(f"{key} {str(path)!r} has no prompts")
        return rows

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        return self.codec.show(prompt_ids)

    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        return PythonToolEpisode(str(metadata["answer"]), self.codec, self.sandbox)
