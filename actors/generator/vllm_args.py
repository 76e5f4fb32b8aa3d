"""vLLM's ``AsyncEngineArgs`` for a :class:`~actors.generator.config.VLLMEngineConfig`, and what they imply.

Decided here, before any vLLM process starts, so that a bad combination fails at once with the field named:

* **Routes**: ``auto`` is ``native`` (vLLM's routed-experts output, Model Runner V2) on CUDA, ``hooks`` (the
  worker extension's capture, eager only) elsewhere, ``off`` for dense models; ``native`` is refused on CPU.
* **Prefix caching**: on unless routes are captured by hooks, which cannot see positions served from the cache.
* **CPU**: eager by default, a head size vLLM's CPU attention has a kernel for, an explicit KV-cache size
  (vLLM's own CPU sizing reserves most of the node's memory).
* Always: ``processed_logprobs`` (logprobs of the distribution sampled from), our worker extension, our scheduler
  (:mod:`.vllm_scheduler`: a request's logprobs and routes sent once, with its last output, not with every step's),
  and any ``engine_args`` passed through, their names checked against ``AsyncEngineArgs`` (``scheduler_cls``
  among them replaces ours).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.generator.config import VLLMEngineConfig
from actors.generator.model_facts import ModelFacts
from actors.generator.vllm_scheduler import SCHEDULER_CLS
from async_rl.model.presets import is_preset, save_pretrained_dir, shared_preset_dir

WORKER_EXTENSION = "actors.generator.vllm_worker.ArlWorkerExtension"
"""Qualified name of the worker extension vLLM mixes into its worker."""
DEFAULT_CPU_KV_CACHE_MIB = 1024
"""KV cache on CPU when none is configured: vLLM's own CPU sizing reserves 92% of the node's memory."""


def model_dir(config: VLLMEngineConfig) -> tuple[Path, Path | None]:
    """The Hugging Face directory vLLM loads, and the temporary directory to remove at close (None: nothing to
    remove). A preset is written once into ``work_dir``, shared by whichever generator comes first, else into a
    temporary directory of this engine's own."""
    m = config.model
    if not is_preset(m.name):
        return Path(m.name), None
    if config.work_dir:
        return shared_preset_dir(Path(config.work_dir) / f"{m.name}-seed{m.seed}-{m.dtype}", preset=m.name,
                                 seed=m.seed, dtype=m.dtype), None  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="arl-vllm-"))
    try:
        return save_pretrained_dir(tmp / m.name, preset=m.name, seed=m.seed, dtype=m.dtype), tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True, slots=True)
class VLLMArgs:
    """The engine arguments and the choices behind them."""

    engine_args: Any
    """vLLM's ``AsyncEngineArgs``."""
    route_mode: str
    """'native', 'hooks' or 'off' (resolved from config.routes)."""
    prefix_caching: bool
    max_model_len: int


def build_vllm_args(config: VLLMEngineConfig, facts: ModelFacts) -> VLLMArgs:
    """The arguments to start vLLM with; ``ValueError`` naming the field for a combination that cannot work."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    if on_cpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if facts.head_dim not in sizes:
            raise ValueError(
                f"engine.model {config.model.name!r} has head_dim {facts.head_dim}; vLLM's CPU attention supports {sizes}"
            )
    eager = on_cpu if config.enforce_eager is None else config.enforce_eager
    mode = config.routes
    if not facts.moe_layer_ids:
        mode = "off"
    elif mode == "auto":
        mode = "native" if current_platform.is_cuda_alike() else "hooks"
    if mode == "native" and on_cpu:
        raise ValueError("engine.routes 'native' needs vLLM's Model Runner V2 (CUDA); use 'hooks' on CPU")
    if mode == "hooks" and not eager:
        raise ValueError("engine.routes 'hooks' needs engine.enforce_eager (compiled graphs skip Python hooks)")
    prefix_caching = (mode != "hooks") if config.enable_prefix_caching is None else config.enable_prefix_caching
    if mode == "hooks" and prefix_caching:
        raise ValueError("vllm.enable_prefix_caching must be off with routes 'hooks' (cached tokens are not run)")
    max_model_len = config.max_model_len or facts.max_positions or 4096
    kv_mib = config.kv_cache_mib or (DEFAULT_CPU_KV_CACHE_MIB if on_cpu else 0)
    kwargs: dict[str, Any] = dict(
        model=str(facts.directory),
        tokenizer=str(facts.directory),
        dtype=config.model.dtype,
        seed=config.seed,
        enforce_eager=eager,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_prefix_caching=prefix_caching,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        scheduler_cls=SCHEDULER_CLS,
        disable_log_stats=True,
    )
    if kv_mib:
        kwargs["kv_cache_memory_bytes"] = kv_mib << 20
    if config.follow == "core":  # the worker in the engine core's process, where the follower runs (vllm_follow.py)
        kwargs["distributed_executor_backend"] = "uni"
    if mode == "native":
        kwargs["enable_return_routed_experts"] = True
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(config.engine_args) - known)
    if unknown:
        raise ValueError(f"vllm.engine_args has fields vLLM's AsyncEngineArgs does not know: {unknown}")
    kwargs.update(config.engine_args)
    return VLLMArgs(
        engine_args=AsyncEngineArgs(**kwargs),
        route_mode=mode,
        prefix_caching=prefix_caching,
        max_model_len=max_model_len,
    )
