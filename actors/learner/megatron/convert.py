"""Hugging Face <-> megatron-core weight names and layouts for Qwen3-MoE / Qwen2-MoE / Mixtral-style models.

Pure torch; no megatron-core import. Three steps, each a plain function, rebuilt on every call (no
cached mapping state: cached conversion state went stale across pipeline-parallel syncs elsewhere and
silently corrupted MoE weights):

1. :func:`hf_to_mcore` / :func:`mcore_to_hf`: whole-model state dicts, HF names <-> "global" megatron
   names (global layer numbers, global expert ids, unsharded tensors). Layout changes: q/k/v fused
   into ``linear_qkv`` grouped per KV head (``[q of group g, k_g, v_g]`` for each group), gate/up fused
   into ``linear_fc1`` as ``[gate; up]``, HF's fused expert tensors (transformers >= 5:
   ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``) or per-expert checkpoint names
   (``mlp.experts.{e}.gate_proj.weight``...) split into one ``linear_fc1`` / ``linear_fc2`` per expert.
2. :func:`shard` / :func:`unshard`: one global tensor <-> a tensor-parallel rank's slice (column- or
   row-parallel; gated ``linear_fc1`` splits gate and up separately).
3. :func:`local_name` / :func:`global_name`: a rank's module names (stage-local layer index, local
   expert id, local or Transformer-Engine spec) <-> global names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from async_rl.model.moe import moe_facts

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3", "qwen2")


@dataclass(frozen=True, slots=True)
class ModelArch:
    """The shape facts of a supported HF decoder that the conversion and the Megatron config need."""

    model_type: str
    """HF ``config.model_type``."""
    num_layers: int
    """Decoder layers."""
    hidden_size: int
    """Model width."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (query groups)."""
    head_dim: int
    """Per-head width."""
    ffn_hidden_size: int
    """Dense MLP width (dense layers)."""
    vocab_size: int
    """Vocabulary size."""
    moe_layers: tuple[bool, ...]
    """Per decoder layer: True for an MoE layer."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    top_k: int = 0
    """Experts per token."""
    moe_ffn_hidden_size: int = 0
    """Routed expert MLP width."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights (Megatron: softmax after top-k) or not (softmax before top-k)."""
    shared_expert_size: int = 0
    """Shared expert MLP width (Qwen2-MoE), 0 for none."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2)."""
    tie_embeddings: bool = False
    """Output layer shares the embedding matrix."""
    rope_theta: float = 10000.0
    """Rotary base."""
    rms_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_position_embeddings: int = 4096
    """Longest sequence."""

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelArch:
        """Read a transformers config (Qwen3-MoE, Qwen2-MoE, Mixtral, or dense Qwen2/Qwen3)."""
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {mt!r} is not supported by the Megatron conversion; use {SUPPORTED_MODEL_TYPES}"
            )
        n = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        if heads % kv:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported (plain RoPE only)")
        common = dict(
            model_type=mt, num_layers=n, hidden_size=int(cfg.hidden_size), num_heads=heads, num_kv_heads=kv,
            head_dim=head_dim, ffn_hidden_size=int(cfg.intermediate_size), vocab_size=int(cfg.vocab_size),
            qk_norm=mt in ("qwen3_moe", "qwen3"), qkv_bias=mt in ("qwen2_moe", "qwen2"),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), rope_theta=rope_theta,
            rms_eps=float(cfg.rms_norm_eps), max_position_embeddings=int(cfg.max_position_embeddings),
        )  # fmt: skip
        if mt == "mixtral":
            return cls(**common, moe_layers=moe_facts(cfg).moe_mask, num_experts=int(cfg.num_local_experts),
                       top_k=int(cfg.num_experts_per_tok), moe_ffn_hidden_size=int(cfg.intermediate_size),
                       norm_topk_prob=True)  # fmt: skip
        if mt in ("qwen3", "qwen2"):
            return cls(**common, moe_layers=(False,) * n)
        experts = int(cfg.num_experts)
        moe = moe_facts(cfg).moe_mask
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0) if mt == "qwen2_moe" else 0
        return cls(**common, moe_layers=moe, num_experts=experts, top_k=int(cfg.num_experts_per_tok),
                   moe_ffn_hidden_size=int(cfg.moe_intermediate_size), norm_topk_prob=bool(cfg.norm_topk_prob),
                   shared_expert_size=shared)  # fmt: skip


