"""Time the vLLM engine's weight swaps while it generates (not a test: run it, in the vLLM venv).

    .venv-vllm/bin/python tests/vllm/swap_bench.py [--swaps 6] [--json PATH]

For two random-init Qwen3-MoE models (the tests' 1.8M-parameter one and a 102M-parameter one, fp32) it starts
an engine, keeps greedy generations running, stages weights B, A, B, ... and records, per swap, the time the
version took to reach the worker (``last_stage_s``, generation going on), the time generation stood still
(``last_swap_pause_s``) and the in-place load within it (``last_load_s``). Any engine version with those
attributes can be timed: put another checkout first on ``PYTHONPATH`` to time it on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from actors.generator.config import VLLMEngineConfig
from actors.generator.engine import SamplingParams
from actors.generator.vllm_engine import VLLMEngine
from async_rl.model.presets import ModelConfig, build_model, save_pretrained_dir, small_moe_config

MODELS = {
    "small-moe 1.8M": {},
    "moe 102M": dict(hidden_size=512, moe_intermediate_size=512, num_hidden_layers=8, num_experts=16),
}
"""Label -> overrides of small_moe_config (the tests' model, and one ~55x bigger: 0.4 GB in fp32)."""


async def _time_swaps(model_dirs: tuple[Path, Path], num_swaps: int) -> dict[str, object]:
    config = VLLMEngineConfig(
        model=ModelConfig(name=str(model_dirs[0])), stop_on_eos=False, max_model_len=256, kv_cache_mib=64
    )
    engine = await asyncio.to_thread(VLLMEngine, config)
    weights = [load_file(str(d / "model.safetensors")) for d in model_dirs]
    prompt = np.array([1, 5, 6, 7, 8, 9], dtype=np.int32)
    busy = SamplingParams(n=4, max_new_tokens=200, temperature=0.0)
    rows: list[tuple[float, float, float]] = []
    try:
        await engine.generate([prompt], SamplingParams(max_new_tokens=4))  # binds the loop, sets up the worker
        for i in range(num_swaps):
            generation = asyncio.create_task(engine.generate([prompt], busy))
            await asyncio.sleep(0.1)
            version = engine.version + 1
            engine.stage_weights(weights[(i + 1) % 2], version)
            if not await engine.wait_applied(version, 120.0):
                raise RuntimeError(f"version {version} not applied: {engine.last_stage_error}")
            rows.append((engine.last_stage_s, engine.last_swap_pause_s, engine.last_load_s))
            await generation
    finally:
        await engine.close()
    nbytes = sum(t.numel() * t.element_size() for t in weights[0].values())
    out: dict[str, object] = {"weight_bytes": nbytes, "swaps": len(rows)}
    for j, key in enumerate(("stage_ms", "pause_ms", "load_ms")):
        values = [r[j] * 1e3 for r in rows[1:]]  # the first swap also warms up the worker's reload path
        out[key] = {
            "median": round(statistics.median(values), 1),
            "min": round(min(values), 1),
            "max": round(max(values), 1),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swaps", type=int, default=6, help="swaps per model (the first is not counted)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="arl-swap-bench-") as tmp:
        for label, overrides in MODELS.items():
            cfg = small_moe_config(**overrides)
            dirs = tuple(save_pretrained_dir(Path(tmp) / f"{label}-{s}", build_model(cfg, seed=s)) for s in (0, 1))
            t0 = time.perf_counter()
            results[label] = asyncio.run(_time_swaps(dirs, args.swaps))  # type: ignore[arg-type]
            print(f"{label}: {json.dumps(results[label])} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
