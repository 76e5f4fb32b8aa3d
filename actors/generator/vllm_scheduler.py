"""vLLM's scheduler, sending each request's logprobs and routes once, with its last output.

vLLM sends every running request's new logprobs (three small arrays: token ids, logprobs, ranks) and routed experts
(one array) with every step's outputs: the engine core slices and encodes, the front end decodes and appends about
four arrays per request per step. At 512 sequences of moe-5b on one H100 that work paced decoding: the project's
engine made 13.3k tokens/s where plain ``LLM.generate`` (no logprobs, no routes) made 42.2k
(docs/benchmarks/generate-h100x1-moe-5b-per-step-2026-11-28.json); on the CPU (vLLM 0.32, 512 sequences), asking for
the sampled token's logprob took the front end's CPU time from 0.29-0.35 s to 0.81-1.44 s (0.30-0.49 s held here).

The generator asks for final outputs only (``RequestOutputKind.FINAL_ONLY``), so nothing reads those arrays before a
request finishes. This scheduler keeps them in the engine core instead and puts them, concatenated, into the
request's last output; the front end's output processor appends a request's logprob rows and routes chunks as they
come, so the ``RequestOutput`` it builds is the same, rows and all. Token ids still go out with every step: the
front end's weight-version labels count them as they arrive (:mod:`.vllm_compat`). Requests that stream
(``DELTA``, ``CUMULATIVE``) or carry stop strings (the front end can end those itself) are left as vLLM sends them.

vLLM builds it by name in the engine core's process (``scheduler_cls``, :data:`SCHEDULER_CLS`): :class:`ArlScheduler`
builds vLLM's own class for the configuration (``AsyncScheduler`` with asynchronous scheduling, else ``Scheduler``)
with :class:`HoldUntilFinal` and :class:`~actors.generator.vllm_step_labels.StepLabels` (each step's weight version,
for swaps at the step boundary) mixed in before it, and gives the engine core its own swaps (:mod:`.vllm_swap`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actors.generator.vllm_step_labels import StepLabels, forget, forget_gone, request_id_list

SCHEDULER_CLS = "actors.generator.vllm_scheduler.ArlScheduler"
"""The qualified name the engine's arguments give vLLM (``AsyncEngineArgs.scheduler_cls``)."""


class Held:
    """A request's logprob rows and routes chunks, kept until its last output (copies: vLLM may reuse the buffers
    they were sliced from)."""

    __slots__ = ("logprobs", "routes")

    def __init__(self) -> None:
        self.logprobs: list[Any] = []
        self.routes: list[np.ndarray] = []

    def keep(self, out: Any) -> None:
        """Take ``out``'s logprobs and routes (an engine core output), leaving it without them."""
        if out.new_logprobs is not None:
            self.logprobs.append(tuple(np.array(a) for a in out.new_logprobs[:3]))
            out.new_logprobs = None
        if out.routed_experts is not None:
            self.routes.append(np.array(out.routed_experts))
            out.routed_experts = None

    def give(self, out: Any) -> None:
        """Put everything kept, and ``out``'s own, into ``out`` (a request's last output)."""
        from vllm.v1.outputs import LogprobsLists

        if self.logprobs:
            rows = self.logprobs + ([tuple(out.new_logprobs[:3])] if out.new_logprobs is not None else [])
            out.new_logprobs = LogprobsLists(*(np.concatenate(parts) for parts in zip(*rows, strict=True)))
        if self.routes:
            routes = self.routes + ([out.routed_experts] if out.routed_experts is not None else [])
            out.routed_experts = np.concatenate(routes)


def holds(request: Any) -> bool:
    """A request whose logprobs and routes can wait for its last output: final output only, no stop strings."""
    from vllm.sampling_params import RequestOutputKind

    params = getattr(request, "sampling_params", None)
    return params is not None and params.output_kind == RequestOutputKind.FINAL_ONLY and not params.stop


def hold_until_final(outputs: dict[int, Any], requests: dict[str, Any], held: dict[str, Held]) -> None:
    """Every engine core output in ``outputs`` (client index -> ``EngineCoreOutputs``): a held request's logprobs and
    routes into ``held`` until its last output, which gets them all. ``requests``: the scheduler's live requests."""
    for batch in outputs.values():
        for out in batch.outputs:
            rid = out.request_id
            if out.finish_reason is not None:
                mine = held.pop(rid, None)
                if mine is not None:
                    mine.give(out)
            elif rid in held:
                held[rid].keep(out)
            elif (out.new_logprobs is not None or out.routed_experts is not None) and holds(requests.get(rid)):
                held[rid] = mine = Held()
                mine.keep(out)


class HoldUntilFinal:
    """Mixed in before vLLM's scheduler class (module docstring)."""

    _arl_held: dict[str, Held]
    requests: dict[str, Any]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        held = self.__dict__.setdefault("_arl_held", {})
        hold_until_final(outputs, self.requests, held)
        forget_gone(held, self.requests)
        return outputs

    def finish_requests(self, request_ids: Any, *args: Any, **kwargs: Any) -> Any:
        """Aborted requests (the front end's, the engine's; None: all) end without an output: forget what was kept
        for them."""
        ids = request_id_list(request_ids)
        result = super().finish_requests(ids, *args, **kwargs)  # type: ignore[misc]
        forget(self.__dict__.get("_arl_held"), ids)
        return result


_CLASSES: dict[bool, type] = {}


def scheduler_class(asynchronous: bool) -> type:
    """vLLM's scheduler class for the configuration, with :class:`HoldUntilFinal` and the step labels of
    :mod:`.vllm_step_labels` mixed in."""
    if asynchronous not in _CLASSES:
        if asynchronous:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
        else:
            from vllm.v1.core.sched.scheduler import Scheduler as base
        _CLASSES[asynchronous] = type(f"Arl{base.__name__}", (StepLabels, HoldUntilFinal, base), {})
    return _CLASSES[asynchronous]


class ArlScheduler:
    """What ``scheduler_cls`` names: builds :func:`scheduler_class` for the engine's configuration."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from actors.generator.vllm_swap import install

        install()  # the engine core's own swap (vllm.swap="core"): this process is the engine core's
        config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        return scheduler_class(bool(config.scheduler_config.async_scheduling))(*args, **kwargs)
