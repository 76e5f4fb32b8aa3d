"""The architecture a run trains: what a generator's model must share with the learner's, read from the configs.

The learner writes :func:`architecture` of its model into its state hash (``learner:state``, field
:data:`STATE_FIELD`, JSON) when it starts; a generator compares its own at join, before its engine is built or any
weight fetched (:mod:`actors.generator.join`), and refuses with one line naming the first differences
(``hidden_size 128 here, 64 in the run``). Dtype and the init seed may differ: weights are cast and replaced.
"""

from __future__ import annotations

import json
from typing import Any

STATE_FIELD = "architecture"
"""Field of the learner's state hash holding the JSON of :func:`architecture`."""
FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
          "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")  # fmt: skip
"""Config attributes that decide the shapes (or the meaning) of the weights a version carries."""


def architecture(name: str) -> dict[str, Any]:
    """The architecture of model ``name`` (a preset or a local HF directory): :data:`FIELDS` present in its config,
    and its MoE layout (experts, top-k, which layers)."""
    from async_rl.model.moe import moe_facts
    from async_rl.model.presets import load_model_config

    config = load_model_config(name)
    text = getattr(config, "text_config", None) or config
    out: dict[str, Any] = {}
    for f in FIELDS:
        value = getattr(text, f, None)
        if isinstance(value, (bool, int, str)):
            out[f] = value
    moe = moe_facts(text)
    out.update(num_experts=moe.num_experts, top_k=moe.top_k, moe_layers=list(moe.moe_layer_ids))
    return out


def encode(facts: dict[str, Any]) -> str:
    """A record of facts the learner writes once into its state for generators to compare at join (its model's
    architecture here, its task's in :mod:`async_rl.tasks.identity`)."""
    return json.dumps(facts, sort_keys=True)


def decode(raw: bytes | str | None) -> dict[str, Any] | None:
    """A record :func:`encode` wrote, or None (none written: a learner older than the check)."""
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def differences(ours: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """``"<field> <ours> here, <run's> in the run"`` for every field both name and that differs."""
    return [f"{k} {ours[k]} here, {run[k]} in the run" for k in sorted(set(ours) & set(run)) if ours[k] != run[k]]
