"""The torch inference engine: Hugging Face causal LMs (dense and MoE) on CPU or one GPU.

Batched sampling with a KV cache: prompts are left-padded (attention mask and position ids
follow the padding), each prompt is expanded to ``n`` rows, and every step samples one token
per live row from the tempered / top-k / top-p distribution; the reported logprob is the one
under that exact (renormalised) distribution. Greedy (temperature 0) reports the untempered
model logprob of the argmax token. Rows that finish stay in the batch until a quarter of it
is done, then the batch and its KV cache are compacted.

Routes: for MoE models every forward is recorded with :mod:`async_rl.hf_moe` hooks; a sample's
routes cover its prompt tokens and every response token that was fed back (not the last one),
padding excluded, as ``uint8`` (``int16`` past 256 experts) ``[T_run, moe_layers, top_k]``.

Calls: :meth:`TorchEngine.generate` queues its prompts for one decode thread (the caller's event
loop stays free); calls that wait together and sample alike (same temperature, top-p, top-k and
stop tokens, no seed) run as one batch, so a generator may call once per prompt group.

Weight hot-swap: :meth:`TorchEngine.stage_weights` (any thread) checks the names and shapes,
then a loader thread copies the tensors into a standby copy of the model while generation
continues on the active one; at the next step boundary the two references are exchanged, so
the pause (:attr:`TorchEngine.last_swap_pause_s`) is a pointer swap whatever the model size.
:meth:`TorchEngine.open_stage` does the same with a version whose tensors arrive bucket by bucket: the loader
copies each part as it comes and marks the standby ready only once the last one is in.
The KV cache carries over, and the tokens sampled after the swap carry the new version. The
standby (created with the first staged version) doubles the parameter memory. A staged version
must be complete (every weight, in state_dict or checkpoint names: see :mod:`.param_slots`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from actors.generator.config import TorchEngineConfig
from actors.generator.engine import Completion, Engine, SamplingParams, StagingStream
from actors.generator.param_slots import ParamSlots
from actors.generator.queued_stream import QueuedStream, StreamAborted
from actors.generator.sampling import sample_tokens
from async_rl.hf_moe import RouteRecorder, find_moe_layers
from async_rl.models import cache_kwarg, load_model
from async_rl.moe import route_dtype
from async_rl.token_mask import masked_token_ids

log = logging.getLogger(__name__)

SWAPS_KEPT = 256
"""Swaps remembered for :meth:`TorchEngine.take_swaps` between two heartbeats (a few per second at most)."""
COMPACT_FRACTION = 0.25
"""Compact the batch (and its KV cache) once this share of its rows has finished: a copy of the cache
costs about one decode step, so compacting on every finished row would cost more than it saves."""


class TorchEngine(Engine):
    """A transformers model with a KV-cached batched sampler and O(1) weight swaps (see the module docstring)."""

    name = "torch"
    config: TorchEngineConfig
    device: torch.device
    last_swap_pause_s: float
    """Time generation stood still for the last swap (a reference exchange under a lock)."""
    last_load_s: float
    """Time the last staged version took to copy into the standby model (generation goes on meanwhile)."""
    last_stage_error: str | None
    """Why the last staged version could not be loaded (None when it loaded)."""
    _active: PreTrainedModel
    _standby: PreTrainedModel | None
    _recorders: dict[int, RouteRecorder]
    """One route recorder per model instance (active and standby), keyed by id()."""
    _recording: set[int]
    """Models whose recorder hooks are in place during the current generate call."""
    _version: int
    _ready_version: int | None
    _pending: tuple[Mapping[str, torch.Tensor] | QueuedStream, int] | None
    _streaming: QueuedStream | None
    """The stream the loader is consuming (aborted on close, so that the loader does not wait for it)."""
    _busy: bool
    _closed: bool
    _waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future]]
    _swap_lock: threading.Lock
    _staged_cond: threading.Condition
    """Notified (under ``_swap_lock``) when a version is loaded into the standby or swapped in."""
    _queue: deque[_Request]
    """Generate calls waiting for the decode thread."""
    _queue_cond: threading.Condition
    _worker: threading.Thread | None
    _stage_cond: threading.Condition
    _loader: threading.Thread | None
    _rng: torch.Generator
    _stop_ids: tuple[int, ...]
    _masked_ids: torch.Tensor
    """Token ids never sampled when ``params.mask_special_tokens`` (:func:`async_rl.token_mask.masked_token_ids`)."""
    _num_experts: int
    _swaps: deque[tuple[int, float]]
    """(version, unix time) of swaps not yet taken by :meth:`take_swaps`."""

    def __init__(self, config: TorchEngineConfig, model: PreTrainedModel | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        cfg = config.model
        if model is None:
            model = load_model(cfg.name, seed=cfg.seed, dtype=cfg.dtype)
        self._active = model.to(self.device).eval()  # type: ignore[arg-type]
        self._slots_active = ParamSlots(self._active)
        self._slots_standby: ParamSlots | None = None
        self._swaps = deque(maxlen=SWAPS_KEPT)
        self._standby = None
        self._recorders = {}
        self._recording = set()
        moe = find_moe_layers(self._active)
        self._num_experts = max((layer.num_experts for layer in moe), default=0)
        self._route_layers = len(moe)
        self._top_k = moe[0].top_k if moe else 0
        self._version = -1
        self._ready_version = None
        self._pending = None
        self._streaming = None
        self._busy = False
        self._closed = False
        self._waiters = []
        self._swap_lock = threading.Lock()
        self._staged_cond = threading.Condition(self._swap_lock)
        self._queue = deque()
        self._queue_cond = threading.Condition()
        self._worker = None
        self._stage_cond = threading.Condition()
        self._loader = None
        self._rng = torch.Generator(device=self.device)
        self._rng.manual_seed(config.seed)
        eos = self._active.config.eos_token_id if config.stop_on_eos else None
        self._stop_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        self._pad_id = int(self._active.config.pad_token_id or 0)
        self._masked_ids = torch.tensor(masked_token_ids(cfg.name), dtype=torch.long, device=self.device)
        self._max_positions = int(getattr(self._active.config, "max_position_embeddings", 1 << 30))
        self._vocab_size = int(self._active.config.vocab_size)
        self.last_swap_pause_s = 0.0
        self.last_load_s = 0.0
        self.last_stage_error = None

    # ---------------------------------------------------------------- Engine interface

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_batch_prompts(self) -> int:
        return self.config.max_batch_prompts

    @property
    def model(self) -> PreTrainedModel:
        """The model generation runs on right now (do not run it while a generate call is in flight)."""
        return self._active

    @property
    def num_moe_layers(self) -> int:
        return self._route_layers

    async def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams) -> list[list[Completion]]:
        """Queue the prompts for the decode thread; calls that wait together are batched together."""
        rows = self._check_prompts(prompts, params)
        if not rows:
            return []
        loop = asyncio.get_running_loop()
        request = _Request(rows=rows, num_prompts=len(prompts), params=params, loop=loop, future=loop.create_future())
        with self._queue_cond:
            self._queue.append(request)
            self._queue_cond.notify()
            if self._worker is None:
                self._worker = threading.Thread(target=self._worker_main, name="torch-engine-decode", daemon=True)
                self._worker.start()
        return await request.future

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Check names/shapes now (ValueError), load in the background, swap at the next step boundary.

        The engine keeps references to ``tensors`` until they are copied: do not modify them.
        """
        self._stage(tensors, version, tensors)

    def open_stage(self, version: int, layout: Mapping[str, torch.Tensor]) -> StagingStream:
        """:meth:`stage_weights` in parts: ``layout`` (every name, shape and dtype) is checked now, the loader copies
        each part as it is put, and the standby becomes ready for the swap at :meth:`StagingStream.finish`."""
        stream = QueuedStream(layout)
        self._stage(stream, version, layout)
        return stream

    def _stage(self, source: Mapping[str, torch.Tensor] | QueuedStream, version: int,
               layout: Mapping[str, torch.Tensor]) -> None:  # fmt: skip
        if self._closed:
            raise RuntimeError("engine is closed")
        if version <= self._version:
            raise ValueError(f"staged version {version} is not newer than the version in use ({self._version})")
        self._slots_active.check(layout)
        with self._stage_cond:
            self._pending = (source, version)
            self._stage_cond.notify()
            if self._loader is None:
                self._loader = threading.Thread(target=self._loader_main, name="torch-engine-loader", daemon=True)
                self._loader.start()

    async def wait_applied(self, version: int, timeout_s: float | None = None) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        entry = (version, loop, fut)
        with self._swap_lock:
            if self._version >= version:
                return True
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(fut, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            with self._swap_lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)

    def wait_staged(self, version: int, timeout_s: float | None = None) -> bool:
        """Block until ``version`` (or newer) is loaded in the standby or in use; True if so, False on timeout.

        A blocking call for threads (tests, benchmarks); coroutines use :meth:`wait_applied`.
        """

        def ready() -> bool:
            return self._version >= version or (self._ready_version is not None and self._ready_version >= version)

        with self._staged_cond:
            return self._staged_cond.wait_for(ready, timeout_s)

    def take_swaps(self) -> list[tuple[int, float]]:
        with self._swap_lock:
            out = list(self._swaps)
            self._swaps.clear()
        return out

    @property
    def ready_version(self) -> int | None:
        """Version loaded in the standby and waiting for the next step boundary (None: nothing waiting)."""
        return self._ready_version

    async def close(self) -> None:
        """Abort running samples (finish reason 'abort'), fail queued calls, stop the engine's threads."""
        self._closed = True
        with self._stage_cond:
            self._pending = None
            if self._streaming is not None:
                self._streaming.abort()
            self._stage_cond.notify_all()
        with self._queue_cond:
            self._queue_cond.notify_all()
        for name in ("_loader", "_worker"):
            thread = getattr(self, name)
            if thread is not None:
                await asyncio.to_thread(thread.join)
                setattr(self, name, None)

    # ---------------------------------------------------------------- weight swap

    def _loader_main(self) -> None:
        threads = self.config.load_threads if self.device.type == "cpu" else 1
        pool = ThreadPoolExecutor(threads, thread_name_prefix="torch-engine-copy") if threads > 1 else None
        try:
            self._load_loop(pool)
        finally:
            if pool is not None:
                pool.shutdown()

    def _load_loop(self, pool: ThreadPoolExecutor | None) -> None:
        while True:
            with self._stage_cond:
                while self._pending is None and not self._closed:
                    self._stage_cond.wait()
                if self._closed:
                    return
                source, version = self._pending  # type: ignore[misc]
                self._pending = None
                self._streaming = source if isinstance(source, QueuedStream) else None
            try:
                self._load_standby(source, version, pool)
                self.last_stage_error = None
            except StreamAborted:
                log.info("staged weight version %d was abandoned while it arrived; keeping version %d", version,
                         self._version)  # fmt: skip
            except Exception as exc:  # a bad version must not kill the loader; the old weights stay
                self.last_stage_error = f"version {version}: {exc!r}"
                log.exception("could not load staged weight version %d; keeping version %d", version, self._version)

    def _load_standby(self, source: Mapping[str, torch.Tensor] | QueuedStream, version: int,
                      pool: ThreadPoolExecutor | None) -> None:  # fmt: skip
        with self._swap_lock:
            self._ready_version = None  # the standby is about to be overwritten; an unapplied version is dropped
            standby, slots = self._standby, self._slots_standby
        if standby is None:
            standby = self._new_standby()
            slots = ParamSlots(standby)
        assert slots is not None
        t0 = time.perf_counter()
        parts = source.parts() if isinstance(source, QueuedStream) else (source,)
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(device=self.device)
            with torch.cuda.stream(stream):
                for tensors in parts:
                    slots.copy_(tensors)
            stream.synchronize()
        else:
            for tensors in parts:
                slots.copy_(tensors, pool)
        self.last_load_s = time.perf_counter() - t0
        with self._swap_lock:
            self._standby, self._slots_standby = standby, slots
            if version <= self._version:
                return
            self._ready_version = version
            self._staged_cond.notify_all()
            if not self._busy:
                self._swap_locked()

    def _new_standby(self) -> PreTrainedModel:
        """A second instance of the model architecture, parameters left uninitialised (a staged version
        overwrites every one of them); buffers (e.g. rotary frequencies) are copied from the active model.
        Skipping the random init makes the first swap of a 1 GB model seconds faster."""
        cfg = self._active.config
        dtype = next(self._active.parameters()).dtype
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        model = model.to_empty(device=self.device)
        model.tie_weights()  # to_empty turns tied meta parameters into separate ones
        active_buffers = dict(self._active.named_buffers())
        with torch.no_grad():
            for name, buf in model.named_buffers():
                buf.copy_(active_buffers[name])
        return model.eval()

    def _swap_locked(self) -> None:
        """Exchange active and standby (caller holds ``_swap_lock`` and no forward is running)."""
        t0 = time.perf_counter()
        assert self._standby is not None and self._ready_version is not None and self._slots_standby is not None
        self._active, self._standby = self._standby, self._active
        self._slots_active, self._slots_standby = self._slots_standby, self._slots_active
        self._version, self._ready_version = self._ready_version, None
        self.last_swap_pause_s = time.perf_counter() - t0
        self._swaps.append((self._version, time.time()))
        self._staged_cond.notify_all()
        done = [w for w in self._waiters if w[0] <= self._version]
        for w in done:
            self._waiters.remove(w)
            try:
                w[1].call_soon_threadsafe(_resolve, w[2])
            except RuntimeError:  # the waiter's loop is closed
                pass

    def _step_model(self) -> tuple[PreTrainedModel, int]:
        """The model and version for the next forward, after a swap if a staged version is ready."""
        if self._ready_version is not None:
            t0 = time.perf_counter()
            with self._swap_lock:
                if self._ready_version is not None:
                    self._swap_locked()
                    self.last_swap_pause_s = time.perf_counter() - t0
        return self._active, self._version

    # ---------------------------------------------------------------- generation

    def _check_prompts(self, prompts: Sequence[np.ndarray], params: SamplingParams) -> list[np.ndarray]:
        if self._closed:
            raise RuntimeError("engine is closed")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        rows = []
        for i, p in enumerate(prompts):
            arr = np.asarray(p)
            if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"prompts[{i}] must be a non-empty 1-D integer array, got {arr.dtype} {arr.shape}")
            if int(arr.min()) < 0 or int(arr.max()) >= self._vocab_size:
                raise ValueError(f"prompts[{i}] has token ids outside [0, {self._vocab_size})")
            if arr.size >= self._max_positions:
                raise ValueError(f"prompts[{i}] has {arr.size} tokens, the model holds {self._max_positions}")
            rows.extend([arr.astype(np.int64)] * params.n)
        return rows

    def _worker_main(self) -> None:
        while True:
            with self._queue_cond:
                while not self._queue and not self._closed:
                    self._queue_cond.wait()
                if self._closed:
                    queued, self._queue = list(self._queue), deque()
                    for req in queued:
                        _deliver(req, RuntimeError("engine closed before this request ran"))
                    return
                batch = self._take_batch()
            if not batch:
                continue
            try:
                results = self._run_batch(batch)
            except Exception as exc:  # a failing batch fails its callers, not the decode thread
                log.exception("generation failed for %d request(s)", len(batch))
                for req in batch:
                    _deliver(req, exc)
                continue
            for req, result in zip(batch, results, strict=True):
                _deliver(req, result)

    def _take_batch(self) -> list[_Request]:
        """The oldest queued request and, in order, the queued ones it can share a batch with (caller locks)."""
        # Calls whose caller already gave up are dropped unrun (reading done() from this thread is a benign race:
        # one cancelled a moment later still runs, and its result is discarded by _deliver).
        live = deque(req for req in self._queue if not req.future.done())
        if not live:
            self._queue = live
            return []
        first = live.popleft()
        self._queue = live
        batch, num_rows = [first], len(first.rows)
        if first.params.seed is not None:
            return batch  # a seeded call samples alone, so its draws do not depend on its neighbours
        key = _merge_key(first.params)
        kept: deque[_Request] = deque()
        while self._queue:
            req = self._queue.popleft()
            fits = num_rows + len(req.rows) <= self.config.max_batch_sequences
            if fits and req.params.seed is None and _merge_key(req.params) == key:
                batch.append(req)
                num_rows += len(req.rows)
            else:
                kept.append(req)
        self._queue = kept
        return batch

    def _run_batch(self, batch: list[_Request]) -> list[list[list[Completion]]]:
        """Generate every row of ``batch`` (in chunks of max_batch_sequences); completions per request."""
        params = batch[0].params
        rng = self._rng
        if params.seed is not None:
            rng = torch.Generator(device=self.device)
            rng.manual_seed(params.seed)
        rows = [r for req in batch for r in req.rows]
        max_new = [req.params.max_new_tokens for req in batch for _ in req.rows]
        flat: list[Completion] = []
        with torch.inference_mode(), ExitStack() as stack:
            with self._swap_lock:
                self._busy = True
            try:
                self._recording = set()
                step = self.config.max_batch_sequences
                for start in range(0, len(rows), step):
                    chunk = slice(start, start + step)
                    flat.extend(self._generate_batch(rows[chunk], max_new[chunk], params, rng, stack))
            finally:
                with self._swap_lock:
                    self._busy = False
                    if self._ready_version is not None:
                        self._swap_locked()
        out, offset = [], 0
        for req in batch:
            n = req.params.n
            out.append([flat[offset + i * n : offset + (i + 1) * n] for i in range(req.num_prompts)])
            offset += len(req.rows)
        return out

    def _routes_of(self, model: PreTrainedModel) -> torch.Tensor:
        """The routes ``[B, S, L, K]`` of the forward ``model`` just ran."""
        forwards = self._recorders[id(model)].take()
        assert len(forwards) == 1, f"expected one recorded forward, got {len(forwards)}"
        return forwards[0]

    def _generate_batch(
        self,
        prompts: list[np.ndarray],
        max_new_tokens: list[int],
        params: SamplingParams,
        rng: torch.Generator,
        stack: ExitStack,
    ) -> list[Completion]:
        dev = self.device
        num_rows = len(prompts)
        lens = torch.tensor([p.size for p in prompts])
        width = int(lens.max())
        budgets = torch.minimum(self._max_positions - lens, torch.tensor(max_new_tokens)).to(dev)
        max_new = int(budgets.max())
        ids = torch.full((num_rows, width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((num_rows, width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - p.size :] = torch.from_numpy(p)
            mask[b, width - p.size :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(sorted({*params.stop_token_ids, *self._stop_ids}), dtype=torch.long, device=dev)
        masked = self._masked_ids if params.mask_special_tokens else None

        out_tokens = torch.full((num_rows, max_new), self._pad_id, dtype=torch.long, device=dev)
        out_logprobs = torch.zeros((num_rows, max_new), dtype=torch.float32, device=dev)
        out_versions = torch.zeros((num_rows, max_new), dtype=torch.int32, device=dev)
        out_len = torch.zeros(num_rows, dtype=torch.long, device=dev)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=dev)
        routes = self._route_layers > 0
        if routes:
            rdt = getattr(torch, route_dtype(self._num_experts).name)
            resp_routes = torch.zeros((num_rows, max_new, self._route_layers, self._top_k), dtype=rdt, device=dev)

        model, version = self._step_model()
        self._ensure_recorder(model, stack)
        cache = DynamicCache(config=model.config)
        cache_kw = cache_kwarg(model)
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
            **{cache_kw: cache},
        )  # fmt: skip
        if routes:
            prompt_routes = self._routes_of(model).to(rdt)
        logits = out.logits[:, -1]
        live = torch.arange(num_rows, device=dev)  # original row of each batch row
        alive = torch.ones(num_rows, dtype=torch.bool, device=dev)
        last_pos = positions[:, -1]
        for step in range(max_new):
            tokens, logprobs = sample_tokens(logits, params, rng, masked)
            rows_alive = live[alive]
            out_tokens[rows_alive, step] = tokens[alive]
            out_logprobs[rows_alive, step] = logprobs[alive]
            out_versions[rows_alive, step] = version
            out_len[rows_alive] = step + 1
            hit_stop = torch.isin(tokens, stop) & alive
            stopped[live[hit_stop]] = True
            alive = alive & ~hit_stop & (step + 1 < budgets[live])
            if step + 1 == max_new or self._closed or not bool(alive.any()):
                break
            if float((~alive).sum()) >= COMPACT_FRACTION * alive.numel():
                keep = alive.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, mask, tokens, last_pos = live[keep], mask[keep], tokens[keep], last_pos[keep]
                alive = alive[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            last_pos = last_pos + 1
            model, version = self._step_model()
            self._ensure_recorder(model, stack)
            out = model(
                input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos[:, None], use_cache=True,
                **{cache_kw: cache},
            )  # fmt: skip
            logits = out.logits[:, -1]
            if routes:
                # These routes belong to response token `step` of each row just fed back.
                step_routes = self._routes_of(model)[:, 0].to(rdt)
                resp_routes[live[alive], step] = step_routes[alive]

        finished_by_close = self._closed
        tokens_np = out_tokens.cpu().numpy().astype(np.int32)
        logprobs_np = out_logprobs.cpu().numpy()
        versions_np = out_versions.cpu().numpy()
        len_np = out_len.cpu().numpy()
        stopped_np = stopped.cpu().numpy()
        budgets_np = budgets.cpu().numpy()
        if routes:
            prompt_routes_np = prompt_routes.cpu().numpy()
            resp_routes_np = resp_routes.cpu().numpy()
        result = []
        for b, p in enumerate(prompts):
            n = int(len_np[b])
            if stopped_np[b]:
                reason = "stop"
            elif n >= int(budgets_np[b]):
                reason = "length"
            else:
                reason = "abort" if finished_by_close else "length"
            r = None
            if routes:
                r = np.concatenate([prompt_routes_np[b, width - p.size :], resp_routes_np[b, : n - 1]], axis=0)
                r = r.astype(route_dtype(self._num_experts), copy=False)
            result.append(
                Completion(
                    token_ids=tokens_np[b, :n].copy(),
                    logprobs=logprobs_np[b, :n].copy(),
                    versions=versions_np[b, :n].copy(),
                    finish_reason=reason,
                    routes=r,
                )  # fmt: skip
            )
        return result

    def _ensure_recorder(self, model: PreTrainedModel, stack: ExitStack) -> None:
        """Make ``model`` record routes for the rest of this call (its hooks go away when ``stack`` closes)."""
        if not self._route_layers or id(model) in self._recording:
            return
        rec = self._recorders.get(id(model))
        if rec is None:
            rec = self._recorders[id(model)] = RouteRecorder(model)
        stack.enter_context(rec)
        rec.take()
        self._recording.add(id(model))


@dataclass(slots=True)
class _Request:
    """One generate call waiting for (or in) the decode thread."""

    rows: list[np.ndarray]
    """Prompt ids, each repeated ``params.n`` times."""
    num_prompts: int
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


def _merge_key(params: SamplingParams) -> tuple:
    """Calls with equal keys share a batch (n and max_new_tokens may differ: both are per row)."""
    return (params.temperature, params.top_p, params.top_k, tuple(sorted(params.stop_token_ids)),
            params.mask_special_tokens)  # fmt: skip


def _deliver(req: _Request, result: object) -> None:
    """Resolve a request's future from the decode thread (an exception instance fails it)."""

    def settle() -> None:
        if req.future.done():  # the caller gave up (cancelled)
            return
        if isinstance(result, BaseException):
            req.future.set_exception(result)
        else:
            req.future.set_result(result)

    try:
        req.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop is closed
        pass


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)

