"""How a staged weight version goes into use in vLLM: two ways (``vllm.swap``).

* ``pause`` (:func:`swap_by_pause`): the engine's process asks vLLM's engine core to pause (keeping requests and KV
  cache; :func:`~actors.generator.vllm_compat.pause_keep`), then its workers to load the staged version in place
  (``arl_apply_staged``), relabels and asks the core to resume: three round trips through the generator's event
  loop, which a busy generator answers late (37-71 ms at p50 of each heartbeat's worst on the node; docs/gpus.md),
  while the engine stands still from the pause's answer to the resume.
* ``core`` (:func:`swap_in_core`): one request, ``arl_swap``, a method this module gives vLLM's ``EngineCore``
  (:func:`install`, called by the project's scheduler in the engine core's process). The core pauses as vLLM's own
  ``pause_scheduler(mode="keep")`` does; once no step is in flight (vLLM's idle callbacks) it has its workers load
  the version, labels the steps from then on where vLLM labels them itself (0.27+), answers, and resumes. The answer
  is queued before any output of the new weights and carries the core's clock at the change (``time.monotonic()``,
  one clock for every process of a Linux host): the front end's labels (:class:`~actors.generator.vllm_compat.FrontLabels`)
  place each request's first token of the new weights by it, also for outputs the front end processed before the
  answer came (:meth:`~actors.generator.vllm_compat.FrontLabels.expect`).

* ``boundary`` (:func:`swap_at_boundary`): one request, ``arl_swap_boundary``, answered at once and without a
  pause. The engine core handles requests between its steps; there the workers queue the in-place load on the
  stream the steps run on (``arl_apply_ordered``), after every step launched so far and before the
  next, and the scheduler labels the steps it schedules from then on with the new version
  (:mod:`.vllm_step_labels`; the outputs of steps launched before, still on their way, keep the old label). Decoding
  stands still only for the load's GPU time (milliseconds), reported as the pause.

Each returns ``(still, loaded, load_s)``: when the engine stood still and when the load's call returned
(``time.perf_counter()`` of the engine's process; for ``core`` counted back from the answer by the core's own
durations), and the workers' in-place load seconds.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from actors.generator.vllm_compat import pause_keep

METHOD = "arl_swap"
"""The engine core's method (a vLLM utility call)."""
BOUNDARY_METHOD = "arl_swap_boundary"
"""The engine core's method for ``vllm.swap="boundary"``."""


def install() -> None:
    """Give vLLM's ``EngineCore`` :data:`METHOD`, :data:`BOUNDARY_METHOD` and the follower's methods
    (:mod:`.vllm_follow`; idempotent; in the engine core's process)."""
    from vllm.v1.engine.core import EngineCore

    from actors.generator import vllm_follow

    methods = ((METHOD, arl_swap), (BOUNDARY_METHOD, arl_swap_boundary), ("arl_follow_start", vllm_follow.start),
               ("arl_follow_report", vllm_follow.report), ("arl_follow_stop", vllm_follow.stop))  # fmt: skip
    for name, method in methods:
        if getattr(EngineCore, name, None) is not method:
            setattr(EngineCore, name, method)


def arl_swap_boundary(core: Any, version: int, label: str) -> dict[str, Any]:
    """Queue the in-place load of ``version`` on the steps' stream and label the steps scheduled from now on (module
    docstring: ``boundary``). Answers the core's ``time.monotonic()`` when done (``changed``), the workers' host
    seconds to queue the load (``load_s``) and the GPU seconds of the last load before this one that has finished
    (``gpu_s``, None when none). A load that fails leaves the old weights and the label."""
    relabel = getattr(core.scheduler, "arl_relabel", None)
    if relabel is None:
        raise RuntimeError("vllm.swap='boundary' needs the project's scheduler (its step labels): leave "
                           "vllm.engine_args.scheduler_cls unset")  # fmt: skip
    asked = time.monotonic()
    results = core.collective_rpc("arl_apply_ordered", args=(version,))
    relabel(label)
    if hasattr(core, "set_weight_version"):  # vLLM's own labels (0.27+) kept in step, for another mode's requests
        core.set_weight_version(label)
    changed = time.monotonic()
    gpu = [r["gpu_s"] for r in results if r["gpu_s"] is not None]
    return {"asked": asked, "changed": changed, "load_s": max(float(r["s"]) for r in results),
            "gpu_s": max(gpu) if gpu else None}  # fmt: skip


