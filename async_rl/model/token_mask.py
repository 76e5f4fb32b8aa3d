"""The sampling mask: token ids a response may never contain, owned here for generators and learner alike.

A random or young policy puts mass on tokens that have no business in a response: the pad token
(whose embedding row Hugging Face keeps at zero and never trains: sampled, it meets RMSNorm at
x = 0, where the gradient is 1/sqrt(eps)), bos, other special tokens, and the embedding rows past
the tokenizer's vocabulary. With ``sampling.mask_special_tokens`` (on by default) the generator sets
their logits to :data:`MASKED_LOGIT` before sampling and the learner does the same before its softmax,
so the behaviour logprobs and the learner's are of the same distribution (a mask on one side only
would bias every importance ratio by the masked mass).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MASKED_LOGIT = -1.0e9
"""Finite, so that entropy terms ``p * logit`` stay 0 rather than NaN; exp(-1e9 - max) is exactly 0 in fp32."""


def masked_token_ids(path_or_preset: str | Path) -> tuple[int, ...]:
    """Token ids a response may never contain: the sampling mask both generators and the learner apply.

    The tokenizer's special tokens and the model's pad and bos ids, except the end-of-sequence
    token(s) of the model config and generation config (a response must be able to end), plus the
    embedding rows past the tokenizer's vocabulary (models pad ``vocab_size`` to a round number;
    those rows map to no token). One owner: the generator masks these logits before sampling, the
    learner masks the same ones before its softmax, so behaviour and learner logprobs stay comparable.
    """
    from async_rl.model.presets import is_preset, load_model_config, load_tokenizer

    name = str(path_or_preset)
    config = load_model_config(name)
    eos = _ids(getattr(config, "eos_token_id", None))
    ids = _ids(getattr(config, "pad_token_id", None)) | _ids(getattr(config, "bos_token_id", None))
    vocab = int(config.vocab_size)
    if is_preset(name) or any(Path(name, f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        tok = load_tokenizer(name)
        eos |= _ids(tok.eos_token_id)
        ids |= {int(i) for i in tok.all_special_ids}
        ids |= set(range(len(tok), vocab))
    if not is_preset(name) and Path(name, "generation_config.json").exists():
        from transformers import GenerationConfig

        eos |= _ids(GenerationConfig.from_pretrained(name, local_files_only=True).eos_token_id)
    return tuple(sorted(i for i in ids - eos if 0 <= i < vocab))


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list | tuple) else {int(value)}


def mask_logits(logits: torch.Tensor, ids: torch.Tensor | None, vocab_start: int = 0) -> torch.Tensor:
    """``logits`` (fp32, vocabulary last) with the columns of token ``ids`` set to :data:`MASKED_LOGIT`.

    ``vocab_start`` is the first token id of this shard's columns (vocab-parallel logits); ids outside
    the shard are ignored. Returns ``logits`` unchanged when ``ids`` is None or empty.
    """
    if ids is None or ids.numel() == 0:
        return logits
    local = ids - vocab_start
    local = local[(local >= 0) & (local < logits.shape[-1])]
    if local.numel() == 0:
        return logits
    return logits.index_fill(-1, local.to(logits.device), MASKED_LOGIT)
