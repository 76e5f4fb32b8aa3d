"""A byte-level tokenizer built offline, for text tasks on a local model directory (nothing is downloaded).

Every UTF-8 byte is one token (ids 4-259, in byte order), after the same four special tokens as the toy
tokenizer (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3), so any text has ids and decodes back exactly.
It is a ``tokenizers`` BPE model with no merges behind the GPT-2 byte-level pre-tokenizer and decoder, wrapped in
``PreTrainedTokenizerFast``: transformers (``AutoTokenizer``) and vLLM load it from a saved directory like any
other. :func:`async_rl.model.presets.save_pretrained_dir` with ``tokenizer="bytes"`` writes it with a preset model
sized for it (``async-rl init-model``).

It carries a chat template (:data:`CHAT_TEMPLATE`), Qwen's ChatML layout in plain bytes with ``<eos>`` closing each
message, so chat-formatted tasks (the text tasks' prompts, the environment adapters) run on a directory written
offline; see :data:`CHAT_TEMPLATE` for the layout.
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

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' + eos_token }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + eos_token }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response>' + eos_token }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{- call.arguments if call.arguments is string else call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- eos_token }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""The byte tokenizer's chat template: Qwen2.5's ChatML layout, spelled in bytes (``<|im_start|>`` is 12 byte tokens
here, not a special token) with the tokenizer's own ``<eos>`` closing every message (the token a model stops its turn
at, so a turn sampled up to ``<eos>`` is exactly what the template renders for it). ``<bos>`` opens the conversation;
a first ``system`` message, and the ``tools`` (listed in ``<tools>``, calls taught as Hermes ``<tool_call>`` blocks,
Qwen's format) go in the system turn; a ``tool`` message is a user turn in ``<tool_response>``; an assistant's
``tool_calls`` are rendered as ``<tool_call>`` blocks. A user turn with the generation prompt::

    <bos><|im_start|>system\\nBe brief.<eos><|im_start|>user\\nWhat is 2+2?<eos><|im_start|>assistant\\n
"""


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer (same ids every time), with :data:`CHAT_TEMPLATE`."""
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
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH, padding_side="left", clean_up_tokenization_spaces=False,
    )  # fmt: skip
    out.chat_template = CHAT_TEMPLATE
    return out


def _byte_of(ch: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to ``ch`` (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]
