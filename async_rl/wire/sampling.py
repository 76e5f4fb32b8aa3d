"""How generators sample: one typed struct, owned here, validated once.

The learner's ``sampling`` config is a :class:`Sampling`; it travels inside every prompt record
(:class:`async_rl.wire.PromptSpec` ``.sampling``) so that every generator of a run samples with the
learner's temperature (the learner divides its logits by the same value: a mismatch silently
corrupts every importance ratio). A generator's own ``sampling`` config, the same class, serves only
prompts that carry none (issued by other tools). Torch-free, so configs that hold it load fast.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(kw_only=True, slots=True, frozen=True)
class Sampling:
    """Sampling parameters of one prompt's group."""

    n: int = 8
    """Samples per prompt (the group size of the advantages)."""
    max_new_tokens: int = 0
    """Response budget (0: the task's own)."""
    temperature: float = 1.0
    """Softmax temperature (> 0: a greedy rollout has no policy gradient); the learner divides its logits by it."""
    top_p: float = 1.0
    """Nucleus mass (1.0: off). With top_p/top_k on, behaviour logprobs are of the truncated distribution."""
    top_k: int = 0
    """Top-k truncation (0: off)."""
    mask_special_tokens: bool = True
    """Never sample special tokens other than end-of-sequence, nor embedding rows past the tokenizer's vocabulary
    (:mod:`async_rl.model.token_mask`); the learner masks the same logits, so logprobs stay comparable."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("sampling.n must be >= 1")
        if self.max_new_tokens < 0:
            raise ValueError("sampling.max_new_tokens must be >= 0")
        if not self.temperature > 0:
            raise ValueError("sampling.temperature must be > 0 (greedy rollouts have no policy gradient)")
        if not 0 < self.top_p <= 1:
            raise ValueError("sampling.top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("sampling.top_k must be >= 0")

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, raw: Any) -> Sampling:
        """Rebuild from a prompt record; ``ValueError`` names the field that is wrong."""
        if not isinstance(raw, dict):
            raise ValueError(f"sampling must be a map, got {type(raw).__name__}")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"sampling has unknown key(s) {unknown}")
        kinds = {"n": int, "max_new_tokens": int, "top_k": int, "temperature": float, "top_p": float,
                 "mask_special_tokens": bool}  # fmt: skip
        for key, value in raw.items():
            if kinds[key] is bool:
                ok = isinstance(value, bool)
            else:
                ok = isinstance(value, int | float) if kinds[key] is float else isinstance(value, int)
                ok = ok and not isinstance(value, bool)
            if not ok:
                raise ValueError(f"sampling.{key} must be a {kinds[key].__name__}, got {value!r}")
        return cls(**raw)
