"""The replayed in-place load (actors/generator/vllm_load_plan.py) on a model whose loaders work as vLLM's do:
stacked q/k/v and gate/up shards, experts stacked into one parameter, a tensor-parallel slice, plain copies."""

from __future__ import annotations

import pytest
import torch

from actors.generator.vllm_load_plan import PlanRefused, apply, record, verify_checkpoint

E, H, FFN, KV = 4, 8, 6, 2  # experts, hidden, expert FFN, KV width
VOCAB, PAD = 5, 3


class StackedLayer(torch.nn.Module):
    """q/k/v into one parameter and experts into [E, 2I, H] / [E, H, FFN], like vLLM's QKVParallelLinear and FusedMoE;
    ``tp_rank`` of two takes the second half of the down projection's input dimension."""

    def __init__(self, tp_rank: int | None = None, convert: bool = False) -> None:
        super().__init__()
        self.tp_rank = tp_rank
        self.convert = convert
        self.qkv = torch.nn.Parameter(torch.zeros(H + 2 * KV, H), requires_grad=False)
        self.w13 = torch.nn.Parameter(torch.zeros(E, 2 * FFN, H), requires_grad=False)
        down_in = FFN if tp_rank is None else FFN // 2
        self.w2 = torch.nn.Parameter(torch.zeros(E, H, down_in), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.ones(VOCAB + PAD, H), requires_grad=False)  # padded like vLLM's vocab

    def load_weights(self, weights) -> set[str]:
        done = set()
        offsets = {"q": (0, H), "k": (H, KV), "v": (H + KV, KV)}
        for name, w in weights:
            parts = name.split(".")
            if parts[0] in offsets:
                start, n = offsets[parts[0]]
                src = w.clone() if self.convert else w  # a loader that makes its own tensor
                self.qkv.data.narrow(0, start, n).copy_(src)
            elif parts[0] == "experts":
                e, which = int(parts[1]), parts[2]
                if which == "down":
                    if self.tp_rank is not None:
                        w = w.narrow(1, self.tp_rank * (FFN // 2), FFN // 2)
                    self.w2.data[e].copy_(w)
                else:
                    self.w13.data[e].narrow(0, 0 if which == "gate" else FFN, FFN).copy_(w)
            elif name == "norm":
                self.norm.data.copy_(w)
            elif name == "emb":
                self.emb[:VOCAB].data.copy_(w)
                self.emb[VOCAB:].data.fill_(0)
                self.emb[VOCAB + PAD :].data.copy_(w[VOCAB:])  # an empty shard, from past the source's end
            done.add(name)
        return done


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"q": torch.randn(H, H, generator=g), "k": torch.randn(KV, H, generator=g),
           "v": torch.randn(KV, H, generator=g), "norm": torch.randn(H, generator=g),
           "emb": torch.randn(VOCAB, H, generator=g)}  # fmt: skip
    for e in range(E):
        out[f"experts.{e}.gate"] = torch.randn(FFN, H, generator=g)
        out[f"experts.{e}.up"] = torch.randn(FFN, H, generator=g)
        out[f"experts.{e}.down"] = torch.randn(H, FFN, generator=g)
    return out


def packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors as views of one flat buffer (as a published bucket holds them)."""
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    out, at = {}, 0
    for name, t in tensors.items():
        out[name] = flat[at : at + t.numel()].view(t.shape)
        at += t.numel()
    return out


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp_rank", [None, 1])
def test_replay_equals_the_loaders_and_recording_writes_nothing(tp_rank: int | None) -> None:
    model = StackedLayer(tp_rank)
    model.load_weights(checkpoint(0).items())
    before = state(model)
    plan = verify_checkpoint(model, [checkpoint(0)])  # vLLM-style load: proven against what was loaded
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())

    version = packed(checkpoint(1))
    assert plan.matches(version)  # the same shapes, strides and dtypes, another storage
    bound = plan.bind(version)
    assert sum(len(d) for d, _ in bound) == len(plan.steps)
    # one dtype, all contiguous: one fused copy; a tensor-parallel slice of the down projection is strided
    assert [len(d) for d, _ in bound] == ([len(plan.steps)] if tp_rank is None else [len(plan.steps) - E, E])
    apply(bound)
    reference = StackedLayer(tp_rank)
    reference.load_weights(checkpoint(1).items())
    for name, p in model.named_parameters():
        assert torch.equal(p, dict(reference.named_parameters())[name]), name
    padding = PAD * H * 4  # the padding rows are filled once, never replayed
    assert plan.num_bytes() == sum(p.numel() * p.element_size() for p in model.parameters()) - padding


def test_processing_that_changes_weights_is_refused_with_the_parameter_named() -> None:
    model = StackedLayer()
    model.load_weights(checkpoint(0).items())
    model.w13.data.mul_(2)  # what a kernel's repacking after loading would do
    with pytest.raises(PlanRefused, match="w13 differs"):
        verify_checkpoint(model, [checkpoint(0)])
    model.load_weights(checkpoint(0).items())
    model.emb.data[VOCAB:] = 1.0  # padding rows changed after loading
    with pytest.raises(PlanRefused, match="emb: a region the loaders set to 0.0 holds other values"):
        verify_checkpoint(model, [checkpoint(0)])


def test_a_parameter_the_loaders_never_write_is_refused() -> None:
    model = StackedLayer()
    model.extra = torch.nn.Parameter(torch.zeros(3), requires_grad=False)  # derived while processing
    model.load_weights(checkpoint(0).items())
    with pytest.raises(PlanRefused, match="extra is not written"):
        verify_checkpoint(model, [checkpoint(0)])


def test_a_partly_written_parameter_is_refused() -> None:
    model = StackedLayer()
    ckpt = checkpoint(0)
    del ckpt["experts.3.down"]
    model.load_weights(ckpt.items())
    with pytest.raises(PlanRefused, match="w2: the loaders write"):
        verify_checkpoint(model, [ckpt])


def test_a_loader_that_converts_its_source_is_refused_and_writes_nothing() -> None:
    model = StackedLayer(convert=True)
    before = state(model)
    with pytest.raises(PlanRefused, match="not a view of a published one"):
        record(model, checkpoint(0))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_a_region_written_twice_is_refused() -> None:
    class Filling(StackedLayer):
        def load_weights(self, weights):
            self.norm.data.fill_(1.0)
            return super().load_weights(weights)

    with pytest.raises(PlanRefused, match="norm: a region the loaders set to 1.0 holds other values"):
        model = Filling()
        model.load_weights(checkpoint(0).items())
        verify_checkpoint(model, [checkpoint(0)])


def test_another_write_into_a_parameter_is_refused() -> None:
    class Adding(StackedLayer):
        def load_weights(self, weights):
            self.norm.data.add_(1.0)
            return super().load_weights(weights)

    with pytest.raises(PlanRefused, match="writes norm with aten.add_"):
        record(Adding(), checkpoint(0))


def test_a_version_of_another_layout_does_not_match() -> None:
    model = StackedLayer()
    model.load_weights(checkpoint(0).items())
    plan = verify_checkpoint(model, [checkpoint(0)])
    other = checkpoint(1)
    other["q"] = other["q"].t().contiguous().t()  # same values, transposed strides
    assert not plan.matches(other)
    assert not plan.matches({k: v for k, v in checkpoint(1).items() if k != "norm"})
    assert not plan.matches({k: v.double() for k, v in checkpoint(1).items()})
    replanned = record(model, other)  # what the worker does then: record this layout's steps
    apply(replanned.bind(other))
    assert torch.equal(model.qkv[:H], other["q"])


def test_checkpoint_in_several_files_merges_into_one_plan() -> None:
    model = StackedLayer()
    ckpt = checkpoint(0)
    model.load_weights(ckpt.items())
    names = list(ckpt)
    plan = verify_checkpoint(model, [{n: ckpt[n] for n in names[:5]}, {n: ckpt[n] for n in names[5:]}])
    apply(plan.bind(checkpoint(2)))
    reference = StackedLayer()
    reference.load_weights(checkpoint(2).items())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_pairs_of_other_dtypes_or_strides_go_in_groups_of_their_own() -> None:
    model = StackedLayer()
    model.load_weights(checkpoint(0).items())
    plan = verify_checkpoint(model, [checkpoint(0)])
    version = checkpoint(4)
    version["norm"] = version["norm"].double()  # a source of another dtype (converted by the copy)
    version["q"] = version["q"].t().contiguous().t()  # and a strided one
    plan = record(model, version)
    bound = plan.bind(version)
    assert sorted(len(d) for d, _ in bound) == [1, 1, len(plan.steps) - 2]
    apply(bound)
    reference = StackedLayer()
    reference.load_weights(version.items())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
