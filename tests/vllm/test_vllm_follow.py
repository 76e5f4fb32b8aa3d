"""The engine core's follower (actors/generator/vllm_follow.py) between its thread and the core's: versions marked
ready, applied before a step or from vLLM's idle callbacks, a load that fails. The core and its worker are stand-ins
with what the follower uses of them; a real engine core follows versions in test_vllm_generator.py."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any

import pytest

from actors.generator.config import GeneratorConfig
from actors.generator.vllm_follow import CoreFollower
from async_rl.config.configurable import to_dict

pytestmark = pytest.mark.vllm


class _Worker:
    def __init__(self, fail: set[int] | None = None) -> None:
        self.loaded: list[int] = []
        self.fail = fail or set()

    def arl_apply_ordered(self, version: int) -> dict[str, Any]:
        if version in self.fail:
            raise RuntimeError(f"weight version {version} is not staged in the worker")
        self.loaded.append(version)
        return {"s": 0.001, "gpu_s": 0.004 if len(self.loaded) > 1 else None}


class _Scheduler:
    def __init__(self) -> None:
        self.labels: list[str] = []

    def arl_relabel(self, label: str) -> None:
        self.labels.append(label)


def _follower(worker: _Worker) -> tuple[CoreFollower, Any]:
    core = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)),
                           _idle_state_callbacks=[], input_queue=queue.Queue(), scheduler=_Scheduler())  # fmt: skip
    return CoreFollower(core, to_dict(GeneratorConfig(engine="vllm"))), core


def test_the_newest_ready_version_is_applied_once_from_the_idle_callback() -> None:
    worker = _Worker()
    f, core = _follower(worker)
    f.mark_ready(1)
    f.mark_ready(2)  # before the core ran: one callback armed, two wake-ups
    assert len(core._idle_state_callbacks) == 1 and core.input_queue.qsize() == 2
    core._idle_state_callbacks.pop()(core)
    assert worker.loaded == [2] and core.scheduler.labels == ["2"] and f.applied == 2
    f.apply_ready(core.scheduler)  # the next step finds nothing ready
    f.mark_ready(2)  # not newer than the version in use
    f.apply_ready(core.scheduler)
    assert worker.loaded == [2]
    f.mark_ready(3)  # a busy core: applied before its next step; the armed callback finds nothing left
    f.apply_ready(core.scheduler)
    core._idle_state_callbacks.pop()(core)
    assert worker.loaded == [2, 3] and core.scheduler.labels == ["2", "3"]
    r = f.report()
    assert [v for v, _ in r["swaps"]] == [2, 3] and r["pauses"] == [0.004] and r["version"] == 3
    assert f.report()["swaps"] == []  # taken


def test_a_load_that_fails_keeps_the_old_weights_and_is_reported() -> None:
    worker = _Worker(fail={2})
    f, core = _follower(worker)
    f.mark_ready(1)
    f.apply_ready(core.scheduler)
    f.mark_ready(2)
    f.apply_ready(core.scheduler)
    assert f.applied == 1 and core.scheduler.labels == ["1"]
    r = f.report()
    assert r["failures"] == 1 and "version 2" in r["load_error"] and r["version"] == 1
    f.mark_ready(3)  # the next version loads
    f.apply_ready(core.scheduler)
    assert f.applied == 3 and worker.loaded == [1, 3]
