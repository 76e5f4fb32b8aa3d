"""One Megatron rank's weights as Hugging Face-named pieces: what the rank publishes itself, with no gather.

A rank holds, for its pipeline stage, tensor-parallel slices of the dense weights and its expert-parallel share
of the experts (tensor-parallel slices of them under expert tensor parallelism). Each becomes one or more
:class:`~async_rl.weights.snapshot.Piece`: a slice along one dimension of a Hugging Face tensor, or the whole
tensor. The manifest lists every piece with where it goes; generators assemble them (the publisher checks that
the pieces of all ranks tile every tensor exactly once).

Layouts, per global megatron tensor (see :mod:`.convert`):

* ``linear_qkv`` (column-parallel, grouped per KV head ``[q_g, k_g, v_g]``): a rank holds whole query groups,
  i.e. rows of ``q_proj``, ``k_proj`` and ``v_proj`` (three pieces along dim 0);
* gated ``linear_fc1`` (``[gate; up]``, each half split over the ranks): rows of ``gate_proj`` and ``up_proj``;
* row-parallel ``linear_proj`` / ``linear_fc2``: columns of ``o_proj`` / ``down_proj`` (dim 1);
* vocab-parallel embedding and output layer: rows;
* experts: with transformers' fused layout (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj
  [E, H, I]``) a rank's consecutive experts are one slice along dim 0, which needs whole experts on a rank
  (``expert_tensor_parallel = 1``); per-expert checkpoint names take any expert tensor parallelism;
* replicated tensors (norms, routers, the shared-expert gate): the whole tensor, from tensor-parallel rank 0.

Of replicas only one rank publishes: the caller says whether this rank publishes its dense weights (data-
and context-parallel rank 0) and its experts (expert-data-parallel rank 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from actors.learner.megatron.convert import GLOBAL_EXPERT_NAME, LAYER_NAME, ModelArch, RankNaming, global_name, tp_kind
from actors.learner.megatron.spec import STACKED_EXPERTS
from async_rl.weights.snapshot import Piece

# Replicated megatron tensors (relative to ``decoder.layers.{i}.``) -> their Hugging Face name (relative to
# ``model.layers.{i}.``).
_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
# Gated fc1 (``[gate; up]``) and row-parallel fc2 of the dense and shared-expert MLPs -> the HF MLP prefix.
_MLP = {"mlp.": "mlp.", "mlp.shared_experts.": "mlp.shared_expert."}


def rank_pieces(
    local: Mapping[str, torch.Tensor], naming: RankNaming, arch: ModelArch, *, tp_rank: int, tp_size: int,
    etp_rank: int = 0, etp_size: int = 1, dense: bool = True, experts: bool = True, fused_experts: bool = True,
) -> list[Piece]:  # fmt: skip
    """The pieces this rank publishes, from its parameters ``local`` (its own module names, its slices).

    ``dense`` / ``experts``: this rank is the one replica that publishes its dense weights / its experts.
    ValueError for a name the conversion does not know, or fused experts split by expert tensor parallelism."""
    if fused_experts and etp_size > 1:
        raise ValueError("per-rank export with fused expert tensors needs expert_tensor_parallel=1 "
                         "(or learner.megatron.fused_experts_export=false: per-expert names)")  # fmt: skip
    out: list[Piece] = []
    stacked: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # (layer, fc) -> global expert id -> tensor
    for name, t in local.items():
        g = global_name(name, naming, arch.moe_layers)
        if g is None:
            continue
        if g == "output_layer.weight" and arch.tie_embeddings:
            continue
        m = LAYER_NAME.match(g)
        e = GLOBAL_EXPERT_NAME.match(m.group(2)) if m is not None else None
        if e is not None and e.group(3) == "weight":  # expert biases: none in the supported models (refused below)
            assert m is not None
            if not experts:
                continue
            layer, expert, fc = int(m.group(1)), int(e.group(1)), e.group(2)
            if fused_experts:
                stacked.setdefault((layer, fc), {})[expert] = t
            else:
                out += _expert_pieces(arch, layer, expert, fc, t, etp_rank, etp_size)
            continue
        if dense:
            out += _dense_pieces(arch, g, t, tp_rank, tp_size)
    for (layer, fc), by_expert in sorted(stacked.items()):
        out += _stacked_expert_pieces(arch, layer, fc, by_expert)
    return out


def stacked_expert_pieces(stacked: Mapping[str, torch.Tensor], naming: RankNaming, arch: ModelArch) -> list[Piece]:
    """Fused expert tensors straight from the grouped experts' stacked weights (``...experts.weight1`` /
    ``weight2``, local names; :data:`~actors.learner.megatron.spec.STACKED_EXPERTS`), with expert tensor
    parallelism 1: ``weight1 [E_local, 2I, H]`` is ``gate_up_proj``'s rows of this rank's experts and ``weight2
    [E_local, H, I]`` ``down_proj``'s, so each is one view. What :func:`rank_pieces` gives for their per-expert
    split, without splitting 2 x E_local views per layer and stacking them again (the host time of a version)."""
    out = []
    for name, t in stacked.items():
        m = STACKED_EXPERTS.match(name)
        g = global_name(name, naming, arch.moe_layers)
        layer = LAYER_NAME.match(g or "")
        if m is None or layer is None:
            raise ValueError(f"per-rank export: {name!r} is not a stacked expert weight")
        fused = "gate_up_proj" if m.group(2) == "1" else "down_proj"
        out.append(_piece(f"model.layers.{layer.group(1)}.mlp.experts.{fused}", t,
                          (arch.num_experts, *t.shape[1:]), 0, naming.expert_offset))  # fmt: skip
    return out


def _piece(name: str, part: torch.Tensor, full: tuple[int, ...], dim: int, start: int) -> Piece:
    """A slice of ``full`` along ``dim`` from ``start``; the whole tensor when it covers all of it."""
    if tuple(part.shape) == full:
        return Piece(name, part)
    return Piece(name, part, full_shape=full, dim=dim, start=start)


def _dense_pieces(arch: ModelArch, g: str, t: torch.Tensor, tp_rank: int, tp_size: int) -> list[Piece]:
    kind = tp_kind(g)
    if kind == "replicated" and tp_rank != 0:
        return []
    if g == "embedding.word_embeddings.weight":
        return [_rows("model.embed_tokens.weight", t, tp_rank, tp_size)]
    if g == "output_layer.weight":
        return [_rows("lm_head.weight", t, tp_rank, tp_size)]
    if g == "decoder.final_layernorm.weight":
        return [Piece("model.norm.weight", t)]
    m = LAYER_NAME.match(g)
    if m is None:
        raise ValueError(f"per-rank export: unknown megatron weight {g!r}")
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest in _REPLICATED:
        return [Piece(p + _REPLICATED[rest], t)]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv_pieces(arch, p + "self_attn.", rest.rsplit(".", 1)[1], t, tp_rank, tp_size)
    if rest == "self_attention.linear_proj.weight":
        return [_cols(p + "self_attn.o_proj.weight", t, tp_rank, tp_size)]
    for mc, hf in _MLP.items():
        if rest == mc + "linear_fc1.weight":
            return _gated_pieces(p + hf, t, tp_rank, tp_size)
        if rest == mc + "linear_fc2.weight":
            return [_cols(p + hf + "down_proj.weight", t, tp_rank, tp_size)]
    raise ValueError(f"per-rank export: unknown megatron weight {g!r}")


def _rows(name: str, t: torch.Tensor, rank: int, size: int) -> Piece:
    n = t.shape[0]
    return _piece(name, t, (n * size, *t.shape[1:]), 0, rank * n)


def _cols(name: str, t: torch.Tensor, rank: int, size: int) -> Piece:
    n = t.shape[1]
    return _piece(name, t, (t.shape[0], n * size, *t.shape[2:]), 1, rank * n)


def _gated_pieces(prefix: str, t: torch.Tensor, rank: int, size: int) -> list[Piece]:
    """This rank's ``[gate; up]`` slice of a gated fc1 -> rows of ``gate_proj`` and ``up_proj``."""
    gate, up = t.chunk(2, dim=0)
    return [_rows(prefix + "gate_proj.weight", gate, rank, size), _rows(prefix + "up_proj.weight", up, rank, size)]


