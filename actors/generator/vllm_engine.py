"""The vLLM inference engine: vLLM's ``AsyncLLM`` behind the :class:`~actors.generator.engine.Engine` interface.

* **Sampling.** Each of the ``n`` samples of a prompt is one vLLM request (``n=1``) with its own id (routes are
  fetched by it) and, with ``SamplingParams.seed``, its own seed (``seed + j``, prompt-major). Logprobs are
  ``processed_logprobs``: from the distribution each token was sampled from (greedy: the plain model logprob).
* **Versions.** Every engine step is labelled with a weight version and each request gets its spans back: vLLM's
  own labels (0.27+), the engine's (:mod:`.vllm_compat`) or the scheduler's (:mod:`.vllm_step_labels`). They
  become the per-token ``versions``: each token carries the version of the weights that produced it.
* **Weights.** :meth:`VLLMEngine.stage_weights` (any thread) checks names and shapes (:mod:`.vllm_weights`) and
  hands the version to a background task, which copies it into an anonymous memory file the worker maps while
  generation goes on (:mod:`.weight_handover`). A GPU-held version on the learner's host is copied GPU to GPU by
  the workers themselves (:meth:`VLLMEngine.gpu_copier`, ``arl_copy_ipc``), checked against the signed manifest,
  then :meth:`VLLMEngine.stage_copied`. The version is loaded in place (a replay of vLLM's loaders as batched copies
  where proven exact, else vLLM's reload; :mod:`.vllm_load_plan`) as ``vllm.swap`` says (:mod:`.vllm_swap`), or by
  the engine core following versions itself (``vllm.follow="core"``, :mod:`.vllm_follow`). No file is written.
  New requests carry the version in their prefix-cache salt: no prompt reuses KV of older weights.
* **Prefix cache across turns.** An episode's next turn is a new request whose prompt is the whole context so far:
  vLLM finds the previous turns' KV under the same salt (prefix caching is on unless routes are captured by hooks).
  :attr:`VLLMEngine.prompt_tokens` and :attr:`VLLMEngine.cached_prompt_tokens` count what was asked and served.
* **Routes** (MoE). vLLM's own routed-experts output where it works (CUDA: ``routes="native"``); on CPU the worker
  extension (:mod:`actors.generator.vllm_worker`) captures them in eager mode (``routes="hooks"``). A sample's
  routes are ``[T_run, moe_layers, top_k]`` (uint8, int16 past 256 experts), typically ``len(prompt) +
  len(response) - 1`` rows.

``VLLMEngine(config)`` starts vLLM's processes (about 30 s on a CPU); the rest runs on its first async call's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.generator.config import VLLMEngineConfig
from actors.generator.engine import Completion, Engine, SamplingParams
from actors.generator.model_facts import ModelFacts, read_model_facts
from actors.generator.vllm_args import build_vllm_args, model_dir
from actors.generator.vllm_compat import EngineLabels, FrontLabels, prepare_engine_processes, version_labels
from actors.generator.vllm_outputs import completion, trim_routes
from actors.generator.vllm_requests import check_prompts, request_params
from actors.generator.vllm_step_labels import CoreSpans
from actors.generator.vllm_swap import SWAPS
from actors.generator.vllm_weights import CheckpointWeights
from actors.generator.vllm_worker_copies import copies_agree, describe_copy
from actors.generator.weight_handover import pack_weights
from async_rl.model.token_mask import MASKED_LOGIT, masked_token_ids
from async_rl.weights.gpu.reader import RemoteCopied, RemoteCopy
from async_rl.weights.manifest import Manifest
from async_rl.weights.reader import CopyFailed

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 5.0
"""How often vLLM's statistics are logged, where they are on (vLLM's own server logs them as often)."""


class VLLMEngine(Engine):
    """vLLM's AsyncLLM with logprobs, per-token versions, routes and in-place weight swaps (see the module docstring)."""

    name = "vllm"
    config: VLLMEngineConfig
    facts: ModelFacts
    route_mode: str
    """'native', 'hooks' or 'off' (resolved from config.routes)."""
    prefix_caching: bool
    max_model_len: int
    log_stats: bool
    """vLLM's statistics are logged every ``STATS_INTERVAL_S`` (``vllm.engine_args.disable_log_stats=false``)."""
    last_swap_pause_s: float
    """Time generation stood still for the last swap: the engine core paused (after its steps in flight) to resumed."""
    last_stage_s: float
    """Time the last version took to reach the worker (generation kept going)."""
    last_load_s: float
    """Part of the last pause spent loading in place inside the worker."""
    last_stage_error: str | None
    """Why the last staged version could not be applied (None when it was)."""
    swap_load: str
    """How versions load in place: 'replay' (:mod:`.vllm_load_plan`) or 'reload: <why>' (vLLM's layerwise reload)."""
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens of every request so far, and those of them the prefix cache served."""
    _llm: Any
    _tmp_dir: Path | None
    _pending: tuple[Mapping[str, torch.Tensor] | None, int] | None
    """The next version to swap in: its tensors, or None when the workers already hold it (a GPU copy)."""
    _lock: threading.Lock
    _loop: asyncio.AbstractEventLoop | None
    _ready: asyncio.Task | None
    _swapper: asyncio.Task | None
    _wake: asyncio.Event | None
    _applied: asyncio.Event | None
    _slots: asyncio.Lock | None
    """Held by a GPU copy into the workers' staging slots, and by the swap task from taking a version until it is
    loaded: a copy arriving in between would land in that version's slot (a worker keeps two) and drop it."""
    _cleanup: set[asyncio.Task]
    _ids: itertools.count
    _uid: str
    _closed: bool
    _weights: CheckpointWeights
    _swaps: list[tuple[int, float]]
    """(version, unix time) of swaps not yet taken by :meth:`take_swaps`."""
    _pauses: list[float]
    """Pause seconds of swaps not yet taken by :meth:`take_swap_pauses`."""
    _labels: EngineLabels | FrontLabels | None
    """Who labels engine steps with weight versions (:mod:`.vllm_compat`); set up on first use."""
    _core_spans: CoreSpans | None
    """The scheduler's labels (:mod:`.vllm_step_labels`), which ``vllm.swap="boundary"`` takes instead."""
    _logit_bias: dict[int, float]
    """The sampling mask as vLLM logit biases (:mod:`async_rl.model.token_mask`), applied when the prompt asks for it."""

    def __init__(self, config: VLLMEngineConfig) -> None:
        self.config = config
        self._tmp_dir = None
        self._llm = None
        self._version = -1
        self._pending = None
        self._lock = threading.Lock()
        self._loop = None
        self._ready = None
        self._swapper = None
        self._wake = None
        self._applied = None
        self._slots = None
        self._cleanup = set()
        self._ids = itertools.count()
        self._uid = uuid.uuid4().hex[:6]
        self._closed = False
        self.prompt_tokens = self.cached_prompt_tokens = 0
        self._labels = self._core_spans = None
        self._swaps = []
        self._pauses = []
        self.last_swap_pause_s = 0.0
        self.last_stage_s = 0.0
        self.last_load_s = 0.0
        self.last_stage_error = None
        self.swap_load = "reload: not set up yet"
        try:
            directory, self._tmp_dir = model_dir(config)
            self.facts = read_model_facts(directory)
            self._weights = CheckpointWeights(self.facts)
            self._logit_bias = {i: MASKED_LOGIT for i in masked_token_ids(config.model.name)}
            self._start()
        except BaseException:
            self._remove_tmp()
            raise

    # ---------------------------------------------------------------- start-up

    def _start(self) -> None:
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        prepare_engine_processes(current_platform.is_cuda_alike(), worker_in_core=self.config.follow == "core")
        args = build_vllm_args(self.config, self.facts)
        self.route_mode = args.route_mode
        self.prefix_caching = args.prefix_caching
        self.max_model_len = args.max_model_len
        self.log_stats = not args.engine_args.disable_log_stats
        t0 = time.perf_counter()
        self._llm = AsyncLLM.from_engine_args(args.engine_args)
        log.info("vLLM engine up in %.1f s (model %s, routes %s)", time.perf_counter() - t0, self.facts.directory,
                 self.route_mode)  # fmt: skip

    async def _ensure_ready(self) -> None:
        """Bind to the running loop on first use; set up the worker extension and the swap task once."""
        if self._closed:
            raise RuntimeError("engine is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._wake = asyncio.Event()
            self._applied = asyncio.Event()
            self._slots = asyncio.Lock()
            self._ready = loop.create_task(self._setup(), name="vllm-engine-setup")
        elif self._loop is not loop:
            raise RuntimeError("VLLMEngine is bound to the event loop of its first call; use it from that loop only")
        assert self._ready is not None
        await asyncio.shield(self._ready)

    async def ready(self) -> None:
        """Set up the worker extension now (it proves the replayed load: seconds for a large model)."""
        await self._ensure_ready()

    async def _setup(self) -> None:
        facts = self.facts
        self._labels = version_labels(self._llm, self.config.version_labels, str(self._version))
        self._core_spans = CoreSpans(self._llm)
        await self._labels.set(str(self._version))
        infos = await self._llm.collective_rpc(
            "arl_setup",
            args=(self.route_mode == "hooks", facts.num_experts, str(facts.directory), self.config.swap_load),
        )
        loads = {info["load"] for info in infos}
        self.swap_load = loads.pop() if len(loads) == 1 else f"reload: the ranks differ ({sorted(loads)})"
        log.info("vLLM engine: new versions load by %s (checked in %.2f s)", self.swap_load,
                 max(info["load_check_s"] for info in infos))  # fmt: skip
        if self.route_mode == "hooks":
            info = infos[0]
            if info["num_layers"] != len(facts.moe_layer_ids):
                raise RuntimeError(
                    f"vLLM model has {info['num_layers']} fused-MoE layers, config says {len(facts.moe_layer_ids)}"
                )
        assert self._loop is not None and self._wake is not None
        self._swapper = self._loop.create_task(self._swap_loop(), name="vllm-weight-swap")
        if self.log_stats:  # AsyncLLM only gathers them: vLLM's server is what logs them, every few seconds
            stats = self._loop.create_task(self._stats_loop(), name="vllm-stats-log")
            self._cleanup.add(stats)
            stats.add_done_callback(self._cleanup.discard)
        with self._lock:
            if self._pending is not None:
                self._wake.set()

    # ---------------------------------------------------------------- Engine interface

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_batch_prompts(self) -> int:
        return self.config.max_batch_prompts

    @property
    def model_dir(self) -> Path:
        """The HF directory vLLM loaded (a preset is written out first)."""
        return self.facts.directory

    @property
    def num_moe_layers(self) -> int:
        return len(self.facts.moe_layer_ids)

    async def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams) -> list[list[Completion]]:
        out: dict[int, list[Completion]] = {}
        await self.generate_each(prompts, params, out.__setitem__)
        return [out[p] for p in range(len(prompts))]

    async def generate_each(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                            on_done: Callable[[int, list[Completion]], None]) -> None:  # fmt: skip
        """Every sample is a request of its own; a prompt's ``n`` go to ``on_done`` once all of them ended (with their
        routes, in the hooks mode), while the batch's other prompts go on decoding. A failure cancels the rest."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if self._closed:
            raise RuntimeError("engine is closed")
        rows = check_prompts(prompts, self.facts.vocab_size, self.max_model_len)
        await self._ensure_ready()
        call = next(self._ids)
        async with asyncio.TaskGroup() as tg:
            for p, prompt in enumerate(rows):
                tg.create_task(self._prompt(f"arl{self._uid}c{call}p{p}", p, prompt, params, on_done))

    async def _prompt(self, prefix: str, p: int, prompt: np.ndarray, params: SamplingParams,
                      on_done: Callable[[int, list[Completion]], None]) -> None:  # fmt: skip
        """The ``params.n`` samples of prompt ``p`` (sample ``i`` seeded ``seed + p * n + i``, as one call of the
        whole batch numbers them), handed to ``on_done``."""
        ids = [f"{prefix}s{i}" for i in range(params.n)]
        requests = []
        for i, rid in enumerate(ids):
            seed = None if params.seed is None else params.seed + p * params.n + i
            sp = request_params(params, prompt_len=prompt.size, max_model_len=self.max_model_len, seed=seed,
                                stop_on_eos=self.config.stop_on_eos, logit_bias=self._logit_bias)
            requests.append(self._one(rid, prompt, sp))
        try:
            completions = list(await asyncio.gather(*requests))
            routes = await self._take_routes(ids) if self.route_mode == "hooks" else {}
        except BaseException:
            if self.route_mode == "hooks":
                # Forget the routes of requests that were cut short (cancellation: in a tracked background task).
                task = asyncio.get_running_loop().create_task(self._take_routes(ids), name="vllm-route-cleanup")
                self._cleanup.add(task)
                task.add_done_callback(self._cleanup.discard)
            raise
        if self.route_mode == "hooks":
            for rid, comp in zip(ids, completions, strict=True):
                comp.routes = trim_routes(routes.get(rid), self.facts, prompt.size, comp.token_ids.size)
        on_done(p, completions)

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Check names/shapes now (ValueError); ship, pause, load in place and resume in the background.

        Names are the checkpoint's (what ``save_pretrained`` writes, one tensor per expert) or transformers'
        in-memory ``state_dict`` names (fused experts), which are converted here.

        The engine keeps references to ``tensors`` until they reached the worker: do not modify them.
        """
        if self._closed:
            raise RuntimeError("engine is closed")
        if version <= self._version:
            raise ValueError(f"staged version {version} is not newer than the version in use ({self._version})")
        self._set_pending(self._weights.prepare(tensors), version)

    def take_swaps(self) -> list[tuple[int, float]]:
        swaps, self._swaps = self._swaps, []
        return swaps

    def take_swap_pauses(self) -> list[float]:
        pauses, self._pauses = self._pauses, []
        return pauses

    def gpu_copier(self) -> RemoteCopy | None:
        """On CUDA the worker copies a same-host GPU version itself (:meth:`_copy_gpu_version`); None elsewhere."""
        from vllm.platforms import current_platform

        return self._copy_gpu_version if current_platform.is_cuda_alike() else None

    async def _copy_gpu_version(self, manifest: Manifest) -> RemoteCopied:
        """Every worker maps the learner's buffers and copies the version onto its GPU (generation pauses for the
        copy's RPC, a few ms); returns the buckets' wsum64 (every rank's must agree) for the caller to check, and when
        the last rank had read the learner's buffers. A swap under way finishes first: the copy would land in the
        staging slot of the version it loads. A worker's error is :class:`CopyFailed` (the engine goes on with the
        weights it has; a generator's weight sync tries again, then gives the version up); a dead engine's is
        vLLM's own."""
        await self._ensure_ready()
        assert self._slots is not None
        async with self._slots:
            t0 = time.perf_counter()  # the copy's time, not the wait for a swap
            try:
                results = await self._llm.collective_rpc("arl_copy_ipc", args=(manifest.encode(), manifest.version))
            except Exception as exc:
                from vllm.v1.engine.exceptions import EngineDeadError

                if isinstance(exc, EngineDeadError):
                    raise
                raise CopyFailed(f"vLLM's worker could not copy GPU-held weights v{manifest.version}: "
                                 f"{exc}") from exc  # fmt: skip
        copied = copies_agree(results, manifest.version)
        self.last_stage_s = time.perf_counter() - t0
        r = results[0]
        log.info("vLLM engine: version %d %s", manifest.version, describe_copy(self.last_stage_s, r))
        return copied

    async def core_call(self, method: str, *args: Any) -> Any:
        """One of the methods the project gives vLLM's engine core (:func:`.vllm_swap.install`), answered by it."""
        await self._ensure_ready()
        return await self._llm.engine_core.call_utility_async(method, *args)

    def note_core_swaps(self, swaps: list[tuple[int, float]], pauses: list[float]) -> None:
        """Swaps the engine core made by itself (``vllm.follow="core"``): ``(version, unix time)`` and GPU pauses."""
        self._swaps, self._pauses = [*self._swaps, *swaps][-64:], [*self._pauses, *pauses][-64:]
        self.last_swap_pause_s = pauses[-1] if pauses else self.last_swap_pause_s
        newest = max((v for v, _ in swaps), default=self._version)
        if newest > self._version:
            assert self._applied is not None
            self._version, applied, self._applied = newest, self._applied, asyncio.Event()
            applied.set()

    def stage_copied(self, version: int) -> None:
        """Swap in a version the workers copied and the caller verified (:meth:`gpu_copier`)."""
        if self._closed:
            raise RuntimeError("engine is closed")
        if version <= self._version:
            raise ValueError(f"staged version {version} is not newer than the version in use ({self._version})")
        self._set_pending(None, version)

    def _set_pending(self, tensors: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """The version the swap task applies next (None: already staged in the workers); a newer one replaces it."""
        with self._lock:
            self._pending = (tensors, version)
            loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing will apply it anyway
                loop.call_soon_threadsafe(wake.set)

    async def wait_applied(self, version: int, timeout_s: float | None = None) -> bool:
        await self._ensure_ready()

        async def reached() -> None:
            while self._version < version:
                assert self._applied is not None
                await self._applied.wait()

        try:
            await asyncio.wait_for(reached(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.prefix_caching and self.prompt_tokens:
            log.info("prefix cache: %d of %d prompt tokens (%.0f%%) served from it", self.cached_prompt_tokens,
                     self.prompt_tokens, 100 * self.cached_prompt_tokens / self.prompt_tokens)  # fmt: skip
        tasks = [t for t in (self._swapper, self._ready, *self._cleanup) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self._remove_tmp()

    # ---------------------------------------------------------------- generation

    async def _one(self, rid: str, prompt: np.ndarray, sp: Any) -> Completion:
        from vllm.inputs import TokensPrompt

        request = TokensPrompt(prompt_token_ids=prompt.tolist())
        if self.prefix_caching:
            request["cache_salt"] = f"arl-w{self._version}"
        final = None
        assert self._labels is not None and self._core_spans is not None
        labels = self._core_spans if self.config.swap == "boundary" else self._labels
        try:
            async for out in self._llm.generate(request, sp, rid):
                final = out
        except BaseException:
            self._labels.forget(rid)
            self._core_spans.forget(rid)
            raise
        assert final is not None and final.outputs, f"vLLM returned nothing for request {rid}"
        self.prompt_tokens += prompt.size
        self.cached_prompt_tokens += getattr(final, "num_cached_tokens", None) or 0
        c = final.outputs[0]
        native = self.facts if self.route_mode == "native" else None
        await self._labels.settled()  # a swap the engine core is making has placed its change (vllm_swap.py)
        spans = labels.spans(rid, c)
        (self._core_spans if labels is self._labels else self._labels).forget(rid)
        return completion(c, spans, self._version, native, rid)

    async def _stats_loop(self) -> None:
        """vLLM's throughput line (running and waiting requests, tokens/s, KV cache use), when ``log_stats``."""
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            await self._llm.do_log_stats()

    async def _take_routes(self, ids: list[str]) -> dict[str, np.ndarray]:
        got = await self._llm.collective_rpc("arl_take_routes", args=(ids,))
        return {
            rid: np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape) for rid, (raw, shape, dtype) in got[0].items()
        }

    # ---------------------------------------------------------------- weights

    async def _swap_loop(self) -> None:
        assert self._wake is not None and self._slots is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            async with self._slots:  # no copy lands in the slot of the version taken here until it is loaded
                with self._lock:
                    item, self._pending = self._pending, None
                if item is None or item[1] <= self._version:
                    continue
                tensors, version = item
                try:
                    await self._apply(tensors, version)
                    self.last_stage_error = None
                except Exception as exc:  # a bad version must not kill the swap task; the engine reports it
                    self.last_stage_error = f"version {version}: {exc!r}"
                    log.exception("could not apply weight version %d; version %d stays in use", version,
                                  self._version)  # fmt: skip

    async def _apply(self, tensors: Mapping[str, torch.Tensor] | None, version: int) -> None:
        llm = self._llm
        t0 = time.perf_counter()
        if tensors is not None:  # a host version: into the workers now (a GPU copy is there already)
            packed = await asyncio.to_thread(pack_weights, tensors)
            try:
                await llm.collective_rpc("arl_stage_weights", args=(packed.handle, version))
            finally:
                packed.close()  # the worker holds its own mapping now
        t1 = time.perf_counter()
        assert self._labels is not None
        t_still, t_loaded, load_s = await SWAPS[self.config.swap](llm, self._labels, version)  # vllm_swap.py
        t2 = time.perf_counter()
        if tensors is not None:
            self.last_stage_s = t1 - t0
        # Stood still from t_still (until then the core finished its steps in flight: 50-100 ms of 512 sequences).
        self.last_swap_pause_s, self.last_load_s, self._version = t2 - t_still, float(load_s), version
        self._pauses, self._swaps = [*self._pauses[-63:], t2 - t_still], [*self._swaps[-63:], (version, time.time())]
        # The prefix cache is not reset: new requests are salted with the version, so older blocks are never hit, and
        # vLLM evicts them as it needs room. A reset per swap was one more wait for an engine step before anyone
        # waiting for the version heard of it, and failed while requests held blocks (every swap under load).
        assert self._applied is not None
        applied, self._applied = self._applied, asyncio.Event()
        applied.set()
        log.info("vLLM engine: version %d in use (staged in %.3f s, swapped in %.3f s: the engine stood still after "
                 "%.3f, then %.3f: the load's call %.3f of which the in-place load %.3f, the resume %.3f)", version,
                 t1 - t0, t2 - t1, t_still - t1, t2 - t_still, t_loaded - t_still, load_s, t2 - t_loaded)  # fmt: skip

    def _remove_tmp(self) -> None:
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None
