"""Text prompts and responses through a Hugging Face tokenizer: what the text tasks (reasoning-gym, JSONL with a
tokenizer) share, and the ``math_verify`` reward."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from async_rl.tasks.base import Score

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own bound on parsing and comparing one answer (a SIGALRM: only on the main thread; elsewhere
unbounded)."""


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, *, add_bos: bool) -> np.ndarray:
    """Token ids of a text prompt (no special tokens but an optional bos in front)."""
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    if add_bos and tokenizer.bos_token_id is not None:
        ids = [int(tokenizer.bos_token_id), *ids]
    return np.asarray(ids, dtype=np.int32)


def decode_response(tokenizer: PreTrainedTokenizerBase, response_ids: np.ndarray) -> str:
    """Response text cut at the first end token, special tokens dropped."""
    ids = np.asarray(response_ids).tolist()
    eos = tokenizer.eos_token_id
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos)]
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def math_verify_score(response: str, answer: str) -> Score:
    """1.0 when math-verify finds the response's answer mathematically equal to ``answer`` (LaTeX or plain
    expressions, ``\\boxed{}`` preferred), else 0.0; component ``correct``. Needs ``pip install math-verify``."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ValueError("task.reward=math_verify needs the math-verify package: pip install 'async-rl[tasks]'") from exc
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$", parsing_timeout=timeout)  # type: ignore[arg-type]
    pred = parse(response, parsing_timeout=timeout)  # type: ignore[arg-type]
    ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)
    return Score(reward=float(ok), info={"correct": float(ok)})