def arl_swap(core: Any, version: int, label: str) -> Future:
    """Pause (keeping requests and KV cache), load ``version`` in every worker once idle, label, answer, resume.

    The answer: the core's ``time.monotonic()`` when asked (``asked``), idle (``still``), loaded (``loaded``) and
    labelled (``changed``), and the workers' load seconds (``load_s``). A failed load resumes the old weights and
    answers the error."""
    asked = time.monotonic()
    done: Future = Future()

    def swap(_: Any = None) -> None:
        still = time.monotonic()
        try:
            load_s = core.collective_rpc("arl_apply_staged", args=(version,))[0]
            loaded = time.monotonic()
            if hasattr(core, "set_weight_version"):  # vLLM's own labels (0.27+): the steps from now on
                core.set_weight_version(label)
            relabel = getattr(core.scheduler, "arl_relabel", None)
            if relabel is not None:  # the scheduler's (vllm_step_labels.py), for a later swap at the step boundary
                relabel(label)
            changed = time.monotonic()
        except BaseException as exc:
            try:
                resume()
            finally:  # answered whatever the resume did: the engine's process is waiting for it
                done.set_exception(exc)
            return
        # Answered before resuming: vLLM queues the answer now (the future's callback), ahead of the new weights' steps.
        done.set_result({"asked": asked, "still": still, "loaded": loaded, "changed": changed, "load_s": float(load_s)})
        resume()

    def resume() -> None:
        core.resume_scheduler()
        # Called from vLLM's idle callbacks, the busy loop goes on to wait for the next request, with the requests
        # resumed here left waiting (0.25.1 to 0.32: a generation stood still until another request came). A wake-up
        # request ends that wait; handled anywhere else, it does nothing.
        queue = getattr(core, "input_queue", None)
        if queue is not None:
            from vllm.v1.engine import EngineCoreRequestType

            queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    paused = core.pause_scheduler(mode="keep", clear_cache=False)
    if paused is None:  # idle already
        swap()
    else:
        paused.add_done_callback(swap)
    return done


async def swap_in_core(llm: Any, labels: Any, version: int) -> tuple[float, float, float]:
    """``vllm.swap="core"``: ask the engine core of ``llm`` (an ``AsyncLLM``) for :data:`METHOD`; ``labels`` (the
    engine's labeller) learns the change's time."""
    label = str(version)
    labels.expect()
    try:
        r: dict[str, float] = await llm.engine_core.call_utility_async(METHOD, version, label)
    except BaseException:
        labels.abandon()
        raise
    labels.resolve(r["changed"], label)
    now = time.perf_counter()
    return now - (r["changed"] - r["still"]), now - (r["changed"] - r["loaded"]), r["load_s"]


async def swap_at_boundary(llm: Any, labels: Any, version: int) -> tuple[float, float, float]:
    """``vllm.swap="boundary"``: ask the engine core of ``llm`` for :data:`BOUNDARY_METHOD`. Nothing stands still
    on the host: the pause returned is the GPU time of the last load known to have finished (this one's is known at
    the next swap), the time decoding stood still for it. The scheduler labels the steps; ``labels`` (the engine's
    other labeller) learns the change too, as for ``core``, so that it stays right for a later swap of another mode.
    """
    labels.expect()
    try:
        r: dict[str, Any] = await llm.engine_core.call_utility_async(BOUNDARY_METHOD, version, str(version))
    except BaseException:
        labels.abandon()
        raise
    labels.resolve(r["changed"], str(version))
    now = time.perf_counter()
    return now - float(r["gpu_s"] or 0.0), now, float(r["load_s"])


async def swap_by_pause(llm: Any, labels: Any, version: int) -> tuple[float, float, float]:
    """``vllm.swap="pause"``: pause, load, relabel, resume, each asked from here."""
    await pause_keep(llm)
    still = time.perf_counter()
    try:
        load_s = (await llm.collective_rpc("arl_apply_staged", args=(version,)))[0]
        loaded = time.perf_counter()
        await labels.set(str(version))  # loaded, not yet resumed: vllm_compat's docstring (labels)
    finally:
        await llm.resume_generation()
    return still, loaded, float(load_s)


SWAPS = {"pause": swap_by_pause, "core": swap_in_core, "boundary": swap_at_boundary}
"""The swap of each ``vllm.swap``."""
