"""vLLM 0.25.1's weight-version labels kept by the front end (actors/generator/vllm_compat.py): each batch of outputs
takes the label in force when the engine core's step ended, on the one monotonic clock of the host. The labels
across a real swap are checked exactly against a replay in tests/vllm/test_vllm_engine.py; here, the boundary."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from actors.generator.vllm_compat import LABELS_KEPT, FrontLabels


class _Processor:
    """The two things of vLLM's output processor the labels touch: ``process_outputs`` and ``request_states``."""

    def __init__(self) -> None:
        self.request_states: dict[str, SimpleNamespace] = {}
        self.calls: list[float | None] = []

    def process_outputs(self, outputs, engine_core_timestamp=None, stats=None):  # type: ignore[no-untyped-def]
        self.calls.append(engine_core_timestamp)
        for out in outputs:
            self.request_states[out.request_id].tokens += len(out.new_token_ids)


def _state(rid: str) -> SimpleNamespace:
    state = SimpleNamespace(external_req_id=rid, tokens=0)
    state.detokenizer = SimpleNamespace(num_output_tokens=lambda: state.tokens)
    return state


def test_a_batch_takes_the_label_in_force_when_its_step_ended_not_when_it_is_processed() -> None:
    processor = _Processor()
    labels = FrontLabels(SimpleNamespace(output_processor=processor), "1")
    processor.request_states["r"] = _state("r")
    out = SimpleNamespace(request_id="r", new_token_ids=[7, 8])
    ended_before = time.monotonic()  # a step of version 1 that ended before the pause...
    asyncio.run(labels.set("2"))  # ...paused, loaded, relabelled...
    processor.process_outputs([out], ended_before)  # ...and its outputs processed only now: still version 1
    processor.process_outputs([out], time.monotonic())  # a step after the resume
    processor.process_outputs([out], None)  # no engine time: the label in force
    assert processor.calls[-1] is None
    assert labels.spans("r", SimpleNamespace(token_ids=list(range(6)))) == [("1", 0, 2), ("2", 2, 6)]


def test_only_the_last_changes_are_kept_and_an_older_batch_takes_the_oldest() -> None:
    labels = FrontLabels(SimpleNamespace(output_processor=_Processor()), "0")
    t0 = time.monotonic()
    for v in range(1, LABELS_KEPT + 5):
        asyncio.run(labels.set(str(v)))
    assert len(labels.changes) == LABELS_KEPT
    assert labels.label_at(t0) == labels.changes[0][1] == "5"
    assert labels.label_at(time.monotonic()) == labels.label == str(LABELS_KEPT + 4)


def test_a_swap_the_engine_core_made_is_placed_by_its_time_also_for_outputs_processed_before_its_answer() -> None:
    processor = _Processor()
    labels = FrontLabels(SimpleNamespace(output_processor=processor), "1")
    for rid in ("r", "q"):
        processor.request_states[rid] = _state(rid)
    r, q = (SimpleNamespace(request_id=rid, new_token_ids=[5, 6]) for rid in ("r", "q"))
    processor.process_outputs([r], time.monotonic())  # before the swap is asked for: version 1
    labels.expect()  # the engine core is asked (vllm_swap.swap_in_core)
    processor.process_outputs([r], time.monotonic())  # a step of the old weights that ended meanwhile
    changed = time.monotonic()  # the core loaded version 2 and answered
    processor.process_outputs([r, q], time.monotonic())  # new weights' steps, processed before the answer...
    assert labels.label == "1" and labels.pending is not None  # ...labelled 1 for now, and kept aside
    labels.resolve(changed, "2")  # the answer, with the core's time of the change
    processor.process_outputs([r, q], time.monotonic())
    assert labels.pending is None and labels.label == "2"
    assert labels.spans("r", SimpleNamespace(token_ids=list(range(8)))) == [("1", 0, 4), ("2", 4, 8)]
    assert labels.spans("q", SimpleNamespace(token_ids=list(range(4)))) == [("2", 0, 4)]  # no empty span of 1


def test_a_swap_that_failed_changes_nothing_and_spans_wait_for_an_unplaced_one() -> None:
    async def run() -> None:
        processor = _Processor()
        labels = FrontLabels(SimpleNamespace(output_processor=processor), "1")
        processor.request_states["r"] = _state("r")
        labels.expect()
        waiter = asyncio.create_task(labels.settled())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # a request's spans are taken only once the change is placed
        processor.process_outputs([SimpleNamespace(request_id="r", new_token_ids=[3])], time.monotonic())
        labels.abandon()  # the load failed: the old weights went on
        await asyncio.wait_for(waiter, 1.0)
        assert labels.label == "1" and labels.spans("r", SimpleNamespace(token_ids=[3])) == [("1", 0, 1)]

    asyncio.run(run())
