"""Weight-version labels kept by vLLM's scheduler, step by step (``vllm.swap="boundary"``, :mod:`.vllm_swap`).

A swap at the engine core's step boundary loads the new version on the GPU stream the steps run on, between the
last step scheduled before it and the first scheduled after, without pausing: a step already launched (vLLM's
asynchronous scheduling keeps up to two in flight) still ran on the old weights when its outputs come back after the
swap. Neither vLLM's own labels (0.27+: outputs labelled by when the core processed them) nor the engine's
(:class:`~actors.generator.vllm_compat.FrontLabels`: by when the step ended) can tell that; the scheduler can, and
does here: :class:`StepLabels` stamps each step with the label current when it was scheduled, counts each request's
output tokens as they come, notes where its label changed, and puts the spans into its last output
(``kv_transfer_params[SPANS_KEY]``: vLLM passes that field from a request's last engine output to its
``RequestOutput``; this project uses no KV connector). :class:`CoreSpans` takes them out again in the engine's
process before anyone else sees them.
"""

from __future__ import annotations

import sys
from typing import Any

SPANS_KEY = "arl_spans"
"""The key of ``kv_transfer_params`` the spans travel under: ``[[label, start, end], ...]``."""
STAMPS_KEPT = 64
"""Steps whose label is kept until their outputs come back (vLLM has at most a few in flight: a guard)."""


class RequestLabels:
    """One request's output tokens so far and its ``[label, start]`` marks."""

    __slots__ = ("count", "marks")

    def __init__(self) -> None:
        self.count = 0
        self.marks: list[list[Any]] = []

    def add(self, label: str, n: int) -> None:
        if not self.marks or self.marks[-1][0] != label:
            self.marks.append([label, self.count])
        self.count += n

    def spans(self) -> list[list[Any]]:
        ends = [start for _, start in self.marks[1:]] + [self.count]
        return [[label, start, end] for (label, start), end in zip(self.marks, ends, strict=True) if end > start]


def label_outputs(outputs: dict[int, Any], label: str, seen: dict[str, RequestLabels]) -> None:
    """Every engine core output of one step (client index -> ``EngineCoreOutputs``) counted under ``label``; a
    request's last output gets its spans."""
    for batch in outputs.values():
        for out in batch.outputs:
            rid = out.request_id
            mine = seen.get(rid)
            if mine is None:
                mine = seen[rid] = RequestLabels()
            if out.new_token_ids:
                mine.add(label, len(out.new_token_ids))
            if out.finish_reason is not None:
                del seen[rid]
                params = dict(out.kv_transfer_params or {})
                params[SPANS_KEY] = mine.spans()
                out.kv_transfer_params = params


def request_id_list(request_ids: Any) -> list[str] | None:
    """What vLLM's scheduler's ``finish_requests`` takes (an id, ids of any iterable, None: all) as a list, so that
    it can be read again after vLLM's own method consumed it."""
    if request_ids is None:
        return None
    return [request_ids] if isinstance(request_ids, str) else list(request_ids)


def forget(kept: dict[str, Any] | None, ids: list[str] | None) -> None:
    """Drop what a scheduler mix-in ``kept`` for requests ``ids`` (None: all), which ended without a last output."""
    if kept:
        for rid in list(kept) if ids is None else ids:
            kept.pop(rid, None)


def forget_gone(kept: dict[str, Any], requests: dict[str, Any]) -> None:
    """A guard: what was kept for a request no longer live, which ended without an output here (none known)."""
    if len(kept) > len(requests):
        for rid in [r for r in kept if r not in requests]:
            del kept[rid]


class StepLabels:
    """Mixed in before vLLM's scheduler class (module docstring). :meth:`arl_relabel` is called by the engine core's
    swap (:func:`~actors.generator.vllm_swap.arl_swap_boundary`) in the core's own thread, between steps, or by the
    engine core's follower (:mod:`.vllm_follow`), in its thread too, never between a step's schedule and launch."""

    _arl_label: str
    _arl_stamps: dict[int, tuple[Any, str]]
    _arl_seen: dict[str, RequestLabels]
    requests: dict[str, Any]

    def arl_relabel(self, label: str) -> None:
        """The steps scheduled from now on run on the weights labelled ``label``."""
        self._arl_label = label

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        follow = sys.modules.get("actors.generator.vllm_follow")  # imported where an engine core follows versions
        follower = None if follow is None else follow.FOLLOWER
        if follower is not None:
            follower.before_schedule(self)  # a version it has ready: loaded before this step, which it labels
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        stamps = self.__dict__.setdefault("_arl_stamps", {})
        stamps[id(out)] = (out, self.__dict__.get("_arl_label", "-1"))  # the object kept: its id stays its own
        while len(stamps) > STAMPS_KEPT:
            del stamps[next(iter(stamps))]
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        stamp = self.__dict__.get("_arl_stamps", {}).pop(id(scheduler_output), None)
        label = stamp[1] if stamp is not None else self.__dict__.get("_arl_label", "-1")
        seen = self.__dict__.setdefault("_arl_seen", {})
        label_outputs(outputs, label, seen)
        forget_gone(seen, self.requests)
        return outputs

    def finish_requests(self, request_ids: Any, *args: Any, **kwargs: Any) -> Any:
        """Aborted requests end without a last output: forget their counts."""
        ids = request_id_list(request_ids)
        result = super().finish_requests(ids, *args, **kwargs)  # type: ignore[misc]
        forget(self.__dict__.get("_arl_seen"), ids)
        return result


class CoreSpans:
    """The engine's process side: each request's spans taken out of its last output as vLLM's front end processes
    it (so ``RequestOutput.kv_transfer_params`` is left as vLLM would have it), by external request id."""

    spans_by_request: dict[str, list[tuple[str, int, int]]]

    def __init__(self, llm: Any) -> None:
        self.spans_by_request = {}
        processor = llm.output_processor
        process_outputs = processor.process_outputs

        def taking_process_outputs(outputs: Any, *args: Any, **kwargs: Any) -> Any:
            for out in outputs:
                params = out.kv_transfer_params
                if out.finish_reason is None or not params or SPANS_KEY not in params:
                    continue
                state = processor.request_states.get(out.request_id)
                spans = params.pop(SPANS_KEY)
                if not params:
                    out.kv_transfer_params = None
                if state is not None:
                    self.spans_by_request[state.external_req_id] = [(str(a), int(b), int(c)) for a, b, c in spans]
            return process_outputs(outputs, *args, **kwargs)

        processor.process_outputs = taking_process_outputs  # an instance attribute: looked up at every call

    def spans(self, rid: str, output: Any) -> list[tuple[str, int, int]]:
        """``rid``'s spans, cut to the tokens its completion holds."""
        n = len(output.token_ids)
        got = self.spans_by_request.pop(rid, [])
        return [(label, start, min(end, n)) for label, start, end in got if start < n]

    def forget(self, rid: str) -> None:
        self.spans_by_request.pop(rid, None)
