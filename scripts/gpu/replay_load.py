"""Time the replayed in-place load (actors/generator/vllm_load_plan.py) on a GPU at the moe-1.6b shapes, merged
against unmerged, without vLLM: parameters laid out as vLLM's Qwen3-MoE holds them (stacked q/k/v, experts in
``w13 [E, 2I, H]`` / ``w2 [E, H, I]``), loaded by loaders that slice and copy as vLLM's do, from one flat bucket per
layer in checkpoint order (what the learner publishes).

    python3 scripts/gpu/replay_load.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from actors.generator.vllm_load_plan import apply, verify_checkpoint

LAYERS, E, H, FFN, Q, KV, VOCAB = 16, 64, 1024, 512, 1024, 256, 32  # moe-1.6b (its char vocabulary)


class Layers(torch.nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        kw = dict(device=device, dtype=torch.bfloat16)
        self.qkv = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(Q + 2 * KV, H, **kw)) for _ in range(LAYERS)])
        self.w13 = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(E, 2 * FFN, H, **kw)) for _ in range(LAYERS)])
        self.w2 = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(E, H, FFN, **kw)) for _ in range(LAYERS)])
        self.emb = torch.nn.Parameter(torch.empty(VOCAB, H, **kw))
        for p in self.parameters():
            p.requires_grad_(False)

    def load_weights(self, weights) -> None:  # type: ignore[no-untyped-def]
        for name, w in weights:
            parts = name.split(".")
            if parts[0] == "emb":
                self.emb.data.copy_(w)
                continue
            layer = int(parts[1])
            if parts[2] in ("q", "k", "v"):
                start, n = {"q": (0, Q), "k": (Q, KV), "v": (Q + KV, KV)}[parts[2]]
                self.qkv[layer].data.narrow(0, start, n).copy_(w)
            else:
                e, which = int(parts[3]), parts[4]
                if which == "down":
                    self.w2[layer].data[e].copy_(w)
                else:
                    self.w13[layer].data[e].narrow(0, 0 if which == "gate" else FFN, FFN).copy_(w)


def shapes() -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"emb": (VOCAB, H)}
    for layer in range(LAYERS):
        out.update({f"l.{layer}.q": (Q, H), f"l.{layer}.k": (KV, H), f"l.{layer}.v": (KV, H)})
        for e in range(E):
            out.update({f"l.{layer}.x.{e}.gate": (FFN, H), f"l.{layer}.x.{e}.up": (FFN, H),
                        f"l.{layer}.x.{e}.down": (H, FFN)})  # fmt: skip
    return out


def bucket(device: str, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor a view of one flat bf16 buffer, in checkpoint order."""
    sizes = shapes()
    total = sum(torch.Size(s).numel() for s in sizes.values())
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)
    flat.normal_(generator=torch.Generator(device=device).manual_seed(seed))
    out, at = {}, 0
    for name, s in sizes.items():
        n = torch.Size(s).numel()
        out[name] = flat[at : at + n].view(s)
        at += n
    return out


def timed(bound: tuple[list[torch.Tensor], list[torch.Tensor]], repeats: int = 10) -> float:
    apply(bound)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        apply(bound)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description="Time the replayed in-place load at the moe-1.6b shapes on a GPU.")
    p.add_argument("--json", required=True, help="where the summary goes")
    args = p.parse_args()
    device = "cuda"
    model = Layers(device)
    first = bucket(device, 0)
    model.load_weights(first.items())
    plan = verify_checkpoint(model, [first])
    version = bucket(device, 1)
    merged = plan.bind(version)
    single = ([], [])  # the same copies one by one
    for s in plan.steps:
        src = version[s.source]
        single[0].append(plan.params[s.param].as_strided(*s.dst))
        single[1].append(src.as_strided(s.src_size, s.src_stride, src.storage_offset() + s.src_rel))
    t_single, t_merged = timed(single), timed(merged)
    reference = Layers(device)
    reference.load_weights(version.items())
    exact = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    out = {"bench": "replay_load", "machine": f"{torch.cuda.get_device_name(0)}; {platform.platform()}",
           "bytes": plan.num_bytes(), "steps": len(plan.steps), "copies_merged": len(merged[0]),
           "load_s_single": t_single, "load_s_merged": t_merged, "merged_over_single": t_merged / t_single,
           "exact": exact}  # fmt: skip
    print(json.dumps(out, indent=1))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
