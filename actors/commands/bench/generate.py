"""``async-rl bench generate``: engine throughput side by side, the same model, prompts, lengths and sampling.

Engines, each in a process of its own (one after the other, so each has the GPU to itself):

* ``torch``: the project's torch engine (Hugging Face eager decoding with a static KV cache);
* ``vllm``: the project's vLLM engine as a generator runs it (logprobs of every token, per-token versions,
  routes as ``vllm.routes=auto`` resolves them: vLLM's native routed experts on CUDA);
* ``vllm-noroutes``: the same with routes off;
* ``vllm-per-step``: the project's engine with vLLM's own scheduler, which sends every running request its logprobs
  and routes with every step (the project's holds them until a request's last output:
  :mod:`actors.generator.vllm_scheduler`);
* ``vllm-raw``: plain ``vllm.LLM.generate`` on the same model directory (no logprobs, no routes).

With ``--profile`` the ``vllm-raw`` engine runs in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's
engine core and model runner beside the benchmark, so that ``torch.profiler`` sees their kernels and host time) and
generates the batch once more under the profiler: its result gets ``in_process`` and ``profile`` (the GPU's busy
share, kernel time by kind, the top kernels and ops: :mod:`actors.commands.bench.step_profile`). A busy share well
under 1 means vLLM's host side paces decoding; a fused-MoE kernel on top means the kernel (vLLM has no tuned
configuration for the presets' expert shapes).

Every prompt is ``--prompt-tokens`` random ids of the model's vocabulary (seeded; special tokens left out) and
every sample decodes exactly ``--new-tokens`` tokens at temperature 1 (end-of-sequence ignored, no per-request
seed: vLLM samples seeded requests on a slower path), so each engine
does the same work. One small batch warms each engine up first (vLLM compiles its fused-MoE kernel on the first
batch); the timed call is one batch of all prompts. ``tokens_per_s`` counts generated tokens per second per GPU.

    async-rl bench generate --json docs/benchmarks/generate-h100-moe-1.6b.json --model moe-1.6b

Summary: ``bench`` ("generate"), ``machine``, the workload, ``results`` (one per engine: ``engine``,
``tokens_per_s``, ``wall_s``, ``tokens``, ``startup_s``) and ``ratios`` (``vllm_vs_torch``, ``vllm_vs_raw``,
``vllm_noroutes_vs_raw``, ``vllm_vs_per_step``: those of the engines run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from async_rl.entry import first_sentence

ENGINES = ("torch", "vllm", "vllm-noroutes", "vllm-per-step", "vllm-raw")
WARMUP_PROMPTS = 8
WARMUP_TOKENS = 16
RESULT_PREFIX = "BENCH-GENERATE-RESULT "
"""The line a child process prints its result on (its other output is the engine's log)."""


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--model", default="moe-1.6b", help="a preset (async_rl/model/presets.py) or a HF model directory")
    p.add_argument("--engines", default="torch,vllm,vllm-raw", help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--device", default="cuda", help="the torch engine's device (vLLM takes the first visible GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="both vLLM variants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="",
                   help="write a preset's weights here once and reuse them (as the generators' vllm.work_dir: "
                        "scripts/gpu/vllm.sh gives the node's /root/arl-presets); default: a temporary directory")
    p.add_argument("--profile", action="store_true",
                   help="vllm-raw in one process, its batch generated once more under torch.profiler (module doc)")
    p.add_argument("--one", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    bad = sorted(set(engines) - set(ENGINES))
    if bad or not engines:
        p.error(f"--engines must name some of {', '.join(ENGINES)}, got {args.engines!r}")
    if min(args.prompts, args.prompt_tokens, args.new_tokens) < 1:
        p.error("--prompts, --prompt-tokens and --new-tokens must be >= 1")
    if args.profile and "vllm-raw" not in engines:
        p.error("--profile profiles the vllm-raw engine: name it in --engines")
    args.engine_list = engines
    return args


def _prompts(model_dir: Path, args: argparse.Namespace) -> list[Any]:
    import numpy as np

    from async_rl.model.presets import load_model_config
    from async_rl.model.token_mask import masked_token_ids

    cfg = load_model_config(model_dir)
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    banned = set(masked_token_ids(str(model_dir))) | {int(e) for e in eos if e is not None}
    allowed = np.array([i for i in range(cfg.vocab_size) if i not in banned], dtype=np.int32)
    rng = np.random.default_rng(args.seed)
    return [allowed[rng.integers(0, allowed.size, args.prompt_tokens)] for _ in range(args.prompts)]


def _max_len(args: argparse.Namespace) -> int:
    return args.prompt_tokens + args.new_tokens + 8


async def _run_project_engine(engine_name: str, model_dir: Path, args: argparse.Namespace,
                              prompts: list[Any]) -> tuple[float, int, float]:  # fmt: skip
    from actors.generator.config import TorchEngineConfig, VLLMEngineConfig
    from actors.generator.engine import SamplingParams
    from async_rl.model.config import ModelConfig

    model = ModelConfig(name=str(model_dir), dtype="bfloat16")
    t0 = time.perf_counter()
    engine: Any
    if engine_name == "torch":
        from actors.generator.torch_engine import TorchEngine

        engine = TorchEngine(TorchEngineConfig(model=model, device=args.device, max_batch_prompts=len(prompts),
                                               max_batch_sequences=len(prompts), stop_on_eos=False, num_threads=0))
    else:
        from actors.generator.vllm_engine import VLLMEngine

        engine = VLLMEngine(VLLMEngineConfig(
            model=model, max_batch_prompts=len(prompts), max_num_seqs=len(prompts), max_model_len=_max_len(args),
            gpu_memory_utilization=args.gpu_memory_utilization, stop_on_eos=False, seed=args.seed,
            routes="off" if engine_name == "vllm-noroutes" else "auto",
            # vLLM's own scheduler: no step labels of the project's, so swaps (none here) would have to pause
            swap="pause" if engine_name == "vllm-per-step" else "boundary",
            engine_args={"scheduler_cls": None} if engine_name == "vllm-per-step" else {}))  # fmt: skip
    startup_s = time.perf_counter() - t0
    try:
        warm = SamplingParams(max_new_tokens=WARMUP_TOKENS, mask_special_tokens=False)
        await engine.generate(prompts[:WARMUP_PROMPTS], warm)
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, mask_special_tokens=False)
        t1 = time.perf_counter()
        out = await engine.generate(prompts, params)
        wall_s = time.perf_counter() - t1
    finally:
        await engine.close()
    return wall_s, sum(int(c.token_ids.size) for group in out for c in group), startup_s


def _run_raw(model_dir: Path, args: argparse.Namespace,
             prompts: list[Any]) -> tuple[float, int, float, dict[str, Any] | None]:  # fmt: skip
    """Wall seconds, tokens and start-up seconds of the timed batch, and its profile with ``--profile``."""
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=args.seed,
              max_num_seqs=len(prompts), max_model_len=_max_len(args),
              gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    startup_s = time.perf_counter() - t0
    requests = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]
    warm = VSamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, detokenize=False)
    llm.generate(requests[:WARMUP_PROMPTS], warm, use_tqdm=False)
    params = VSamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, detokenize=False)
    t1 = time.perf_counter()
    out = llm.generate(requests, params, use_tqdm=False)
    wall_s = time.perf_counter() - t1
    profiled = None
    if args.profile:
        from actors.commands.bench.step_profile import profile_step

        profiled = profile_step(lambda: llm.generate(requests, params, use_tqdm=False))
    return wall_s, sum(len(o.outputs[0].token_ids) for o in out), startup_s, profiled


