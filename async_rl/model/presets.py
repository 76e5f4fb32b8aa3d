"""Model presets built offline, and loading of local Hugging Face model directories.

Nothing here downloads anything. A *preset* is a small random-init transformers model
(seeded, so every process that builds the same preset with the same seed gets the same
weights) paired with the char-level tokenizer of :mod:`async_rl.model.toy_tokenizer`:

* ``tiny-moe``: Qwen3-MoE style, 2 layers, hidden 64, 4 attention heads of 32, 4 experts, top-2
  (about 250k parameters); plain GRPO (32 prompts x 8 samples, Adam 2e-3) takes it from reward
  0.05 to 0.9 on ``copy`` in 150 steps, 90 s on 2 CPU cores.
* ``tiny-dense``: the same shape with a dense MLP (Qwen3), for tests of dense paths.
* ``small-moe``: 4 layers, hidden 128, 8 experts, top-2 (about 1.8M parameters).
* ``moe-107m``: 8 layers, hidden 512, 32 experts, top-4 (107M parameters): the GPU benchmark model.
* ``moe-1.6b``: 16 layers, hidden 1024, 64 experts, top-8 (1.65B parameters, 3.3 GB in bf16): the weight path's.
* ``moe-5b``: 24 layers, hidden 2048, 64 experts, top-8 (5.06B parameters, 10.1 GB in bf16): the node's (issue 39).
  Its training state does not fit one 80 GB GPU: Megatron's mixed precision keeps 18 bytes a parameter (bf16
  weights, fp32 gradients, fp32 main weights, Adam's two moments), 91 GB; with EP=2 each rank holds half the experts.

Head dimensions are 32 or more: vLLM's CPU attention backend takes head sizes 32, 64, 80, ...
Anything else is a path to a local Hugging Face model directory (config, safetensors,
tokenizer), loaded with ``local_files_only=True``. :func:`save_pretrained_dir` writes a
preset as such a directory, so that vLLM and transformers can load it offline.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3MoeConfig,
)

from async_rl.model import toy_tokenizer as toy_tok
from async_rl.model.config import DTYPE_NAMES, PRESET_NAMES, ModelConfig  # noqa: F401 - ModelConfig re-exported
from async_rl.model.moe import moe_facts

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Accepted ``dtype`` names."""


def _common(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        vocab_size=toy_tok.VOCAB_SIZE,
        pad_token_id=toy_tok.PAD_ID,
        bos_token_id=toy_tok.BOS_ID,
        eos_token_id=toy_tok.EOS_ID,
        max_position_embeddings=toy_tok.MODEL_MAX_LENGTH,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        use_cache=True,
    )
    base.update(overrides)
    return base


def _moe_config(*, hidden: int, intermediate: int, layers: int, experts: int, **overrides: Any) -> Qwen3MoeConfig:
    kw = _common(
        hidden_size=hidden,
        intermediate_size=intermediate,
        moe_intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        router_aux_loss_coef=0.0,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def tiny_moe_config(**overrides: Any) -> Qwen3MoeConfig:
    """The quickstart model: Qwen3-MoE, 2 layers, hidden 64, 4 experts (top-2), char vocabulary."""
    return _moe_config(hidden=64, intermediate=128, layers=2, experts=4, **overrides)


def small_moe_config(**overrides: Any) -> Qwen3MoeConfig:
    """A bigger toy MoE (4 layers, hidden 128, 8 experts, top-2) for benchmarks and route tests."""
    return _moe_config(hidden=128, intermediate=256, layers=4, experts=8, **overrides)


def moe_107m_config(**overrides: Any) -> Qwen3MoeConfig:
    """The GPU benchmark model (``bench loop``, ``bench publish``): 8 layers, hidden 512, 32 experts top-4 (expert FFN
    256), 8 heads of 64; 107M parameters, 214 MB in bf16; the char vocabulary, so it learns the toy tasks."""
    kw: dict[str, Any] = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts_per_tok=4,
                              moe_intermediate_size=256)  # fmt: skip
    return _moe_config(hidden=512, intermediate=1024, layers=8, experts=32, **{**kw, **overrides})


def moe_1_6b_config(**overrides: Any) -> Qwen3MoeConfig:
    """The weight-path benchmark model (``bench loop --model moe-1.6b``): 16 layers, hidden 1024, 64 experts top-8
    (expert FFN 512), 16 query / 4 KV heads of 64; 1.65B parameters, 3.3 GB in bf16; the char vocabulary."""
    kw: dict[str, Any] = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts_per_tok=8,
                              moe_intermediate_size=512)  # fmt: skip
    return _moe_config(hidden=1024, intermediate=2048, layers=16, experts=64, **{**kw, **overrides})


def moe_5b_config(**overrides: Any) -> Qwen3MoeConfig:
    """The node's model (``scripts/gpu/node.sh``: a learner on two GPUs, EP=2): 24 layers, hidden 2048, 64 experts
    top-8 (expert FFN 512), 32 query / 4 KV heads of 64; 5.06B parameters, 10.1 GB in bf16; the char vocabulary."""
    kw: dict[str, Any] = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=64, num_experts_per_tok=8,
                              moe_intermediate_size=512)  # fmt: skip
    return _moe_config(hidden=2048, intermediate=4096, layers=24, experts=64, **{**kw, **overrides})


