"""The scheduler's weight-version labels (actors/generator/vllm_step_labels.py): each step labelled when it was
scheduled, spans on a request's last output, taken out again in the engine's process. vLLM's own output types; the
whole engine runs them in test_vllm_engine.py (the mid-sequence swap, ``vllm.swap="boundary"``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from actors.generator.vllm_step_labels import SPANS_KEY, CoreSpans, StepLabels

pytestmark = pytest.mark.vllm


def _outputs(rids: list[str], step: int, finished: set[str] = frozenset()) -> dict[int, Any]:  # type: ignore[assignment]
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    return {0: EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id=rid, new_token_ids=[step], finish_reason=FinishReason.LENGTH if rid in finished
                         else None) for rid in rids])}  # fmt: skip


class _Base:
    """What the mixin needs of vLLM's scheduler: steps scheduled, their outputs later, in order."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {rid: None for rid in "abcxyz"}
        self.aborted: list[Any] = []

    def schedule(self) -> Any:
        return SimpleNamespace()

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        for out in model_runner_output[0].outputs:  # vLLM frees a finished request before its outputs go out
            if out.finish_reason is not None:
                self.requests.pop(out.request_id, None)
        return model_runner_output

    def finish_requests(self, request_ids: Any, status: Any) -> list:
        self.aborted.append(request_ids)
        return []


def _scheduler() -> Any:
    return type("Labelled", (StepLabels, _Base), {})()


def test_a_step_launched_before_the_relabel_keeps_the_old_label() -> None:
    """Two steps in flight at a swap (asynchronous scheduling): the one scheduled before it is the old version's,
    though its outputs come back after."""
    s = _scheduler()
    s.arl_relabel("3")
    first = s.schedule()
    s.update_from_output(first, _outputs(["a", "b"], 0))
    second = s.schedule()  # launched before the swap
    s.arl_relabel("4")
    third = s.schedule()
    s.update_from_output(second, _outputs(["a", "b"], 1))
    s.update_from_output(third, _outputs(["a", "b"], 2))
    late = s.schedule()
    out = s.update_from_output(late, _outputs(["a", "b"], 3, finished={"a"}))
    a, b = out[0].outputs
    assert a.kv_transfer_params == {SPANS_KEY: [["3", 0, 2], ["4", 2, 4]]}
    assert b.kv_transfer_params is None  # not finished yet
    end = s.update_from_output(s.schedule(), _outputs(["b"], 4, finished={"b"}))
    assert end[0].outputs[0].kv_transfer_params == {SPANS_KEY: [["3", 0, 2], ["4", 2, 5]]}
    assert s._arl_seen == {} and s._arl_stamps == {}


def test_a_request_started_after_a_swap_has_one_span_and_other_params_stay() -> None:
    s = _scheduler()
    s.arl_relabel("7")
    step = s.schedule()
    outs = _outputs(["c"], 0, finished={"c"})
    outs[0].outputs[0].kv_transfer_params = {"other": 1}
    s.update_from_output(step, outs)
    assert outs[0].outputs[0].kv_transfer_params == {"other": 1, SPANS_KEY: [["7", 0, 1]]}


def test_aborted_requests_are_forgotten() -> None:
    s = _scheduler()
    s.update_from_output(s.schedule(), _outputs(["x", "y", "z"], 0))
    s.finish_requests(iter(["x"]), None)  # an iterable vLLM's own method consumes
    assert s.aborted == [["x"]] and set(s._arl_seen) == {"y", "z"}
    s.finish_requests(None, None)
    assert s._arl_seen == {}


def test_the_front_end_takes_the_spans_out_before_vllm_builds_the_output() -> None:
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    seen: list[Any] = []
    processor = SimpleNamespace(request_states={"a-1234": SimpleNamespace(external_req_id="a")},
                                process_outputs=lambda outputs, *args, **kw: seen.extend(outputs))  # fmt: skip
    spans = CoreSpans(SimpleNamespace(output_processor=processor))
    final = EngineCoreOutput(request_id="a-1234", new_token_ids=[1], finish_reason=FinishReason.LENGTH,
                             kv_transfer_params={SPANS_KEY: [["3", 0, 2], ["4", 2, 6]]})  # fmt: skip
    processor.process_outputs([final], 12.0)
    assert seen == [final] and final.kv_transfer_params is None
    assert spans.spans("a", SimpleNamespace(token_ids=[0] * 5)) == [("3", 0, 2), ("4", 2, 5)]  # cut to the tokens
    assert spans.spans_by_request == {}


def test_a_request_gone_without_a_last_output_is_forgotten() -> None:
    """The guard the logprobs hold has too: once more requests are counted than live, the counts of those no longer
    live are dropped at the next step."""
    s = _scheduler()
    s.requests = {"x": None, "y": None}
    s.update_from_output(s.schedule(), _outputs(["x", "y"], 0))
    del s.requests["x"]  # freed by vLLM without an output or an abort here
    s.update_from_output(s.schedule(), _outputs(["y"], 1))
    assert set(s._arl_seen) == {"y"}