def _child(args: argparse.Namespace) -> int:
    model_dir = Path(args.model_dir)
    prompts = _prompts(model_dir, args)
    profiled = None
    if args.one == "vllm-raw":
        wall_s, tokens, startup_s, profiled = _run_raw(model_dir, args, prompts)
    else:
        wall_s, tokens, startup_s = asyncio.run(_run_project_engine(args.one, model_dir, args, prompts))
    expected = args.prompts * args.new_tokens
    result = {"engine": args.one, "tokens_per_s": round(tokens / wall_s, 1), "wall_s": round(wall_s, 3),
              "tokens": tokens, "expected_tokens": expected, "startup_s": round(startup_s, 1)}  # fmt: skip
    if profiled is not None:
        result.update(in_process=True, profile=profiled)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if tokens == expected else 1


def _model_dir(model: str, work_dir: str) -> Path:
    """The HF directory of ``model``: a preset written in bfloat16 (seed 0) into ``work_dir`` as a generator writes it
    (``vllm_args.model_dir``: once, then reused by any run given the same directory), or the directory given."""
    from actors.generator.config import VLLMEngineConfig
    from actors.generator.vllm_args import model_dir
    from async_rl.model.config import ModelConfig

    path, _ = model_dir(VLLMEngineConfig(model=ModelConfig(name=model, dtype="bfloat16"), work_dir=work_dir))
    return path


