"""What the vLLM engine sends vLLM for each request: prompts checked against the model, and the sampling
parameters of one sample (``n=1``: every sample its own request, its own id and seed; see :mod:`.vllm_engine`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from actors.generator.engine import SamplingParams


def check_prompts(prompts: Sequence[np.ndarray], vocab_size: int, max_model_len: int) -> list[np.ndarray]:
    """Each prompt as int64 token ids; ValueError naming the first that is empty, not 1-D integer, holds ids outside
    the vocabulary, or leaves no room for a response within ``max_model_len``."""
    rows = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D integer array, got {arr.dtype} {arr.shape}")
        if int(arr.min()) < 0 or int(arr.max()) >= vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size})")
        if arr.size >= max_model_len:
            raise ValueError(f"prompts[{i}] has {arr.size} tokens, the engine holds {max_model_len}")
        rows.append(arr.astype(np.int64))
    return rows


def request_params(params: SamplingParams, *, prompt_len: int, max_model_len: int, seed: int | None,
                   stop_on_eos: bool, logit_bias: dict[int, float]) -> Any:  # fmt: skip
    """vLLM's ``SamplingParams`` for one sample of ``params``: final output only, the logprob of each sampled token
    (processed: of the distribution it was sampled from), token ids without detokenizing; ``logit_bias`` (the
    sampling mask) where ``params`` asks for it."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(
        n=1,
        max_tokens=min(params.max_new_tokens, max_model_len - prompt_len),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=seed,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=not stop_on_eos,
        # Applied before sampling: the processed logprobs are of the masked distribution, as the learner's.
        logit_bias=logit_bias if params.mask_special_tokens and logit_bias else None,
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