# ---------------------------------------------------------------------------------------------- HF <-> global


def _qkv_fuse(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    q = q.reshape(g, arch.heads_per_group * d, *tail)
    return torch.cat([q, k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1).reshape(-1, *tail)


def _qkv_split(arch: ModelArch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, hpg = arch.num_kv_heads, arch.head_dim, arch.heads_per_group
    tail = qkv.shape[1:]
    x = qkv.reshape(g, (hpg + 2) * d, *tail)
    q, k, v = torch.split(x, [hpg * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pop(sd: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return sd.pop(key)
    except KeyError:
        raise ValueError(f"HF state dict lacks {key!r}") from None


def hf_to_mcore(hf: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Whole HF state dict -> global megatron names (layer numbers and expert ids global, tensors unsharded)."""
    sd = dict(hf)
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": _pop(sd, "model.embed_tokens.weight")}
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = _pop(sd, p + "input_layernorm.weight")
        a = p + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _qkv_fuse(
            arch, _pop(sd, a + "q_proj.weight"), _pop(sd, a + "k_proj.weight"), _pop(sd, a + "v_proj.weight")
        )
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _qkv_fuse(
                arch, _pop(sd, a + "q_proj.bias"), _pop(sd, a + "k_proj.bias"), _pop(sd, a + "v_proj.bias")
            )
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = _pop(sd, a + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = _pop(sd, a + "k_norm.weight")
        out[m + "self_attention.linear_proj.weight"] = _pop(sd, a + "o_proj.weight")
        out[m + "pre_mlp_layernorm.weight"] = _pop(sd, p + "post_attention_layernorm.weight")
        mlp = p + "mlp."
        if not arch.moe_layers[i]:
            gate, up = _pop(sd, mlp + "gate_proj.weight"), _pop(sd, mlp + "up_proj.weight")
            out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
            out[m + "mlp.linear_fc2.weight"] = _pop(sd, mlp + "down_proj.weight")
            continue
        out[m + "mlp.router.weight"] = _pop(sd, mlp + "gate.weight")
        fused = mlp + "experts.gate_up_proj"
        if fused in sd:
            gate_up, down = _pop(sd, fused), _pop(sd, mlp + "experts.down_proj")
            if gate_up.shape != (arch.num_experts, 2 * arch.moe_ffn_hidden_size, arch.hidden_size):
                raise ValueError(f"{fused} has shape {tuple(gate_up.shape)}; expected [E, 2I, H]")
            for e in range(arch.num_experts):
                out[m + f"mlp.experts.{e}.linear_fc1.weight"] = gate_up[e]
                out[m + f"mlp.experts.{e}.linear_fc2.weight"] = down[e]
        else:
            for e in range(arch.num_experts):
                x = f"{mlp}experts.{e}."
                gate, up = _pop(sd, x + "gate_proj.weight"), _pop(sd, x + "up_proj.weight")
                out[m + f"mlp.experts.{e}.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
                out[m + f"mlp.experts.{e}.linear_fc2.weight"] = _pop(sd, x + "down_proj.weight")
        if arch.shared_expert_size:
            s = mlp + "shared_expert."
            gate, up = _pop(sd, s + "gate_proj.weight"), _pop(sd, s + "up_proj.weight")
            out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
            out[m + "mlp.shared_experts.linear_fc2.weight"] = _pop(sd, s + "down_proj.weight")
            out[m + "mlp.shared_experts.gate_weight"] = _pop(sd, mlp + "shared_expert_gate.weight")
    out["decoder.final_layernorm.weight"] = _pop(sd, "model.norm.weight")
    if not arch.tie_embeddings:
        out["output_layer.weight"] = _pop(sd, "lm_head.weight")
    else:
        sd.pop("lm_head.weight", None)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if sd:
        raise ValueError(f"HF state dict has weights the conversion does not know: {sorted(sd)[:5]}")
    return out


def mcore_to_hf(mc: Mapping[str, torch.Tensor], arch: ModelArch, *, fused_experts: bool = True
                ) -> dict[str, torch.Tensor]:  # fmt: skip
    """Global megatron names -> HF names. ``fused_experts``: transformers-5 in-memory layout, else per expert."""
    sd = dict(mc)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _pop(sd, "embedding.word_embeddings.weight")}
    f, ff = arch.ffn_hidden_size, arch.moe_ffn_hidden_size
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = _pop(sd, m + "input_layernorm.weight")
        a = p + "self_attn."
        q, k, v = _qkv_split(arch, _pop(sd, m + "self_attention.linear_qkv.weight"))
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
        if arch.qkv_bias:
            q, k, v = _qkv_split(arch, _pop(sd, m + "self_attention.linear_qkv.bias"))
            out.update({a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v})
        if arch.qk_norm:
            out[a + "q_norm.weight"] = _pop(sd, m + "self_attention.q_layernorm.weight")
            out[a + "k_norm.weight"] = _pop(sd, m + "self_attention.k_layernorm.weight")
        out[a + "o_proj.weight"] = _pop(sd, m + "self_attention.linear_proj.weight")
        out[p + "post_attention_layernorm.weight"] = _pop(sd, m + "pre_mlp_layernorm.weight")
        mlp = p + "mlp."
        if not arch.moe_layers[i]:
            fc1 = _pop(sd, m + "mlp.linear_fc1.weight")
            out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = fc1[:f], fc1[f:]
            out[mlp + "down_proj.weight"] = _pop(sd, m + "mlp.linear_fc2.weight")
            continue
        out[mlp + "gate.weight"] = _pop(sd, m + "mlp.router.weight")
        e_fc1 = [_pop(sd, m + f"mlp.experts.{e}.linear_fc1.weight") for e in range(arch.num_experts)]
        e_fc2 = [_pop(sd, m + f"mlp.experts.{e}.linear_fc2.weight") for e in range(arch.num_experts)]
        if fused_experts:
            out[mlp + "experts.gate_up_proj"] = torch.stack(e_fc1)
            out[mlp + "experts.down_proj"] = torch.stack(e_fc2)
        else:
            for e in range(arch.num_experts):
                x = f"{mlp}experts.{e}."
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = e_fc1[e][:ff], e_fc1[e][ff:]
                out[x + "down_proj.weight"] = e_fc2[e]
        if arch.shared_expert_size:
            s, fs = mlp + "shared_expert.", arch.shared_expert_size
            fc1s = _pop(sd, m + "mlp.shared_experts.linear_fc1.weight")
            out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = fc1s[:fs], fc1s[fs:]
            out[s + "down_proj.weight"] = _pop(sd, m + "mlp.shared_experts.linear_fc2.weight")
            out[mlp + "shared_expert_gate.weight"] = _pop(sd, m + "mlp.shared_experts.gate_weight")
    out["model.norm.weight"] = _pop(sd, "decoder.final_layernorm.weight")
    if arch.tie_embeddings:
        sd.pop("output_layer.weight", None)
    else:
        out["lm_head.weight"] = _pop(sd, "output_layer.weight")
    if sd:
        raise ValueError(f"megatron state dict has weights the conversion does not know: {sorted(sd)[:5]}")
    return {k: v.contiguous() for k, v in out.items()}


# ---------------------------------------------------------------------------------------------- TP sharding

_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
_GATED = ("linear_fc1.weight",)
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def tp_kind(name: str) -> str:
    """How a global megatron tensor is split over tensor-parallel ranks: column / gated / row / replicated."""
    if "shared_experts.gate_weight" in name:
        return "replicated"
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith(_GATED):
        return "gated"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def shard(name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s slice of global tensor ``name``."""
    if tp_size == 1:
        return tensor
    kind = tp_kind(name)
    if kind == "replicated":
        return tensor
    dim = 1 if kind == "row" else 0
    if tensor.shape[dim] % (2 * tp_size if kind == "gated" else tp_size):
        raise ValueError(f"{name} of shape {tuple(tensor.shape)} does not split over tp={tp_size}")
    if kind == "gated":
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0).contiguous()
    return tensor.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard`: the global tensor from all TP ranks' slices (in rank order)."""
    if len(pieces) == 1:
        return pieces[0]
    kind = tp_kind(name)
    if kind == "replicated":
        return pieces[0]
    if kind == "gated":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(pieces, dim=1 if kind == "row" else 0)


# ---------------------------------------------------------------------------------------------- local names

LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
"""A layer's megatron name: its layer number and the rest (``mlp.router.weight``...)."""
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
GLOBAL_EXPERT_NAME = re.compile(r"^mlp\.experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
"""The rest of a global expert weight's name (after :data:`LAYER_NAME`): expert id, fc, weight or bias."""


@dataclass(frozen=True, slots=True)
class RankNaming:
    """How one rank's module names relate to global names."""

    layer_offset: int = 0
    """Global index of this stage's first layer."""
    num_local_layers: int = 0
    """Layers on this stage."""
    expert_offset: int = 0
    """Global id of this rank's first local expert (``ep_rank * experts_per_rank``)."""
    num_local_experts: int = 0
    """Experts held by this rank."""
    te_spec: bool = False
    """Transformer Engine spec: norms fused into ``linear_qkv`` / dense ``linear_fc1`` (``layer_norm_weight``)."""
    grouped_experts: bool = False
    """Grouped-GEMM experts (``experts.linear_fc1.weight{e}``) instead of ``experts.local_experts.{e}.``."""
    has_embedding: bool = True
    """First stage (or tied output): holds ``embedding.word_embeddings.weight``."""
    has_output: bool = True
    """Last stage: holds the final norm and ``output_layer``."""


def global_name(local: str, naming: RankNaming, moe_layers: tuple[bool, ...]) -> str | None:
    """A rank's parameter name -> global name; None for names that are not weights we convert."""
    mm = LAYER_NAME.match(local)
    if mm is None:
        return local
    i = int(mm.group(1)) + naming.layer_offset
    rest = mm.group(2)
    if naming.te_spec:
        rest = rest.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
        if not moe_layers[i]:
            rest = rest.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
    if (e := _LOCAL_EXPERT.match(rest)) is not None:
        rest = f"mlp.experts.{int(e.group(1)) + naming.expert_offset}.{e.group(2)}.{e.group(3)}"
    elif (e := _GROUPED_EXPERT.match(rest)) is not None:
        rest = f"mlp.experts.{int(e.group(3)) + naming.expert_offset}.{e.group(1)}.{e.group(2)}"
    if rest.endswith("._extra_state") or "._extra_state" in rest:
        return None
    return f"decoder.layers.{i}.{rest}"


def local_name(glob: str, naming: RankNaming, moe_layers: tuple[bool, ...]) -> str | None:
    """Global name -> this rank's parameter name; None when the weight lives on another rank."""
    mm = LAYER_NAME.match(glob)
    if mm is None:
        if glob.startswith("embedding."):
            return glob if naming.has_embedding else None
        return glob if naming.has_output else None
    i = int(mm.group(1))
    li = i - naming.layer_offset
    if not 0 <= li < naming.num_local_layers:
        return None
    rest = mm.group(2)
    if (e := GLOBAL_EXPERT_NAME.match(rest)) is not None:
        le = int(e.group(1)) - naming.expert_offset
        if not 0 <= le < naming.num_local_experts:
            return None
        if naming.grouped_experts:
            rest = f"mlp.experts.{e.group(2)}.{e.group(3)}{le}"
        else:
            rest = f"mlp.experts.local_experts.{le}.{e.group(2)}.{e.group(3)}"
    if naming.te_spec:
        if rest == "input_layernorm.weight":
            rest = "self_attention.linear_qkv.layer_norm_weight"
        elif rest == "pre_mlp_layernorm.weight" and not moe_layers[i]:
            rest = "mlp.linear_fc1.layer_norm_weight"
    return f"decoder.layers.{li}.{rest}"


def local_state(
    glob: Mapping[str, torch.Tensor], naming: RankNaming, arch: ModelArch, tp_rank: int, tp_size: int,
    etp_rank: int = 0, etp_size: int = 1,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The slice of a global megatron state dict that one rank loads (names local, tensors TP/ETP-sharded)."""
    out: dict[str, torch.Tensor] = {}
    for g, t in glob.items():
        ln = local_name(g, naming, arch.moe_layers)
        if ln is None:
            continue
        expert = GLOBAL_EXPERT_NAME.match(g.split(".", 3)[-1]) is not None
        out[ln] = shard(g, t, etp_rank, etp_size) if expert else shard(g, t, tp_rank, tp_size)
    return out


def expected_global_names(arch: ModelArch) -> list[str]:
    """Every global megatron name of a model (to check that an export is complete)."""
    names = {k for k in hf_to_mcore(_meta_hf(arch), arch)}
    return sorted(names)


def _meta_hf(arch: ModelArch) -> dict[str, torch.Tensor]:
    """A meta-device HF state dict with the right names and shapes (no memory)."""
    h, d, f, ff = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size, arch.moe_ffn_hidden_size
    t = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    sd = {
        "model.embed_tokens.weight": t(arch.vocab_size, h),
        "model.norm.weight": t(h),
        "lm_head.weight": t(arch.vocab_size, h),
    }
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": t(h), p + "post_attention_layernorm.weight": t(h)})
        a = p + "self_attn."
        sd.update({a + "q_proj.weight": t(arch.num_heads * d, h), a + "k_proj.weight": t(arch.num_kv_heads * d, h),
                   a + "v_proj.weight": t(arch.num_kv_heads * d, h), a + "o_proj.weight": t(h, arch.num_heads * d)})  # fmt: skip
        if arch.qkv_bias:
            sd.update({a + "q_proj.bias": t(arch.num_heads * d), a + "k_proj.bias": t(arch.num_kv_heads * d),
                       a + "v_proj.bias": t(arch.num_kv_heads * d)})  # fmt: skip
        if arch.qk_norm:
            sd.update({a + "q_norm.weight": t(d), a + "k_norm.weight": t(d)})
        m = p + "mlp."
        if not arch.moe_layers[i]:
            sd.update({m + "gate_proj.weight": t(f, h), m + "up_proj.weight": t(f, h), m + "down_proj.weight": t(h, f)})
            continue
        sd.update({m + "gate.weight": t(arch.num_experts, h), m + "experts.gate_up_proj": t(arch.num_experts, 2 * ff, h),
                   m + "experts.down_proj": t(arch.num_experts, h, ff)})  # fmt: skip
        if arch.shared_expert_size:
            s, fs = m + "shared_expert.", arch.shared_expert_size
            sd.update({s + "gate_proj.weight": t(fs, h), s + "up_proj.weight": t(fs, h), s + "down_proj.weight": t(h, fs),
                       m + "shared_expert_gate.weight": t(1, h)})  # fmt: skip
    return sd


def iter_hf_buckets(hf: Mapping[str, torch.Tensor], names: Iterable[str] | None = None):
    """HF tensors in a stable (sorted) order, as contiguous CPU tensors: what ``export_weights`` yields."""
    for k in sorted(names if names is not None else hf):
        yield k, hf[k].detach().to("cpu").contiguous()