def _run_child(cmd: list[str], env: dict[str, str]) -> tuple[int, list[str], list[str]]:
    """Run one engine's child: its exit status, its result lines and the last lines of its log. The log goes on to
    this process's stderr as it comes, so that a benchmark stopped midway (a time limit) shows how far each got."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    results: list[str] = []
    tail: collections.deque[str] = collections.deque(maxlen=15)
    for line in proc.stdout:
        if line.startswith(RESULT_PREFIX):
            results.append(line.rstrip("\n"))
        else:
            tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
    return proc.wait(), results, list(tail)


def main(argv: list[str] | None = None, prog: str = "async-rl bench generate") -> int:
    args = parse_args(argv, prog)
    if args.one:
        return _child(args)
    from actors.commands.bench.report import emit, machine

    results: list[dict[str, Any]] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="arl-bench-generate-") as tmp:
        model_dir = _model_dir(args.model, args.work_dir or tmp)
        for engine in args.engine_list:
            cmd = [sys.executable, "-m", "actors.commands.bench.generate", "--one", engine, "--model-dir",
                   str(model_dir), "--prompts", str(args.prompts), "--prompt-tokens", str(args.prompt_tokens),
                   "--new-tokens", str(args.new_tokens), "--device", args.device, "--seed", str(args.seed),
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization)]  # fmt: skip
            env = dict(os.environ)
            if args.profile and engine == "vllm-raw":
                cmd.append("--profile")
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            print(f"bench generate: {engine} ...", file=sys.stderr, flush=True)
            rc, lines, tail = _run_child(cmd, env)
            if rc != 0 or not lines:
                failures.append(f"{engine}: exit {rc}: " + " | ".join(tail))
                print(f"bench generate: {engine} failed (exit {rc}):\n" + "\n".join(tail), file=sys.stderr)
            if lines:
                results.append(json.loads(lines[-1][len(RESULT_PREFIX):]))
                r = results[-1]  # said now: a run cut off later (a device call's limit) still tells this engine's rate
                print(f"bench generate: {engine}: {r['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    rate = {r["engine"]: r["tokens_per_s"] for r in results}
    ratios = {}
    if "vllm" in rate and "torch" in rate:
        ratios["vllm_vs_torch"] = round(rate["vllm"] / rate["torch"], 2)
    if "vllm" in rate and "vllm-raw" in rate:
        ratios["vllm_vs_raw"] = round(rate["vllm"] / rate["vllm-raw"], 3)
    if "vllm-noroutes" in rate and "vllm-raw" in rate:
        ratios["vllm_noroutes_vs_raw"] = round(rate["vllm-noroutes"] / rate["vllm-raw"], 3)
    if "vllm" in rate and "vllm-per-step" in rate:
        ratios["vllm_vs_per_step"] = round(rate["vllm"] / rate["vllm-per-step"], 3)
    summary = {"bench": "generate", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(args.device),
               "model": args.model, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
               "new_tokens": args.new_tokens, "temperature": 1.0, "results": results, "ratios": ratios,
               "failures": failures}  # fmt: skip
    emit(summary, args.json)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
