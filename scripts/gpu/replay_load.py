"""Time the replayed in-place load (actors/generator/vllm_load_plan.py) on a GPU at the moe-1.6b shapes, without
vLLM: parameters laid out as vLLM's Qwen3-MoE holds them (stacked q/k/v, experts in ``w13 [E, 2I, H]`` /
``w2 [E, H, I]``), loaded by loaders that slice and copy as vLLM's do, from one flat bf16 buffer in checkpoint
order (what the learner publishes), with the embedding published in float32 (one pair of other dtypes). Three
ways: the plan's groups (``load_s``), every pair in one ``_foreach_copy_`` call (``load_s_one_call``: the
float32 pair sends the call to its slow path), and the experts of a layer merged into strided copies
(``load_s_strided``: one copy per layer and kind).

    python3 scripts/gpu/replay_load.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from actors.generator.vllm_load_plan import apply, describe, record, verify_checkpoint

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


def timed(bound: list[tuple[list[torch.Tensor], list[torch.Tensor]]], repeats: int = 10) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    apply(bound)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        apply(bound)
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description="Time the replayed in-place load at the moe-1.6b shapes on a GPU.")
    p.add_argument("--json", required=True, help="where the summary goes")
    p.add_argument("--device", default="cuda", help="cuda (what it is for) or cpu (to try it)")
    p.add_argument("--small", action="store_true", help="tiny shapes (to try it)")
    args = p.parse_args()
    device = args.device
    if args.small:
        global LAYERS, E, H, FFN, Q, KV
        LAYERS, E, H, FFN, Q, KV = 2, 4, 16, 8, 16, 4
    model = Layers(device)
    first = bucket(device, 0)
    model.load_weights(first.items())
    plan = verify_checkpoint(model, [first])
    version = bucket(device, 1)
    version["emb"] = version["emb"].float()
    plan = record(model, version)
    grouped = plan.bind(version)
    pairs = [plan.view(s, version) for s in plan.steps]
    one_call = [([d for d, _ in pairs], [v for _, v in pairs])]
    strided = []  # per layer: q, k, v as they are; gate, up, down of all experts as one strided copy each
    for layer in range(LAYERS):
        w13, w2 = model.w13[layer].data, model.w2[layer].data
        first = version[f"l.{layer}.x.0.gate"]
        step = 3 * FFN * H  # gate, up, down of one expert, then the next expert's
        flat = first.as_strided((E, FFN, H), (step, H, 1))
        strided.append(([w13[:, :FFN]], [flat]))
        strided.append(
            ([w13[:, FFN:]], [first.as_strided((E, FFN, H), (step, H, 1), first.storage_offset() + FFN * H)])
        )
        strided.append(([w2], [first.as_strided((E, H, FFN), (step, FFN, 1), first.storage_offset() + 2 * FFN * H)]))
    t_grouped, t_one, t_strided = timed(grouped), timed(one_call), timed(strided)
    apply(grouped)
    reference = Layers(device)
    reference.load_weights(version.items())
    exact = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    out = {"bench": "replay_load", "machine": f"{torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}; {platform.platform()}",
           "bytes": plan.num_bytes(), "steps": len(plan.steps), "groups": describe(grouped),
           "load_s": t_grouped, "load_s_one_call": t_one, "load_s_strided_experts_only": t_strided,
           "exact": exact}  # fmt: skip
    print(json.dumps(out, indent=1))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
