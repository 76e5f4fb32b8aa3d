"""A byte-level tokenizer built offline, for text tasks on a local model directory (nothing is downloaded).

Every UTF-8 byte is one token (ids 4-259, in byte order), after the same four special tokens as the toy
tokenizer (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3), so any text has ids and decodes back exactly.
It is a ``tokenizers`` BPE model with no merges behind the GPT-2 byte-level pre-tokenizer and decoder, wrapped in
``PreTrainedTokenizerFast``: transformers (``AutoTokenizer``) and vLLM load it from a saved directory like any
other. :func:`async_rl.model.presets.save_pretrained_dir` with ``tokenizer="bytes"`` writes it with a preset model
sized for it (``async-rl init-model``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from async_rl.model.toy_tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, UNK

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

NUM_SPECIAL = len(SPECIAL_TOKENS)
VOCAB_SIZE = NUM_SPECIAL + 256
"""Four special tokens and the 256 bytes."""
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MODEL_MAX_LENGTH = 1024
"""Longest sequence of the models written with this tokenizer (a byte per character: questions of a few
hundred characters fit)."""


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer (same ids every time)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # The GPT-2 byte -> printable character map, in byte order so that id - 4 is the byte.
    order = sorted(byte_chars, key=_byte_of)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: NUM_SPECIAL + i for i, ch in enumerate(order)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH, padding_side="left", clean_up_tokenization_spaces=False,
    )  # fmt: skip


def _byte_of(ch: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to ``ch`` (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]
