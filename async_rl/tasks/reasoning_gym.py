"""Any dataset of reasoning-gym (procedurally generated reasoning tasks with their own scorers) as a task.

``task.name=reasoning_gym task.dataset=basic_arithmetic task.tokenizer=<model dir>``: the prompts are the
dataset's questions (``task.template``, default ``"{question}\\n"``) and each response is scored by the dataset's
own ``score_answer`` (reward in [0, 1]; component ``correct``: the reward is 1). The answer is the text inside
the last ``<answer>...</answer>`` when the response has one, else the whole response, stripped. With a tokenizer
that has a chat template the question is a user message, followed by :data:`ANSWER_FORMAT` (``task.answer_format``)
so the model is told where its answer is read from (:class:`~async_rl.tasks.text.PromptFormat`).

Mixtures of reasoning-gym's own are its ``composite`` dataset: ``task.dataset=composite`` with
``task.dataset_config.datasets`` a list of tables ``{name, weight, config}`` (:func:`dataset_kwargs`); each entry is
scored by the scorer of the dataset it came from. (Mixtures of any tasks, with metrics per source: ``task.mix``.)

Nothing is downloaded: reasoning-gym builds entry ``i`` from ``Random(seed + i)``. Training prompt ``k`` is entry
``k mod 2**30``; held-out prompt ``j`` (evaluation, :meth:`ReasoningGymTask.eval_prompt`) is entry
``2**30 + j``: the two splits use disjoint seeds. Only the entry's index travels in the prompt's metadata; the
generator rebuilds the entry (question, answer, the scorer's metadata) from it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from async_rl.tasks.base import RewardFn, Score, Task, call_reward_fn
from async_rl.tasks.text import PromptFormat, decode_response, show_ids
from async_rl.wire import PromptSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ANSWER_FORMAT = "Give your final answer between <answer> and </answer> tags."
"""The instruction after a chat-formatted question (``task.answer_format`` unset): the tags the scorer reads the
answer from (reasoning-gym's own system prompts say the same)."""
HELD_OUT_START = 2**30
"""First entry of the held-out split: training uses entries below it, evaluation entries from it on."""


@functools.cache
def dataset_names() -> tuple[str, ...]:
    """Every dataset reasoning-gym registers (ValueError when the package is not installed)."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ValueError("task.name=reasoning_gym needs the reasoning-gym package: pip install 'async-rl[tasks]'") from exc
    return tuple(sorted(reasoning_gym.factory.DATASETS))


def dataset_kwargs(dataset: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``reasoning_gym.create_dataset(dataset, ...)`` from ``task.dataset_config``:
    ``composite`` takes its ``datasets`` as ``DatasetSpec`` objects, written in the config as tables ``{name, weight,
    config}`` (``weight`` 1.0 and ``config`` ``{}`` when left out); ValueError naming the entry otherwise."""
    kwargs = dict(config)
    if dataset != "composite" or "datasets" not in kwargs:
        return kwargs
    from reasoning_gym.composite import DatasetSpec

    specs = kwargs["datasets"]
    if not isinstance(specs, list) or not specs:
        raise ValueError(f"task.dataset_config.datasets of 'composite' must be a non-empty list of tables {{name, "
                         f"weight, config}}, got {specs!r}")  # fmt: skip
    out = []
    for i, spec in enumerate(specs):
        where = f"task.dataset_config.datasets[{i}]"
        if isinstance(spec, DatasetSpec):
            out.append(spec)
            continue
        if not isinstance(spec, Mapping) or "name" not in spec or set(spec) - {"name", "weight", "config"}:
            raise ValueError(f"{where} must be a table {{name, weight = 1.0, config = {{}}}}, got {spec!r}")
        if spec["name"] not in dataset_names():
            raise ValueError(f"{where}.name {spec['name']!r} is not a reasoning-gym dataset")
        config_ = spec.get("config") or {}
        if not isinstance(config_, Mapping):
            raise ValueError(f"{where}.config must be a table of the dataset's config, got {config_!r}")
        out.append(DatasetSpec(name=str(spec["name"]), weight=float(spec.get("weight", 1.0)), config=dict(config_)))
    kwargs["datasets"] = out
    return kwargs


class ReasoningGymTask(Task):
    """One reasoning-gym dataset (see the module docstring)."""

    name = "reasoning_gym"
    dataset: str
    seed: int
    template: str
    _data: Any
    _tokenizer: PreTrainedTokenizerBase
    format: PromptFormat
    """How the question becomes token ids (chat template or raw text)."""
    _max_new_tokens: int
    _reward_fn: RewardFn | None

    def __init__(self, dataset: str, *, tokenizer: PreTrainedTokenizerBase, seed: int = 0,
                 dataset_config: Mapping[str, Any] | None = None, template: str = "{question}\n",
                 prompt_format: PromptFormat | None = None, max_new_tokens: int = 32,
                 reward_fn: RewardFn | None = None) -> None:  # fmt: skip
        """``prompt_format``: how questions become token ids (default: raw text with the bos in front)."""
        if dataset not in dataset_names():
            raise ValueError(f"task.dataset {dataset!r} is not a reasoning-gym dataset; some of the "
                             f"{len(dataset_names())}: {', '.join(dataset_names()[:12])}, ...")  # fmt: skip
        if "{question}" not in template:
            raise ValueError(f"task.template must contain '{{question}}', got {template!r}")
        if max_new_tokens < 1:
            raise ValueError("task.max_new_tokens must be >= 1")
        import reasoning_gym

        try:
            self._data = reasoning_gym.create_dataset(dataset, seed=seed, size=2 * HELD_OUT_START,
                                                      **dataset_kwargs(dataset, dataset_config or {}))  # fmt: skip
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(f"task.dataset_config {dict(dataset_config or {})} for {dataset!r}: {exc}") from exc
        self.dataset, self.seed, self.template = dataset, seed, template
        self._tokenizer, self.format = tokenizer, prompt_format or PromptFormat()
        self._max_new_tokens, self._reward_fn = max_new_tokens, reward_fn

    @property
    def num_prompts(self) -> int | None:
        return None

    @property
    def max_new_tokens(self) -> int:
        return self._max_new_tokens

    def _spec(self, entry_index: int, prompt_id: str) -> PromptSpec:
        entry = self._data[entry_index]
        text = self.template.format(question=entry["question"])
        return PromptSpec(
            prompt_id=prompt_id, prompt_ids=self.format.encode(self._tokenizer, text),
            metadata={"task": self.name, "dataset": self.dataset, "entry": entry_index, "prompt": text},
        )  # fmt: skip

    def prompt(self, index: int) -> PromptSpec:
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return self._spec(index % HELD_OUT_START, f"rg-{self.dataset}-{self.seed}-{index}")

    def eval_prompt(self, index: int) -> PromptSpec:
        if index < 0:
            raise ValueError(f"eval prompt index must be >= 0, got {index}")
        return self._spec(HELD_OUT_START + index, f"rg-{self.dataset}-{self.seed}-eval-{index}")

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        return show_ids(self._tokenizer, prompt_ids)

    def score(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> Score:
        entry_index = metadata.get("entry")
        if not isinstance(entry_index, int) or not 0 <= entry_index < 2 * HELD_OUT_START:
            raise ValueError(f"prompt metadata for reasoning_gym has no valid 'entry' index: {dict(metadata)}")
        if metadata.get("dataset") != self.dataset:
            raise ValueError(f"prompt of dataset {metadata.get('dataset')!r} scored by task.dataset {self.dataset!r}")
        text = decode_response(self._tokenizer, response_ids)
        if self._reward_fn is not None:
            return call_reward_fn(self._reward_fn, text, metadata)
        reward = float(self._data.score_answer(answer=_extracted(text), entry=self._data[entry_index]))
        return Score(reward=reward, info={"correct": float(reward >= 1.0)})

    def answer(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> str | None:
        """The answer the dataset's scorer reads (None with a reward of your own: it reads what it likes)."""
        if self._reward_fn is not None:
            return None
        return _extracted(decode_response(self._tokenizer, response_ids))


def _extracted(text: str) -> str:
    """The answer of a response: inside its last ``<answer>...</answer>``, else the whole response, stripped."""
    from reasoning_gym.utils import extract_answer

    return str(extract_answer(text) if "<answer>" in text else text.strip())
