"""Training-inference mismatch on one GPU: each engine's logprob of every sampled token against each learner's.

The same weights (a preset written once as a Hugging Face directory) everywhere. Each engine samples the same
prompts (temperature 1, the run's token mask on); each learner backend then recomputes the logprob of every
sampled token on exactly those tokens, with the engine's recorded routes replayed (R3) and without. Reported per
(engine, learner, replay): mean, p99 and max of |Δ logprob|, the KL of the engine's policy to the learner's
estimated on the engine's samples (k1 = mean(log μ - log π), k3 = mean(r - 1 - log r) with r = π/μ), and the
truncated-IS weights those ratios give (mean r, p99, and the share past SkyRL's token clip 2 and under 0.5).

    PYTHONPATH=. python3 scripts/gpu/mismatch.py --json out.json --model moe-107m

Engines: ``vllm`` (the project's vLLM engine, bf16, native routes), ``vllm-fp32`` (the same in float32: the floor
when both sides compute in fp32), ``torch`` (the project's torch engine, bf16). Learners: ``torch`` (bf16 and fp32)
and ``megatron`` (bf16; skipped where megatron-core is missing).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROMPT_TOKENS = 16


def _prompts(model_dir: Path, num: int, seed: int) -> list[np.ndarray]:
    from async_rl.model.presets import load_model_config
    from async_rl.model.token_mask import masked_token_ids

    cfg = load_model_config(model_dir)
    banned = set(masked_token_ids(str(model_dir))) | {int(cfg.eos_token_id)}
    allowed = np.array([i for i in range(cfg.vocab_size) if i not in banned], dtype=np.int32)
    rng = np.random.default_rng(seed)
    return [allowed[rng.integers(0, allowed.size, PROMPT_TOKENS)] for _ in range(num)]


async def _sample(engine_name: str, model_dir: Path, prompts: list[np.ndarray], args: argparse.Namespace) -> list[Any]:
    from actors.generator.config import TorchEngineConfig, VLLMEngineConfig
    from actors.generator.engine import SamplingParams
    from async_rl.model.config import ModelConfig

    dtype = "float32" if engine_name == "vllm-fp32" else "bfloat16"
    model = ModelConfig(name=str(model_dir), dtype=dtype)
    engine: Any
    if engine_name == "torch":
        from actors.generator.torch_engine import TorchEngine

        engine = TorchEngine(TorchEngineConfig(model=model, device=args.device, stop_on_eos=False, num_threads=0))
    else:
        from actors.generator.vllm_engine import VLLMEngine

        engine = VLLMEngine(VLLMEngineConfig(model=model, stop_on_eos=False, gpu_memory_utilization=0.5, enforce_eager=True,
                                             max_model_len=PROMPT_TOKENS + args.new_tokens + 8))  # fmt: skip
    try:
        out = await engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=args.new_tokens,
                                                            temperature=1.0, seed=args.seed))  # fmt: skip
    finally:
        await engine.close()
    return [(p, c) for p, cs in zip(prompts, out, strict=True) for c in cs]


def _train_samples(pairs: list[Any]) -> list[Any]:
    from async_rl.algorithms.batch import TrainSample

    return [TrainSample(input_ids=np.concatenate([p, c.token_ids]).astype(np.int32), prompt_len=int(p.size),
                        behaviour_logprobs=c.logprobs.astype(np.float32),
                        versions=np.zeros(c.token_ids.size, dtype=np.int32),
                        advantages=np.zeros(c.token_ids.size, dtype=np.float32), routes=c.routes)
            for p, c in pairs]  # fmt: skip


def _stats(learner_lp: torch.Tensor, mb: Any) -> dict[str, float]:
    m = mb.loss_mask
    pi, mu = learner_lp[m].double(), mb.behaviour_logprobs[m].double()
    d = (pi - mu).abs()
    log_r = pi - mu
    r = log_r.exp()
    q = torch.tensor([0.99], dtype=torch.float64)
    return {
        "tokens": int(m.sum()),
        "mean_abs_diff": round(float(d.mean()), 6), "p99_abs_diff": round(float(torch.quantile(d, q)), 6),
        "max_abs_diff": round(float(d.max()), 6),
        "kl_k1": round(float((mu - pi).mean()), 7), "kl_k3": round(float((r - 1 - log_r).mean()), 7),
        "tis_mean": round(float(r.mean()), 5), "tis_p99": round(float(torch.quantile(r, q)), 5),
        "tis_frac_over_2": round(float((r > 2).double().mean()), 6),
        "tis_frac_under_0_5": round(float((r < 0.5).double().mean()), 6),
    }  # fmt: skip


def _learners(model_dir: Path, device: str) -> list[tuple[str, str, Any]]:
    from actors.learner.config import TorchBackendConfig
    from actors.learner.torch_backend import TorchBackend
    from async_rl.model.presets import load_model
    from async_rl.model.token_mask import masked_token_ids

    masked = tuple(masked_token_ids(str(model_dir)))
    hf = load_model(model_dir, dtype="float32")
    out: list[tuple[str, str, Any]] = []
    for dtype in ("bfloat16", "float32"):
        out.append(("torch", dtype, lambda dtype=dtype: TorchBackend(
            copy.deepcopy(hf), TorchBackendConfig(dtype=dtype, device=device, masked_token_ids=masked))))  # fmt: skip
    if device != "cuda":
        return out
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return out

    def megatron() -> Any:
        from actors.learner.megatron.backend import MegatronBackend
        from actors.learner.megatron.config import MegatronConfig

        sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
        return MegatronBackend(MegatronConfig(dtype="bfloat16", recompute=False, masked_token_ids=masked), hf.config, sd)

    out.append(("megatron", "bfloat16", megatron))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--model", default="moe-107m")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--engines", default="vllm,vllm-fp32,torch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="the torch engine's and learners' (vLLM takes the first GPU)")
    args = p.parse_args(argv)
    from actors.commands.bench.report import machine
    from actors.learner.batching import collate
    from async_rl.model.presets import is_preset, save_pretrained_dir

    torch.backends.cuda.matmul.allow_tf32 = False
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="arl-mismatch-") as tmp:
        model_dir = Path(args.model)
        if is_preset(args.model):
            model_dir = Path(tmp) / args.model
            save_pretrained_dir(model_dir, preset=args.model, seed=0, dtype="bfloat16")
        prompts = _prompts(model_dir, args.prompts, args.seed)
        batches = {}
        for engine in [e for e in args.engines.split(",") if e]:
            pairs = asyncio.run(_sample(engine, model_dir, prompts, args))
            batches[engine] = collate(_train_samples(pairs), step_num_tokens=1, step_num_sequences=1)
            print(f"mismatch: {engine} sampled {int(batches[engine].loss_mask.sum())} tokens", file=sys.stderr)
        for learner, dtype, build in _learners(model_dir, args.device):
            backend = build()
            for engine, mb in batches.items():
                for replay in (True, False):
                    if replay and all(r is None for r in mb.routes):
                        continue
                    lp = backend.forward_logprobs(mb, replay_routes=replay).logprobs
                    row = {"engine": engine, "learner": learner, "learner_dtype": dtype, "replay": replay,
                           **_stats(lp.float().cpu(), mb)}  # fmt: skip
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr)
            backend.close()
            del backend
            torch.cuda.empty_cache()
    summary = {"bench": "mismatch", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(args.device),
               "model": args.model, "prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens,
               "temperature": 1.0, "results": results}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
