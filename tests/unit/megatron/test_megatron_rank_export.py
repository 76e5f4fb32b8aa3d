"""Per-rank export (pure torch, no megatron-core): the pieces every rank of a TP / PP / EP / ETP layout publishes
tile each Hugging Face tensor exactly once and assemble into the gathered export, bit for bit."""

from __future__ import annotations

import pytest
import torch

from actors.learner.megatron.convert import ModelArch, RankNaming, hf_to_mcore, local_state, mcore_to_hf
from actors.learner.megatron.rank_export import rank_pieces
from actors.learner.megatron.routes import PipelineSplit
from async_rl.weights.snapshot import Piece
from tests.unit.megatron.test_megatron_convert import _mixtral, _qwen2, _qwen3


def world_pieces(build, *, tp: int, pp: int, dp: int, ep: int, etp: int, te_spec: bool = False,
                 fused: bool = True) -> tuple[list[list[Piece]], dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]  # fmt: skip
    """Each rank's pieces for a layout of ``tp * pp * dp`` ranks, and the gathered HF export to compare with.

    Within a stage rank r has tensor-parallel rank ``r % tp`` and data-parallel rank ``r // tp`` (dense weights),
    and expert tensor-, expert- and expert-data-parallel ranks ``r % etp``, ``(r // etp) % ep``, ``r // (etp*ep)``
    (megatron folds the experts' layout into the same ``tp * dp`` ranks)."""
    model = build()
    arch = ModelArch.from_hf_config(model.config)
    glob = hf_to_mcore({k: v.clone() for k, v in model.state_dict().items()}, arch)
    assert (tp * dp) % (etp * ep) == 0
    uneven = arch.num_layers % pp != 0
    split = PipelineSplit(num_layers=arch.num_layers, pp_size=pp, first_stage_layers=1 if uneven else None)
    local_experts = arch.num_experts // ep
    ranks: list[list[Piece]] = []
    for stage in range(pp):
        for r in range(tp * dp):
            tp_rank, dp_rank = r % tp, r // tp
            etp_rank, ep_rank, edp_rank = r % etp, (r // etp) % ep, r // (etp * ep)
            naming = RankNaming(layer_offset=split.offset(stage), num_local_layers=split.num_layers_on(stage),
                                expert_offset=ep_rank * local_experts, num_local_experts=local_experts,
                                te_spec=te_spec, grouped_experts=te_spec, has_embedding=stage == 0,
                                has_output=stage == pp - 1)  # fmt: skip
            local = local_state(glob, naming, arch, tp_rank, tp, etp_rank, etp)
            ranks.append(rank_pieces(local, naming, arch, tp_rank=tp_rank, tp_size=tp, etp_rank=etp_rank,
                                     etp_size=etp, dense=dp_rank == 0, experts=edp_rank == 0, fused_experts=fused))  # fmt: skip
    return ranks, mcore_to_hf(glob, arch, fused_experts=fused)


def _assemble(ranks: list[list[Piece]], want: dict[str, torch.Tensor]) -> None:
    """Every element of every wanted tensor written by exactly one piece, with the gathered export's value."""
    pieces = [p for rank in ranks for p in rank]
    got = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    hits = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in want.items()}
    for p in pieces:
        p.check()
        assert p.name in want, p.name
        if p.whole:
            dst, cnt = got[p.name], hits[p.name]
        else:
            assert p.full_shape == tuple(want[p.name].shape), p.name
            n = p.tensor.shape[p.dim]
            dst = got[p.name].narrow(p.dim, p.start, n)
            cnt = hits[p.name].narrow(p.dim, p.start, n)
        dst.copy_(p.tensor)
        cnt += 1
    for k, v in want.items():
        assert bool((hits[k] == 1).all()), f"{k}: covered {hits[k].min().item()}..{hits[k].max().item()} times"
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("build", [_qwen3, _qwen2, _mixtral])
@pytest.mark.parametrize(
    "tp, pp, dp, ep, etp",
    [(1, 1, 1, 1, 1), (2, 1, 1, 1, 1), (1, 2, 1, 1, 1), (1, 1, 2, 2, 1), (2, 1, 1, 2, 1), (2, 2, 2, 2, 1),
     (2, 1, 2, 2, 2), (1, 1, 4, 2, 1),
     # the 4-GPU layouts of run_layouts.sh x4 (issue 39): EP=4, PP=2 x EP=2, TP=2 x EP=2 with expert TP 1 (megatron's
     # default expert TP = TP is (2, 1, 2, 2, 2) above; DP=2 x EP=2 is (1, 1, 4, 2, 1))
     (1, 1, 4, 4, 1), (1, 2, 2, 2, 1), (2, 1, 2, 2, 1)],
)  # fmt: skip
def test_every_layout_tiles_the_export_exactly_once(build, tp: int, pp: int, dp: int, ep: int, etp: int) -> None:  # type: ignore[no-untyped-def]
    for fused in (True, False):
        if fused and etp > 1:
            continue
        ranks, want = world_pieces(build, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, fused=fused)
        _assemble(ranks, want)


