"""The scheduler that sends a request's logprobs and routes with its last output (actors/generator/vllm_scheduler.py):
vLLM's own output types, step by step as its scheduler makes them; the whole engine runs it in test_vllm_engine.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from actors.generator.vllm_scheduler import SCHEDULER_CLS, HoldUntilFinal, hold_until_final, scheduler_class
from actors.generator.vllm_step_labels import StepLabels

pytestmark = pytest.mark.vllm

LAYERS, TOP_K = 3, 2


def _step_output(rid: str, step: int, *, routes_rows: int = 1, finished: bool = False):  # type: ignore[no-untyped-def]
    """What vLLM's scheduler makes for one request in one step: a sampled token, its logprob row, its routes."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.outputs import LogprobsLists

    token = 10 + step
    logprobs = LogprobsLists(np.array([[token]], dtype=np.int32), np.array([[-0.5 - step]], dtype=np.float32),
                             np.array([1 + step % 3], dtype=np.int32))  # fmt: skip
    routes = np.arange(routes_rows * LAYERS * TOP_K, dtype=np.uint8).reshape(routes_rows, LAYERS, TOP_K) + step
    return EngineCoreOutput(request_id=rid, new_token_ids=[token], new_logprobs=logprobs, routed_experts=routes,
                            finish_reason=FinishReason.LENGTH if finished else None)  # fmt: skip


def _request(kind: str, stop: list[str] | None = None) -> SimpleNamespace:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SimpleNamespace(sampling_params=SamplingParams(output_kind=RequestOutputKind[kind], stop=stop))


def _run(steps: int, requests: dict[str, SimpleNamespace]) -> tuple[list[list], dict[str, list]]:
    """``steps`` steps of every request (the first with 4 prompt rows of routes, the last finishing); what went out
    each step, and every request's outputs as vLLM made them (before the hold)."""
    from vllm.v1.engine import EngineCoreOutputs

    held: dict = {}
    sent: list[list] = []
    made: dict[str, list] = {rid: [] for rid in requests}
    live = dict(requests)
    for step in range(steps):
        outs = [_step_output(rid, step, routes_rows=4 if step == 0 else 1, finished=step == steps - 1) for rid in live]
        for o in outs:
            made[o.request_id].append(_step_output(o.request_id, step, routes_rows=4 if step == 0 else 1))
        if step == steps - 1:
            live.clear()  # vLLM frees a finished request before its outputs go out
        hold_until_final({0: EngineCoreOutputs(outputs=outs)}, live, held)
        sent.append(outs)
    assert held == {}
    return sent, made


def test_a_final_only_request_gets_everything_with_its_last_output() -> None:
    sent, made = _run(5, {"final": _request("FINAL_ONLY")})
    for outs in sent[:-1]:
        (out,) = outs
        assert out.new_token_ids and out.new_logprobs is None and out.routed_experts is None  # tokens still go out
    (last,) = sent[-1]
    rows = made["final"]
    for i, name in enumerate(("logprob_token_ids", "logprobs", "sampled_token_ranks")):
        want = np.concatenate([o.new_logprobs[i] for o in rows])
        assert np.array_equal(getattr(last.new_logprobs, name), want), name
        assert getattr(last.new_logprobs, name).dtype == want.dtype
    assert last.new_logprobs.logprobs.shape == (5, 1)
    want_routes = np.concatenate([o.routed_experts for o in rows])
    assert last.routed_experts.shape == (4 + 4, LAYERS, TOP_K) and np.array_equal(last.routed_experts, want_routes)


def test_the_front_end_builds_the_same_logprobs_from_one_final_output() -> None:
    """vLLM's own logprobs processor, fed per step (as before) and fed once at the end (now): the same rows."""
    from vllm.logprobs import create_sample_logprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor

    sent, made = _run(6, {"final": _request("FINAL_ONLY")})

    def processed(outputs: list) -> tuple[list, list, list, float]:
        proc = LogprobsProcessor(tokenizer=None, logprobs=create_sample_logprobs(True), prompt_logprobs=None,
                                 cumulative_logprob=0.0, num_logprobs=0, num_prompt_logprobs=None)  # fmt: skip
        for out in outputs:
            proc.update_from_output(out)
        flat = proc.logprobs
        return list(flat.token_ids), list(flat.logprobs), list(flat.ranks), proc.cumulative_logprob

    per_step = processed(made["final"])
    at_end = processed([outs[0] for outs in sent])
    assert per_step == at_end and len(per_step[1]) == 6


def test_streaming_and_stop_string_requests_are_left_as_vllm_sends_them() -> None:
    sent, _ = _run(3, {"delta": _request("DELTA"), "cumulative": _request("CUMULATIVE"),
                       "stops": _request("FINAL_ONLY", stop=["\n"])})  # fmt: skip
    for outs in sent:
        for out in outs:
            assert out.new_logprobs is not None and out.new_logprobs.logprobs.shape == (1, 1)
            assert out.routed_experts is not None


def test_the_scheduler_class_is_vllms_own_with_the_hold_and_the_step_labels_mixed_in() -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert resolve_obj_by_qualname(SCHEDULER_CLS).__name__ == "ArlScheduler"
    for asynchronous, base in ((True, AsyncScheduler), (False, Scheduler)):
        cls = scheduler_class(asynchronous)
        assert issubclass(cls, base) and cls.__mro__[1:3] == (StepLabels, HoldUntilFinal)
        assert scheduler_class(asynchronous) is cls
