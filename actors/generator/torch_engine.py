"""The torch inference engine: Hugging Face causal LMs (dense and MoE) on CPU or one GPU.

Batched sampling with a KV cache: prompts are left-padded (attention mask and position ids
follow the padding), each prompt is expanded to ``n`` rows, and every step samples one token
per live row from the tempered / top-k / top-p distribution; the reported logprob is the one
under that exact (renormalised) distribution. Greedy (temperature 0) reports the untempered
model logprob of the argmax token. Rows that finish stay in the batch until a quarter of it
is done, then the batch and its KV cache are compacted.

Routes: for MoE models every forward is recorded with :mod:`async_rl.model.hf_routes` hooks; a sample's
routes cover its prompt tokens and every response token that was fed back (not the last one),
padding excluded, as ``uint8`` (``int16`` past 256 experts) ``[T_run, moe_layers, top_k]``.

Calls: :meth:`TorchEngine.generate` queues its prompts for one decode thread (the caller's event
loop stays free); calls that wait together and sample alike (same temperature, top-p, top-k and
stop tokens, no seed) run as one batch, so a generator may call once per prompt group.

Weight hot-swap: the engine mixes in :class:`actors.generator.weight_swap.WeightSwap` (``stage_weights``,
``open_stage``, ``wait_applied``, ``take_swaps``, ...): a standby copy of the model is loaded in the background
and swapped in at the next step boundary; see :mod:`actors.generator.weight_swap`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from actors.generator.config import TorchEngineConfig
from actors.generator.engine import Completion, Engine, SamplingParams
from actors.generator.sampling import sample_tokens
from actors.generator.weight_swap import WeightSwap
from async_rl.model.hf_routes import RouteRecorder, find_moe_layers
from async_rl.model.moe import route_dtype
from async_rl.model.presets import cache_kwarg, load_model
from async_rl.model.token_mask import masked_token_ids

log = logging.getLogger(__name__)

COMPACT_FRACTION = 0.25
"""Compact the batch (and its KV cache) once this share of its rows has finished: a copy of the cache
costs about one decode step, so compacting on every finished row would cost more than it saves."""


class TorchEngine(WeightSwap, Engine):
    """A transformers model with a KV-cached batched sampler and O(1) weight swaps (see the module docstring)."""

    name = "torch"
    config: TorchEngineConfig
    device: torch.device
    _recorders: dict[int, RouteRecorder]
    """One route recorder per model instance (active and standby), keyed by id()."""
    _recording: set[int]
    """Models whose recorder hooks are in place during the current generate call."""
    _closed: bool
    _queue: deque[_Request]
    """Generate calls waiting for the decode thread."""
    _queue_cond: threading.Condition
    _worker: threading.Thread | None
    _rng: torch.Generator
    _stop_ids: tuple[int, ...]
    _pad_id: int
    _masked_ids: torch.Tensor
    """Token ids never sampled when ``params.mask_special_tokens`` (:func:`async_rl.model.token_mask.masked_token_ids`)."""
    _max_positions: int
    _vocab_size: int
    _num_experts: int
    _route_layers: int
    _top_k: int

    def __init__(self, config: TorchEngineConfig, model: PreTrainedModel | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        cfg = config.model
        if model is None:
            model = load_model(cfg.name, seed=cfg.seed, dtype=cfg.dtype)
        super().__init__(model.to(self.device).eval())  # type: ignore[arg-type]
        self._recorders = {}
        self._recording = set()
        moe = find_moe_layers(self._active)
        self._num_experts = max((layer.num_experts for layer in moe), default=0)
        self._route_layers = len(moe)
        self._top_k = moe[0].top_k if moe else 0
        self._closed = False
        self._queue = deque()
        self._queue_cond = threading.Condition()
        self._worker = None
        self._rng = torch.Generator(device=self.device)
        self._rng.manual_seed(config.seed)
        eos = self._active.config.eos_token_id if config.stop_on_eos else None
        self._stop_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        self._pad_id = int(self._active.config.pad_token_id or 0)
        self._masked_ids = torch.tensor(masked_token_ids(cfg.name), dtype=torch.long, device=self.device)
        self._max_positions = int(getattr(self._active.config, "max_position_embeddings", 1 << 30))
        self._vocab_size = int(self._active.config.vocab_size)

    # ---------------------------------------------------------------- Engine interface

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

    async def close(self) -> None:
        """Abort running samples (finish reason 'abort'), fail queued calls, stop the engine's threads."""
        self._closed = True
        self._stop_loader()
        with self._queue_cond:
            self._queue_cond.notify_all()
        for name in ("_loader", "_worker"):
            thread = getattr(self, name)
            if thread is not None:
                await asyncio.to_thread(thread.join)
                setattr(self, name, None)

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
        with torch.inference_mode(), ExitStack() as stack, self._batch_running():
            self._recording = set()
            step = self.config.max_batch_sequences
            for start in range(0, len(rows), step):
                chunk = slice(start, start + step)
                flat.extend(self._generate_batch(rows[chunk], max_new[chunk], params, rng, stack))
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
