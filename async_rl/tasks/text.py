"""Text prompts and responses through a Hugging Face tokenizer: what the text tasks (reasoning-gym, JSONL with a
tokenizer) share."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
