"""A character-level tokenizer for the toy tasks, built offline (nothing is downloaded).

Every character of :data:`CHARS` is one token, after four special tokens. The tokenizer
is a ``tokenizers`` WordLevel model wrapped in ``PreTrainedTokenizerFast`` so that
transformers (``AutoTokenizer``) and vLLM load it from a saved directory like any other.
It adds no special tokens by itself: tasks put ``<bos>`` in front of their prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
"""Ids 0-3, in this order (pad is 0: the learner pads micro-batches with id 0)."""
CHARS = "0123456789+-*=<>, "
"""The characters the toy tasks use: digits, operators, separators and a space."""
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARS))}
"""Token string -> id (22 tokens)."""
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (VOCAB[t] for t in SPECIAL_TOKENS)
VOCAB_SIZE = len(VOCAB)
MODEL_MAX_LENGTH = 256
"""Longest sequence the presets are meant for (their max_position_embeddings)."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The char-level tokenizer (same ids every time)."""
    # Imported here: encode/decode serve the tasks' configs and scorers, which must not pay for transformers.
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK))
    # One token per character; special tokens are matched whole before this split runs.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def encode(text: str) -> list[int]:
    """Ids of ``text`` (no special tokens added); ValueError naming any character outside the vocabulary."""
    bad = sorted({c for c in text if c not in VOCAB})
    if bad:
        raise ValueError(f"text {text!r} has characters outside the toy vocabulary: {bad} (allowed: {CHARS!r})")
    return [VOCAB[c] for c in text]


VOCAB_ITEMS: dict[int, str] = {i: t for t, i in VOCAB.items()}
"""Id -> token string."""


def decode(ids: list[int] | tuple[int, ...], *, skip_special: bool = True) -> str:
    """Text of ``ids``; special tokens dropped unless ``skip_special`` is False; unknown ids raise ValueError."""
    out = []
    for i in ids:
        tok = VOCAB_ITEMS.get(int(i))
        if tok is None:
            raise ValueError(f"token id {int(i)} is outside the toy vocabulary (size {VOCAB_SIZE})")
        if skip_special and tok in SPECIAL_TOKENS:
            continue
        out.append(tok)
    return "".join(out)


def save_tokenizer(path: str | Path) -> Path:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json, ...) into directory ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(str(path))
    return path
