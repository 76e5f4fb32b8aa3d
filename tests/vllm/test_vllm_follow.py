"""The engine core's follower (actors/generator/vllm_follow.py) between its thread and the core's: versions marked
ready loaded at once or after the step being launched, never waiting for the staging in the core's thread, a load
that fails, each version's record. The core and its worker are stand-ins with what the follower uses of them; a real
engine core follows versions in test_vllm_generator.py."""

from __future__ import annotations

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
                           scheduler=_Scheduler())  # fmt: skip
    return CoreFollower(core, to_dict(GeneratorConfig(engine="vllm"))), core


def test_a_version_marked_ready_is_loaded_at_once_unless_a_step_is_being_launched() -> None:
    worker = _Worker()
    f, core = _follower(worker)
    f.mark_ready(1)  # an idle core, or one waiting for its GPU: loaded now, from the follower's thread
    assert worker.loaded == [1] and core.scheduler.labels == ["1"] and f.applied == 1
    f.before_schedule(core.scheduler)  # a step is being scheduled and launched: nothing loads under it
    f.mark_ready(2)
    f.mark_ready(3)
    assert worker.loaded == [1] and core.scheduler.labels == ["1"]
    f.launched()  # its forward and logits queued: the newest version ready loads after them, once
    assert worker.loaded == [1, 3] and core.scheduler.labels == ["1", "3"] and f.applied == 3
    f.before_schedule(core.scheduler)
    f.launched()  # nothing ready
    f.mark_ready(3)  # not newer than the version in use
    assert worker.loaded == [1, 3]
    r = f.report()
    assert [v for v, _ in r["swaps"]] == [1, 3] and r["pauses"] == [0.004] and r["version"] == 3
    assert f.report()["swaps"] == []  # taken


def test_a_version_waiting_for_the_staging_is_loaded_before_the_next_step_or_after_the_copy() -> None:
    """The core's thread never waits for the staging lock (a copy holds it for its whole length)."""
    worker = _Worker()
    f, core = _follower(worker)
    f.before_schedule(core.scheduler)
    f.mark_ready(1)
    with f.lock:  # a copy under way when the step's launch returns: the core goes on without loading
        f.launched()
        assert worker.loaded == []
    f.before_schedule(core.scheduler)  # loaded before the next step, which it labels
    assert worker.loaded == [1] and core.scheduler.labels == ["1"]
    f.launched()
    f.before_schedule(core.scheduler)
    f.mark_ready(2)
    with f.lock:
        f.launched()
    f._apply_waiting()  # as the copy's end does, in the follower's thread: an idle core would wait for no step
    assert worker.loaded == [1, 2]


def test_a_load_that_fails_keeps_the_old_weights_and_is_reported() -> None:
    worker = _Worker(fail={2})
    f, core = _follower(worker)
    f.mark_ready(1)
    f.mark_ready(2)
    assert f.applied == 1 and core.scheduler.labels == ["1"]
    r = f.report()
    assert r["failures"] == 1 and "version 2" in r["load_error"] and r["version"] == 1
    f.mark_ready(3)  # the next version loads
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
        if v == 2:  # version 2 is made ready while a step is launched, then overtaken by 3: one line, for 3
            f.before_schedule(core.scheduler)
        await stage._copy(SimpleNamespace(version=v))
        stage.stage_copied(v)
        if v == 3:
            f.launched()
    f.mark_ready(4)  # a host version (stage_host): ready with no copy
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


def test_the_follower_runs_with_vllms_v1_model_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's V2 model runner (its default for dense models) computes a step's logits in sample_tokens, after a load
    the follower may queue once the step's execute_model returned: the follower's engine runs the V1 one, and a user's
    explicit V2 is refused, naming both ways out."""
    import os

    from actors.generator.vllm_compat import prepare_engine_processes

    for key in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_MSGPACK_ZERO_COPY_THRESHOLD"):
        monkeypatch.setenv(key, "x")  # recorded: what prepare_engine_processes sets is undone after
        monkeypatch.delenv(key)
    prepare_engine_processes(on_cuda=False, worker_in_core=True)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="V1 model runner.*unset VLLM_USE_V2_MODEL_RUNNER, or use vllm.follow='front'"):
        prepare_engine_processes(on_cuda=False, worker_in_core=True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    prepare_engine_processes(on_cuda=False)  # the front end's follower: vLLM's choice stays
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_a_launch_that_returned_while_the_follower_held_the_staging_leaves_the_version_to_it() -> None:
    """The core's thread found the staging lock taken as its launch returned (the follower was just looking at the
    launch window): the follower, on letting the lock go, loads the version itself; none stays ready for good."""
    import threading

    worker = _Worker()
    f, core = _follower(worker)
    f.before_schedule(core.scheduler)
    seen, go_on = threading.Event(), threading.Event()
    real_state = f._state

    class _Watched:  # the follower's second look at the window waits until the core's launch has returned
        def __enter__(self) -> None:
            real_state.acquire()

        def __exit__(self, *exc: object) -> None:
            real_state.release()
            if threading.current_thread() is not threading.main_thread() and not seen.is_set():
                seen.set()
                go_on.wait(5)

    f._state = _Watched()  # type: ignore[assignment]
    f.ready = 1
    t = threading.Thread(target=f._apply_waiting)
    t.start()
    assert seen.wait(5)  # the follower holds the staging lock and saw the step being launched
    f.launched()  # the core: the window ends, the staging lock is taken: it goes on
    assert worker.loaded == []
    go_on.set()
    t.join(5)
    assert worker.loaded == [1] and f.ready is None
