"""The task a run trains on, as facts a generator must share with the learner: compared at join like the model.

A generator scores with its own task (:meth:`~async_rl.tasks.base.Task.score`, an environment's episodes), so one
started with ``task.name=reverse`` under a learner on ``copy`` would score every sample against the wrong answer,
and train nothing, without an error. The learner writes :func:`task_facts` of its ``task`` config into its state hash
(field :data:`STATE_FIELD`, JSON) when it starts; a generator compares its own at join (``actors/generator/join.py``)
and both refuse in one line naming the first difference.

Facts are what decides how a sample is scored, written as the user sets them (``task.name``, ``task.reward``, ...)
and comparable across hosts: a file is its name and the SHA-256 of its content (``prompts.jsonl sha256:1a2b...``),
not its absolute path, and a tokenizer directory its name and the hash of its tokenizer files. What only the learner
uses (seed, shuffle, prompt templates, the held-out file) is left out: prompts travel in the stream.
"""

from __future__ import annotations

__all__ = ["STATE_FIELD", "decode", "differences", "encode", "file_identity", "task_facts", "tokenizer_identity"]

import hashlib
import json
from pathlib import Path
from typing import Any

from async_rl.model.architecture import decode, encode  # one JSON record of facts, as the model's
from async_rl.tasks.config import ENV_TASKS, TaskConfig, sources_of
from async_rl.tasks.toy import TOY_TASKS

STATE_FIELD = "task"
"""Field of the learner's state hash holding the JSON of :func:`task_facts`."""
ORDER = ("task.name", "task.mix", "task.source", "task.jsonl_path", "task.dataset", "task.dataset_config", "task.env", "task.reward",
         "task.tokenizer", "task.strict_length", "task.max_new_tokens")  # fmt: skip
"""The order differences are named in: the first is the one most likely to explain the others."""
TOKENIZER_FILES = ("vocab.json", "vocab.txt", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "spiece.model")  # fmt: skip
"""Files of a Hugging Face directory that decide its tokenizer, beside every ``tokenizer*`` file."""
HASH_CHARS = 12
"""Hex digits of a content hash shown and compared: 48 bits, no accidental collision between a run's files."""


def _sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in paths:
        digest.update(p.name.encode() + b"\0")
        with p.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()[:HASH_CHARS]}"


def file_identity(path: str) -> str:
    """``name sha256:...`` of a file, the same on every host that holds the same bytes; the path as given when it
    is not a file here (the task's own check says so first)."""
    p = Path(path)
    return f"{p.name} {_sha256([p])}" if p.is_file() else path


def tokenizer_identity(name: str) -> str:
    """A tokenizer as it decodes: '' the task's own, a preset the toy tokenizer every preset shares, a directory
    its name and the hash of its tokenizer files, anything else the name as given."""
    from async_rl.model.presets import is_preset

    if not name:
        return ""
    if is_preset(name):
        return "the presets' toy tokenizer"
    p = Path(name)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and (f.name.startswith("tokenizer")
                                                                  or f.name in TOKENIZER_FILES))  # fmt: skip
        return f"{p.name} {_sha256(files)}" if files else name
    return name


def task_facts(cfg: TaskConfig) -> dict[str, Any]:
    """The facts of ``cfg`` a generator must share (module docstring), keyed by the config key they come from. A
    mixture's are its sources (in order) and each member's own facts and source, under ``task.mix[j].``; the weights
    and seeds only decide which prompts the learner issues, and are left out."""
    if cfg.mix:
        facts: dict[str, Any] = {"task.name": cfg.name, "task.mix": json.dumps(list(sources_of(cfg)))}
        for j, (source, member) in enumerate(sources_of(cfg).items()):
            own = {**task_facts(member), "task.source": source}
            facts.update({f"task.mix[{j}].{k.removeprefix('task.')}": v for k, v in own.items()})
        return facts
    facts = {
        "task.name": cfg.name,
        "task.reward": cfg.reward,
        "task.tokenizer": tokenizer_identity(cfg.tokenizer),
        "task.max_new_tokens": cfg.max_new_tokens,
    }
    if cfg.name in TOY_TASKS:
        facts["task.strict_length"] = cfg.strict_length
    if cfg.name in ("jsonl", "python_tool", "skyrl_gym"):
        facts["task.jsonl_path"] = file_identity(cfg.jsonl_path)
    if cfg.name == "reasoning_gym":
        facts["task.dataset"] = cfg.dataset
        facts["task.dataset_config"] = json.dumps(cfg.dataset_config, sort_keys=True)
    if cfg.name in ENV_TASKS:
        facts["task.env"] = json.dumps({"id": cfg.env.id, "args": cfg.env.args, "tool_parser": cfg.env.tool_parser},
                                       sort_keys=True)  # fmt: skip
    return facts


def _rank(key: str) -> tuple[int, int, str]:
    """Where ``key`` comes in :data:`ORDER`: a mixture's own facts first, then member after member, each in ORDER."""
    member, _, own = key.partition("].") if key.startswith("task.mix[") else ("", "", key)
    j = int(member.removeprefix("task.mix[")) if member else -1
    own = own if not member else f"task.{own}"
    return (j, ORDER.index(own) if own in ORDER else len(ORDER), own)


def differences(ours: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """``"<key> <ours> here, <run's> in the run"`` for every fact both name that differs, in :data:`ORDER` (a
    mixture's: its own facts, then each member's in that order)."""
    keys = sorted(set(ours) & set(run), key=_rank)
    return [f"{k} {_shown(ours[k])} here, {_shown(run[k])} in the run" for k in keys if ours[k] != run[k]]


def _shown(value: Any) -> str:
    return repr(value) if value != "" else "'' (the task's own)"