def test_te_spec_names_and_whole_tensors_on_one_rank() -> None:
    ranks, want = world_pieces(_qwen3, tp=2, pp=2, dp=2, ep=2, etp=1, te_spec=True)
    _assemble(ranks, want)
    pieces = [p for rank in ranks for p in rank]
    # One rank holds everything: every piece is a whole tensor (zero-copy views for the publisher).
    [single], want1 = world_pieces(_qwen3, tp=1, pp=1, dp=1, ep=1, etp=1)
    assert all(p.whole for p in single) and sorted(p.name for p in single) == sorted(want1)
    # Under EP=2 a rank's experts of a layer go out as one slice of the fused tensor, not one piece per expert.
    experts = [p for p in pieces if p.name == "model.layers.1.mlp.experts.gate_up_proj"]
    assert [(p.start, p.tensor.shape[0]) for p in experts] == [(0, 2), (2, 2)]


def test_fused_experts_split_by_expert_tensor_parallelism_are_refused() -> None:
    model = _qwen3()
    arch = ModelArch.from_hf_config(model.config)
    with pytest.raises(ValueError, match="expert_tensor_parallel=1"):
        rank_pieces({}, RankNaming(), arch, tp_rank=0, tp_size=2, etp_rank=0, etp_size=2)
    with pytest.raises(ValueError, match="unknown megatron weight 'decoder.layers.0.mystery.weight'"):
        rank_pieces({"decoder.layers.0.mystery.weight": torch.zeros(2)}, RankNaming(num_local_layers=3), arch,
                    tp_rank=0, tp_size=1)  # fmt: skip


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_stacked_expert_weights_give_the_same_pieces_as_views(ep_rank: int) -> None:
    import re

    from actors.learner.megatron.rank_export import stacked_expert_pieces

    model = _qwen3()
    arch = ModelArch.from_hf_config(model.config)
    glob = hf_to_mcore({k: v.clone() for k, v in model.state_dict().items()}, arch)
    local_experts = arch.num_experts // 2
    naming = RankNaming(num_local_layers=arch.num_layers, expert_offset=ep_rank * local_experts,
                        num_local_experts=local_experts, has_embedding=True, has_output=True)  # fmt: skip
    local = local_state(glob, naming, arch, 0, 1, 0, 1)
    per_expert = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
    stacked: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        for fc in ("1", "2"):
            ts = [local[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc{fc}.weight"]
                  for e in range(local_experts) if f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc{fc}.weight" in local]  # fmt: skip
            if ts:  # the grouped experts' parameter, as the backend names it
                stacked[f"decoder.layers.{layer}.mlp.experts.weight{fc}"] = torch.stack(ts)
    assert stacked
    experts_only = {k: v for k, v in local.items() if per_expert.match(k)}
    want = rank_pieces(experts_only, naming, arch, tp_rank=0, tp_size=1, dense=False, experts=True)
    got = stacked_expert_pieces(stacked, naming, arch)
    key = sorted((p.name, p.full_shape, p.dim, p.start) for p in want)
    assert sorted((p.name, p.full_shape, p.dim, p.start) for p in got) == key
    by_name = {p.name: p for p in want}
    for p in got:
        assert torch.equal(p.tensor, by_name[p.name].tensor)
        assert any(p.tensor.data_ptr() == s.data_ptr() for s in stacked.values())  # a view of the parameter
