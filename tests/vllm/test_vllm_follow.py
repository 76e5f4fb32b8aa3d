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


async def test_each_version_in_use_is_reported_once_with_its_copy_and_logged_by_the_generator(caplog) -> None:
    """The front end's mode logs each version's copy and swap; here the engine core does both, and its log lines
    would stay in its process: its report carries them and the generator's process logs one line a version."""
    import logging
    from types import MethodType

    from actors.generator.core_follow import CoreFollow
    from actors.generator.vllm_follow import CoreStage

    worker = _Worker()
    f, core = _follower(worker)
    f.copy_here = MethodType(lambda self, manifest: {  # what the worker's arl_copy_ipc answers
        "sums": [7], "copied_at": 1.0, "s": 0.031, "copy_s": 0.022, "prepare_s": 0.006, "load": "replay"}, f)
    stage = CoreStage(f)
    for v in (1, 2, 3):
        await stage._copy(SimpleNamespace(version=v))
        stage.stage_copied(v)
        if v != 2:  # version 2 is overtaken by 3 before a step: one line, for 3
            f.apply_ready(core.scheduler)
    f.mark_ready(4)  # a host version (stage_host): ready with no copy
    f.apply_ready(core.scheduler)
    r = f.report()
    assert [v["version"] for v in r["versions"]] == [1, 3, 4] and f.report()["versions"] == []
    assert r["versions"][1]["copy"]["copy_s"] == 0.022 and r["versions"][2]["copy"] is None
    assert all(v["waited_s"] >= 0 for v in r["versions"]) and f.copies == {} and f._ready_at == {}

    class _Engine:
        version = -1

        async def core_call(self, method: str) -> dict[str, Any]:
            return {**r, "swaps": [], "pauses": [], "staged_latencies": [], "alive": True}

        def note_core_swaps(self, swaps: list, pauses: list) -> None:
            pass

    caplog.set_level(logging.INFO, logger="actors.generator.core_follow")
    await CoreFollow(_Engine(), GeneratorConfig(engine="vllm")).poll()
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 3 and lines[2].startswith("vLLM engine core: version 4 staged from the host, in use")
    assert "version 3 copied from the learner's GPU in" in lines[1] and "copy and checksums 0.022" in lines[1]
