"""Builds the configured training backend (megatron imports stay inside its own package)."""

from __future__ import annotations

import dataclasses

from actors.learner.backend import TrainingBackend
from actors.learner.config import LearnerConfig
from async_rl.model.presets import load_model, load_model_config
from async_rl.model.token_mask import masked_token_ids


def build_backend(cfg: LearnerConfig) -> TrainingBackend:
    """The backend of ``cfg``; its logits temperature and token mask follow ``cfg.sampling``, as the generators'."""
    temperature = cfg.sampling.temperature
    masked = masked_token_ids(cfg.model.name) if cfg.sampling.mask_special_tokens else ()
    if cfg.backend == "torch":
        from actors.learner.torch_backend import TorchBackend

        tcfg = dataclasses.replace(cfg.torch, temperature=temperature, masked_token_ids=masked)
        model = load_model(cfg.model.name, seed=cfg.model.seed, dtype=cfg.model.dtype)
        return TorchBackend(model, tcfg, reference_model=True if cfg.algorithm.needs_reference_logprobs else None)
    from actors.learner.megatron.backend import MegatronBackend

    mcfg = dataclasses.replace(cfg.megatron, temperature=temperature, masked_token_ids=masked)
    hf_state = load_model(cfg.model.name, seed=cfg.model.seed, dtype="float32").state_dict()
    return MegatronBackend(mcfg, load_model_config(cfg.model.name), hf_state,
                           reference_model=cfg.algorithm.needs_reference_logprobs)  # fmt: skip
