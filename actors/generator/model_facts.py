"""What the vLLM engine must know about its model before vLLM starts, read from the HF directory alone.

The checkpoint's tensor names and shapes (the names :meth:`VLLMEngine.stage_weights` accepts, read from the
safetensors headers: no weight is loaded), the vocabulary, the longest position, the head size (vLLM's CPU
attention supports only some) and the MoE layout, which :mod:`async_rl.model.moe` owns (MoE layer indices,
experts, top-k).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from async_rl.model.moe import moe_facts
from async_rl.model.presets import load_model_config


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the engine needs to know about the model, read from its directory."""

    directory: Path
    shapes: dict[str, tuple[int, ...]]
    """Checkpoint tensor name -> shape (the names stage_weights accepts)."""
    vocab_size: int
    max_positions: int
    """max_position_embeddings (0 when the config has none)."""
    moe_layer_ids: tuple[int, ...]
    """Indices (among all decoder layers) of the MoE layers."""
    num_experts: int
    top_k: int
    head_dim: int


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every ``*.safetensors`` file of ``directory`` (headers only)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {directory} holds no *.safetensors file")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[name] = tuple(fh.get_slice(name).get_shape())
    return shapes


def read_model_facts(directory: Path) -> ModelFacts:
    cfg = load_model_config(directory)
    text = getattr(cfg, "text_config", None) or cfg  # multimodal configs nest the language model's
    moe = moe_facts(text)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return ModelFacts(
        directory=directory,
        shapes=checkpoint_shapes(directory),
        vocab_size=int(text.vocab_size),
        max_positions=int(getattr(text, "max_position_embeddings", 0) or 0),
        moe_layer_ids=moe.moe_layer_ids,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        head_dim=head_dim,
    )