def _qkv_pieces(arch: ModelArch, prefix: str, what: str, t: torch.Tensor, rank: int, size: int) -> list[Piece]:
    """This rank's query groups of ``linear_qkv`` -> rows of ``q_proj``, ``k_proj`` and ``v_proj``."""
    d, hpg = arch.head_dim, arch.heads_per_group
    groups = arch.num_kv_heads // size
    tail = t.shape[1:]
    q, k, v = torch.split(t.reshape(groups, (hpg + 2) * d, *tail), [hpg * d, d, d], dim=1)
    first = rank * groups
    return [
        _piece(prefix + f"q_proj.{what}", q.reshape(-1, *tail), (arch.num_heads * d, *tail), 0, first * hpg * d),
        _piece(prefix + f"k_proj.{what}", k.reshape(-1, *tail), (arch.num_kv_heads * d, *tail), 0, first * d),
        _piece(prefix + f"v_proj.{what}", v.reshape(-1, *tail), (arch.num_kv_heads * d, *tail), 0, first * d),
    ]


def _expert_pieces(arch: ModelArch, layer: int, expert: int, fc: str, t: torch.Tensor, etp_rank: int,
                   etp_size: int) -> list[Piece]:  # fmt: skip
    """Per-expert checkpoint names: this rank's slice of one expert's fc1 (gate and up rows) or fc2 (columns)."""
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    if fc == "linear_fc1":
        return _gated_pieces(prefix, t, etp_rank, etp_size)
    return [_cols(prefix + "down_proj.weight", t, etp_rank, etp_size)]


def _stacked_expert_pieces(arch: ModelArch, layer: int, fc: str, by_expert: dict[int, torch.Tensor]) -> list[Piece]:
    """Fused expert tensors: each run of consecutive experts this rank holds -> one slice along dim 0."""
    name = f"model.layers.{layer}.mlp.experts." + ("gate_up_proj" if fc == "linear_fc1" else "down_proj")
    ids = sorted(by_expert)
    out: list[Piece] = []
    run = [ids[0]]
    for e in ids[1:] + [None]:  # type: ignore[list-item]
        if e is not None and e == run[-1] + 1:
            run.append(e)
            continue
        part = torch.stack([by_expert[i] for i in run])
        out.append(_piece(name, part, (arch.num_experts, *part.shape[1:]), 0, run[0]))
        if e is not None:
            run = [e]
    return out
