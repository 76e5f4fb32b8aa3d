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