def tiny_dense_config(**overrides: Any) -> Qwen3Config:
    """The dense twin of ``tiny-moe`` (Qwen3, 2 layers, hidden 64, MLP 256)."""
    kw = _common(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


PRESETS: dict[str, Callable[..., PretrainedConfig]] = {
    "tiny-moe": tiny_moe_config,
    "tiny-dense": tiny_dense_config,
    "small-moe": small_moe_config,
    "moe-107m": moe_107m_config,
    "moe-1.6b": moe_1_6b_config,
    "moe-5b": moe_5b_config,
}
"""Preset name -> config factory."""
assert tuple(PRESETS) == PRESET_NAMES and tuple(DTYPES) == DTYPE_NAMES, "async_rl/model/config.py names them"


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of preset ``name``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name](**overrides)


def build_model(
    spec: str | PretrainedConfig, *, seed: int = 0, dtype: str | torch.dtype = "float32"
) -> PreTrainedModel:
    """A random-init causal LM for a preset name or a transformers config; same seed -> same weights.

    The global torch RNG is left as it was. The seed goes through that RNG, so two builds in threads of one process
    at once get other weights (processes are fine).
    """
    config = preset_config(spec) if isinstance(spec, str) else spec
    torch_dtype = _dtype(dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.to(torch_dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def load_model(
    path_or_preset: str | Path,
    *,
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """A preset (random init with ``seed``) or a local HF model directory, in ``dtype`` on ``device``."""
    name = str(path_or_preset)
    if is_preset(name):
        return build_model(name, seed=seed, dtype=dtype).to(device)  # type: ignore[arg-type]
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json"
        )
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, dtype=_dtype(dtype), attn_implementation="sdpa"
    )
    return model.to(device).eval()  # type: ignore[arg-type]


def cache_kwarg(model: PreTrainedModel) -> str:
    """The keyword a model's ``forward`` takes its KV cache by: ``cache`` since transformers renamed it (the old
    ``past_key_values`` still works there, but logs a deprecation warning in every generator), else
    ``past_key_values`` (older transformers, e.g. the vLLM virtualenv's)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def load_model_config(path_or_preset: str | Path) -> PretrainedConfig:
    """The transformers config of a preset or a local model directory (no weights loaded)."""
    name = str(path_or_preset)
    if is_preset(name):
        return preset_config(name)
    return AutoConfig.from_pretrained(name, local_files_only=True)


def load_tokenizer(path_or_preset: str | Path) -> PreTrainedTokenizerBase:
    """The toy tokenizer for presets; the directory's own tokenizer otherwise."""
    name = str(path_or_preset)
    if is_preset(name):
        return toy_tok.build_tokenizer()
    return AutoTokenizer.from_pretrained(name, local_files_only=True)


TOKENIZERS = ("chars", "bytes")
"""Tokenizers a model directory can be written with: the toy char tokenizer, or the byte-level one
(:mod:`async_rl.model.byte_tokenizer`: any text, for tasks like reasoning-gym's)."""


def save_pretrained_dir(
    path: str | Path,
    model: PreTrainedModel | None = None,
    *,
    preset: str = "tiny-moe",
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: str = "chars",
) -> Path:
    """Write ``model`` (or preset ``preset`` built with ``seed``) as a self-contained HF directory.

    The directory holds config.json, generation_config.json, model.safetensors and the
    tokenizer files, and loads offline in transformers (:func:`load_model`) and vLLM.
    ``tokenizer="bytes"`` writes the byte-level tokenizer and sizes the preset for it (260 tokens,
    positions up to :data:`async_rl.model.byte_tokenizer.MODEL_MAX_LENGTH`).
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {list(TOKENIZERS)}, got {tokenizer!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bytes":
        from async_rl.model import byte_tokenizer as bt

        if model is None:
            config = preset_config(preset, vocab_size=bt.VOCAB_SIZE, pad_token_id=bt.PAD_ID, bos_token_id=bt.BOS_ID,
                                   eos_token_id=bt.EOS_ID, max_position_embeddings=bt.MODEL_MAX_LENGTH)  # fmt: skip
            model = build_model(config, seed=seed, dtype=dtype)
        model.save_pretrained(str(path), safe_serialization=True)
        bt.build_byte_tokenizer().save_pretrained(str(path))
        return path
    if model is None:
        model = build_model(preset, seed=seed, dtype=dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    toy_tok.save_tokenizer(path)
    return path


def shared_preset_dir(target: str | Path, *, preset: str, seed: int = 0, dtype: str = "float32") -> Path:
    """Preset ``preset`` (built with ``seed``) as a HF directory at ``target``, written once: several processes may
    ask at once (the generators of one node sharing a directory), so each writes beside it and renames into place,
    the first rename winning; a ``target`` that exists is used as it is, once it holds ``config.json``."""
    target = Path(target)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_pretrained_dir(tmp, preset=preset, seed=seed, dtype=dtype)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise ValueError(f"{target} exists but holds no model (no config.json): remove it, and the preset "
                                 f"{preset!r} is written there again") from None  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def num_moe_layers(config: PretrainedConfig) -> int:
    """How many layers of a transformers config are MoE layers (0 for dense models); see :mod:`async_rl.model.moe`."""
    return moe_facts(config).num_moe_layers


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]
