"""The generator process loop: prompts in, scored groups out, weights followed in the background.

Tasks (in one TaskGroup): the work loop (:mod:`actors.generator.work`: read prompts through the consumer group,
several batches generating at once, score, push one group record, ack the prompt only after the push),
``heartbeat`` (NATS), and the weight sync's own fetch/poll tasks. Control messages (pause/resume/drain/stop) and
SIGTERM/SIGINT set events; shutdown has two phases: stop taking prompts and finish the batches
in hand within ``drain_timeout_s``, then release whatever is still held so other generators
take it at once. When the learner announces the end of the run (:mod:`async_rl.run.end`, on NATS and in
Redis) the generator drains the same way and exits 0, unless ``on_run_end=wait``. A SIGKILL loses nothing either: the prompts stay pending in the consumer
group and other generators reclaim them after ``prompts.reclaim_idle_ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time

import redis.asyncio as aioredis

from actors.generator.config import GeneratorConfig
from actors.generator.core_follow import CoreFollow
from actors.generator.engine import Engine
from actors.generator.join import check_join
from actors.generator.metrics import GeneratorMetrics
from actors.generator.scoring import Scoring
from actors.generator.weight_sync import WeightSync
from actors.generator.work import BusyClock, Work
from async_rl.process.lifecycle import named_task, raise_if_cancel_requested, redact_url
from async_rl.process.loop_lag import LoopLag
from async_rl.process.repeated import RepeatedLine
from async_rl.run.end import read_run_end
from async_rl.servers.control import Control, ControlPlane, Heartbeat, Message, RunEnded
from async_rl.servers.reach import redis_client
from async_rl.tasks.base import Task
from async_rl.tasks.config import build_task
from async_rl.weights import WeightReader
from async_rl.weights.gpu.reader import GpuReader
from async_rl.weights.transport import make_transport
from buffer.evals import EvalQueue
from buffer.prompts import PromptQueue

log = logging.getLogger(__name__)


def build_engine(cfg: GeneratorConfig) -> Engine:
    if cfg.engine == "torch":
        from actors.generator.torch_engine import TorchEngine

        return TorchEngine(cfg.torch)
    from actors.generator.vllm_engine import VLLMEngine

    return VLLMEngine(cfg.vllm)


def gpu_reader(cfg: GeneratorConfig, engine: Engine, redis: aioredis.Redis) -> GpuReader | None:
    """The same-host GPU weight path (``weight_sync.gpu``) for a CUDA torch engine, or an engine that copies GPU
    versions itself (vLLM on CUDA: this process then never touches CUDA); None otherwise."""
    if not cfg.weight_sync.gpu:
        return None
    if engine.gpu_copier() is not None:
        return GpuReader(redis, cfg.run.names, None, cfg.weight_sync.reader, reader_id=cfg.generator_id)
    device = getattr(engine, "device", None)
    if cfg.engine != "torch" or device is None or device.type != "cuda":
        return None
    return GpuReader(redis, cfg.run.names, device, cfg.weight_sync.reader, reader_id=cfg.generator_id)


class Generator(Work):
    """One generator process (see the module docstring)."""

    # The work's attributes (stop and resume events, counters, engine, queues, held prompts) are declared by
    # :class:`~actors.generator.work.Work`; these are the process's own.
    state: str
    _control: ControlPlane | None
    _started_at: float
    _done: asyncio.Event
    """Set when the work loop has ended: background loops finish."""
    run_ended: RunEnded | None
    """The end of the run, once the learner announced it."""

    def __init__(self, cfg: GeneratorConfig, *, task: Task | None = None) -> None:
        """``task``: ``cfg.task`` built already (the entry point builds it to check the config); else :meth:`setup`
        builds it."""
        self.cfg = cfg
        self.stop_event = asyncio.Event()
        self.resume_event = asyncio.Event()
        self.resume_event.set()
        self._abort_event = asyncio.Event()
        self._done = asyncio.Event()
        self.num_prompts = 0
        self.num_tokens = 0
        self._busy = BusyClock()
        self._loop_lag = LoopLag()
        self.version_wait_s = 0.0
        self._fresh_waited = -1
        self.state = "starting"
        self._redis = None
        self._control = None
        self._engine = None
        self._sync = None
        self._task = task
        self._prompts = None
        self._held = []
        self._evals = None
        self._held_evals = []
        self._started_at = time.time()
        self.run_ended = None
        self._metrics = GeneratorMetrics(cfg)
        self._scoring = Scoring(cfg.task, cfg.max_failed_groups, self._metrics)

    # ------------------------------------------------------------------ lifecycle
    async def setup(self, stack: contextlib.AsyncExitStack) -> bool:
        """Connect, build the engine, load the newest weights; every resource is entered in ``stack``.
        False when stopped while waiting for the first weights."""
        cfg, names = self.cfg, self.cfg.run.names
        assert cfg.run.redis_url and cfg.run.nats_url, "URLs are resolved by the entry point"
        if self._task is None:
            self._task = build_task(cfg.task)
        self._metrics.start()
        stack.callback(self._metrics.close)
        self._redis = redis_client(cfg.run.redis_url)  # bounded retries, then the error ends the process
        stack.push_async_callback(self._redis.aclose)
        self._prompts = PromptQueue(self._redis, names, cfg.prompts)
        self._evals = EvalQueue(self._redis, names, cfg.prompts)
        self._control = await ControlPlane(cfg.run.nats_url, name=cfg.generator_id, cfg=cfg.control).connect()
        stack.push_async_callback(self._control.close)
        await self._control.subscribe(names.control_subject, self._on_control, kinds=(Control, RunEnded))
        ended = await read_run_end(self._redis, names)  # after subscribing: an end sent meanwhile is not missed
        if ended is not None:
            self._on_run_end(ended)
            if self.stop_event.is_set():
                return False
        # The run exists, the model and the task match: before any weight. A generator that came before its learner
        # checks once the learner's first weights are out (its state is written before them).
        checked = await check_join(cfg, self._redis, self._control)
        self._engine = await asyncio.to_thread(build_engine, cfg)
        stack.push_async_callback(self._engine.close)
        transport = make_transport(cfg.transport, cfg.run.redis_url, names)
        reader = WeightReader(self._redis, transport, names, cfg.weight_sync.reader, reader_id=cfg.generator_id)
        where = f"prefix {names.prefix!r} at {redact_url(cfg.run.redis_url)}"
        if cfg.engine == "vllm" and cfg.vllm.follow == "core":  # the engine core follows versions itself
            self._sync = CoreFollow(self._engine, cfg)
        else:
            gpu = gpu_reader(cfg, self._engine, self._redis)
            self._sync = WeightSync(self._engine, reader, names, cfg.weight_sync, self._control, where=where, gpu=gpu)
        stack.push_async_callback(self._sync.close)
        stack.push_async_callback(self._release_held)  # first of the closing steps: others may take them at once
        if self.stop_event.is_set():  # stopped while the engine was built (request_stop had no sync to stop)
            return False
        log.info("generator %s: engine %s ready; loading the newest weight version", cfg.generator_id, cfg.engine)
        if not await self._sync.start():  # the newest complete version is applied before the first token
            return False
        if not checked:
            await check_join(cfg, self._redis, self._control)
        self.state = "running"
        return True

    async def run(self) -> None:
        """Set up, then the work loop with the weight sync and heartbeats beside it in one TaskGroup: a failing
        background task cancels the work and ends the process with its error (:class:`TaskFailed`)."""
        async with contextlib.AsyncExitStack() as stack:
            if not await self.setup(stack):
                log.info("generator %s: stopped before the first weights arrived%s", self.cfg.generator_id,
                         " (the run has ended)" if self.run_ended else "")  # fmt: skip
                return
            assert self._sync is not None
            # What start-up built (the engine, its model config, imported modules: millions of objects) lives as long
            # as the work: out of the collector's sight, a full collection no longer walks it while the loop waits.
            # Its garbage goes first; all of it is given back at the end, so the interpreter's exit finalises it
            # (frozen, it would be reported leaked). vLLM's own processes do the same.
            gc.collect()
            gc.freeze()
            stack.callback(gc.unfreeze)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(named_task("weights", self._sync.run()), name="weights")
                tg.create_task(named_task("heartbeat", self._heartbeat_loop()), name="heartbeat")
                lag = tg.create_task(self._loop_lag.run(), name="loop-lag")
                await self._work_loop()
                # Second phase: the work is drained; background tasks end on their own (the lag timer is cancelled).
                self._done.set()
                self._sync.stop()
                lag.cancel()

    async def _release_held(self) -> None:
        self.state = "stopping"
        self._scoring.flush()
        released = 0
        if self._held and self._prompts is not None:
            try:
                await self._prompts.release(self._held)
                released = len(self._held)
            except Exception as exc:  # the server is gone: they stay pending and are reclaimed after the idle time
                log.warning("releasing %d held prompts failed (%r); others reclaim them", len(self._held), exc)
            self._held = []
        if self._held_evals and self._evals is not None:
            with contextlib.suppress(Exception):  # else reclaimed after the idle time, like prompts
                await self._evals.release(self._held_evals)
            self._held_evals = []
        if self._control is not None:
            with contextlib.suppress(Exception):  # the last heartbeat says "stopping"; NATS may be gone
                await self._control.publish(self.cfg.run.names.heartbeat_subject, self._heartbeat())
        log.info("generator %s exited: %d prompts done, released %d prompts", self.cfg.generator_id,
                 self.num_prompts, released)  # fmt: skip

    def request_stop(self, abort: bool = False) -> None:
        """First phase of shutdown: take no new prompts (abort: also give up the batch in hand)."""
        if not self.stop_event.is_set():
            log.info("generator %s stopping (%s)", self.cfg.generator_id, "abort" if abort else "drain")
        self.stop_event.set()
        if self.state == "starting" and self._sync is not None:  # still waiting for the first weights
            self._sync.stop()
        self.resume_event.set()
        if abort:
            self._abort_event.set()
        else:  # second phase: give up the batch in hand after the drain deadline
            asyncio.get_running_loop().call_later(self.cfg.drain_timeout_s, self._abort_event.set)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    # ------------------------------------------------------------------ control plane
    def _on_run_end(self, msg: RunEnded) -> None:
        if self.run_ended is not None and self.run_ended.sent_at == msg.sent_at:
            return
        self.run_ended = msg
        what = f"run {self.cfg.run.prefix!r} ended at step {msg.step}, version {msg.version} ({msg.reason})"
        if self.cfg.on_run_end == "wait":
            log.info("%s; waiting for a successor learner (on_run_end=wait)", what)
            return
        log.info("%s; draining and exiting", what)
        self.state = "draining"
        self.request_stop()

    async def _on_control(self, msg: Message) -> None:
        if isinstance(msg, RunEnded):
            self._on_run_end(msg)
            return
        assert isinstance(msg, Control)
        if not msg.applies_to(self.cfg.generator_id):
            return
        log.info("control %s (%s)", msg.action, msg.reason or "no reason given")
        if msg.action == "pause":
            self.resume_event.clear()
            self.state = "paused"
        elif msg.action == "resume":
            self.resume_event.set()
            self.state = "running"
        elif msg.action == "drain":
            self.state = "draining"
            self.request_stop()
        elif msg.action == "stop":
            self.request_stop(abort=True)

    def _heartbeat(self, tokens_per_s: float = 0.0) -> Heartbeat:
        assert self._engine is not None
        timings = self._engine.take_swap_timings()
        return Heartbeat(
            generator_id=self.cfg.generator_id, engine=self.cfg.engine, version=self._engine.version,
            tokens_per_s=tokens_per_s, in_flight=len(self._held), state=self.state,
            weight_failures=self._sync.num_failures if self._sync else 0, started_at=self._started_at,
            swap_pause_ms=self._engine.last_swap_pause_s * 1e3,
            swap_pauses_ms=[round(p * 1e3, 3) for p in self._engine.take_swap_pauses()],
            reclaim_idle_ms=self.cfg.prompts.reclaim_idle_ms,
            interval_s=self.cfg.heartbeat_interval_s,
            fetch_s=self._sync.last_fetch.total_s if self._sync and self._sync.last_fetch else 0.0,
            generate_s=self.generate_s, version_wait_s=self.version_wait_s,
            applied_latency_s=self._applied_latencies(),
            standby_load_s=[round(a, 6) for a, _ in timings], swap_wait_s=[round(b, 6) for _, b in timings],
            staged_latency_s=self._sync.take_staged_latencies() if self._sync is not None else [],
            loop_lag_ms=round(self._loop_lag.take_max() * 1e3, 3),
        )  # fmt: skip

    def _applied_latencies(self) -> list[float]:
        """Snapshot-to-swap seconds of the versions swapped in since the last call (learner-stamped ones only)."""
        assert self._engine is not None
        taken = self._sync.taken_at if self._sync is not None else {}
        return [round(at - taken[v], 6) for v, at in self._engine.take_swaps() if taken.get(v, 0.0) > 0]

    async def _heartbeat_loop(self) -> None:
        assert self._control is not None and self._redis is not None
        subject = self.cfg.run.names.heartbeat_subject
        last_tokens, last_t = self.num_tokens, time.monotonic()
        failed = RepeatedLine(log, "heartbeat failed: {why} ({n}x)", level=logging.WARNING)
        while not self._done.is_set():
            raise_if_cancel_requested()  # a cancel swallowed by redis-py or wait_for must still end this loop
            # NATS gone for good (its reconnect attempts spent): exit non-zero for the supervisor, which restarts us
            # once NATS is back; a deaf generator logging failed heartbeats forever helps nobody.
            self._control.check()
            now = time.monotonic()
            rate = (self.num_tokens - last_tokens) / max(now - last_t, 1e-6)
            last_tokens, last_t = self.num_tokens, now
            try:
                beat = self._heartbeat(rate)
                await self._control.publish(subject, beat)
                self._metrics.beat(beat, self._sync, self._engine)
                ended = await read_run_end(self._redis, self.cfg.run.names)  # the record, if NATS missed the end
                if ended is not None:
                    self._on_run_end(ended)
                if self._held and self._prompts is not None:  # still working on them: nobody may reclaim them
                    await self._prompts.touch(self.cfg.generator_id, self._held)
                if self._held_evals and self._evals is not None:
                    await self._evals.prompts.touch(self.cfg.generator_id, self._held_evals)
            except Exception as exc:  # retry boundary: NATS reconnects by itself, Redis is retried next beat
                failed.add(why=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), self.cfg.heartbeat_interval_s)
            if self._done.is_set():
                return
