"""``bench loop`` on one node of four GPUs: which GPU each process gets, and the per-GPU rates of its summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.commands.bench import loop

NODE = ["--json", "x.json", "--model", "moe-5b", "--device", "cuda", "--backend", "megatron", "--learner-nproc", "2",
        "--generators", "2", "--generator-engine", "vllm", "--generator-devices", "cuda:2,cuda:3"]  # fmt: skip


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "_cuda_device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_node_recipe_puts_learner_ranks_on_gpus_0_1_and_each_generator_first_on_its_own(four_gpus: None) -> None:
    args = loop.parse_args(NODE, "bench loop")
    learner, gens = loop.commands(args, args.model, "p", "redis://r", "nats://n", Path("/tmp/run"))
    assert learner[1:5] == ["--standalone", "--nproc-per-node", "2", "-m"] and "backend=megatron" in learner
    assert "model.name=moe-5b" in learner
    assert [g[:2] for g in gens] == [["env", "CUDA_VISIBLE_DEVICES=2,0,1,3"], ["env", "CUDA_VISIBLE_DEVICES=3,0,1,2"]]
    assert all("engine=vllm" in g and "vllm.model.name=moe-5b" in g for g in gens)
    assert [g[g.index("engine=vllm") - 2] for g in gens] == ["generator_id=gen-0", "generator_id=gen-1"]


def test_generator_gpus_count_in_the_benchs_own_visible_devices(four_gpus: None, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the node's four of an eight-GPU host
    args = loop.parse_args(NODE, "bench loop")
    _, gens = loop.commands(args, args.model, "p", "redis://r", "nats://n", Path("/tmp/run"))
    assert [g[1] for g in gens] == ["CUDA_VISIBLE_DEVICES=6,4,5,7", "CUDA_VISIBLE_DEVICES=7,4,5,6"]
    assert loop.gpu_first(1, 2, None) == "1,0"  # the two-GPU recipe (scripts/gpu/vllm.sh) as before


@pytest.mark.parametrize(("devices", "message"), [("cuda:2,cuda:4", "names cuda:4, but 4 GPUs"),
                                                   ("cuda:2,cpu", "each a cuda:N")])  # fmt: skip
def test_generator_devices_beyond_the_node_are_refused(four_gpus: None, devices: str, message: str, capsys) -> None:
    argv = [*NODE[:-1], devices]
    with pytest.raises(SystemExit):
        loop.parse_args(argv, "bench loop")
    assert message in capsys.readouterr().err


def test_per_gpu_rates_divide_by_learner_ranks_and_distinct_generator_gpus(four_gpus: None) -> None:
    args = loop.parse_args(NODE, "bench loop")
    rates = loop.per_gpu_rates({"learner_tokens_per_s": 3000.0, "generator_tokens_per_s": 9000.0}, args)
    assert rates == {"learner_tokens_per_s_per_gpu": 1500.0, "generator_tokens_per_s_per_gpu": 4500.0}
    shared = loop.parse_args([*NODE[:-1], "cuda:2,cuda:2", "--generator", "vllm.tensor_parallel_size=2"], "bench loop")
    rates = loop.per_gpu_rates({"learner_tokens_per_s": 3000.0, "generator_tokens_per_s": 9000.0}, shared)
    assert rates["generator_tokens_per_s_per_gpu"] == 4500.0  # one device, two GPUs under TP=2
    assert loop.per_gpu_rates({"learner_tokens_per_s": None}, args) == {
        "learner_tokens_per_s_per_gpu": None, "generator_tokens_per_s_per_gpu": None}  # fmt: skip
    cpu = loop.parse_args(["--json", "x.json"], "bench loop")
    assert loop.per_gpu_rates({"learner_tokens_per_s": 10.0, "generator_tokens_per_s": 10.0}, cpu) == {
        "learner_tokens_per_s_per_gpu": None, "generator_tokens_per_s_per_gpu": None}  # fmt: skip


def test_split_is_the_learners_busy_rate_over_the_generators() -> None:
    # The node on four H200s, two learner GPUs against two vLLM GPUs (node-h200x4-moe-5b-learner2-gen2-2026-11-27):
    # busy rates 16,710 and 39,160 tokens/s a GPU, so one learner GPU keeps 0.43 generator GPUs busy.
    node = {"learner_tokens_per_s_per_gpu": 11163.2, "generator_tokens_per_s_per_gpu": 16368.2,
            "learner_idle_frac": 0.332, "generator_idle_frac": 0.582}  # fmt: skip
    assert loop.split(node) == pytest.approx(0.4267, abs=1e-3)
    assert loop.split({**node, "generator_idle_frac": 0.0}) == pytest.approx(11163.2 / 0.668 / 16368.2)
    for missing in ({**node, "learner_tokens_per_s_per_gpu": None}, {**node, "generator_idle_frac": None},
                    {**node, "learner_idle_frac": 1.0}, {}):  # the CPU, a side that never worked
        assert loop.split(missing) is None


def test_swap_pause_is_the_median_over_every_swap_the_heartbeats_carry() -> None:
    from async_rl.servers.control import Heartbeat

    events = [(float(s), s, {"train_s": 0.1, "tokens": 10.0}) for s in range(1, 6)]
    every = [Heartbeat(generator_id="g", version=3, sent_at=1.0, swap_pause_ms=50.0, swap_pauses_ms=[10.0, 12.0, 50.0]),
             Heartbeat(generator_id="g", version=4, sent_at=2.0, swap_pause_ms=11.0, swap_pauses_ms=[11.0]),
             Heartbeat(generator_id="g", version=4, sent_at=3.0, swap_pause_ms=11.0)]  # no swap since the last beat
    assert loop.summarize(events, every, 0, 0.0)["swap_pause_ms"] == 11.5
    last_only = [Heartbeat(generator_id="g", version=v, sent_at=float(v), swap_pause_ms=p)
                 for v, p in ((1, 50.0), (2, 50.0), (3, 12.0))]  # an engine that reports only its last pause
    assert loop.summarize(events, last_only, 0, 0.0)["swap_pause_ms"] == 50.0


def test_loop_lag_is_the_median_and_the_largest_of_the_beats_in_the_steady_span() -> None:
    from async_rl.servers.control import Heartbeat

    events = [(float(s), s, {"train_s": 0.1, "tokens": 10.0}) for s in range(1, 6)]
    beats = [Heartbeat(generator_id="g", version=v, sent_at=float(v), loop_lag_ms=lag)
             for v, lag in ((-1, 900.0), (1, 2.0), (2, 30.0), (3, 4.0))]  # the first: before any version (start-up)
    assert loop.summarize(events, beats, 0, 0.0)["generator_loop_lag_ms"] == {"p50": 4.0, "max": 30.0}


def test_bench_async_runs_every_plan_on_the_node(four_gpus: None, tmp_path: Path) -> None:
    """``bench async`` with the node's options: every run (sync, and each S) is the node loop, the same processes
    on the same GPUs, only the staleness keys differ."""
    from actors.commands.bench import sync_vs_async

    args = sync_vs_async.parse_args(["--json", "a.json", "--device", "cuda", "--backend", "megatron", "--learner-nproc",
                                     "2", "--learner", "megatron.expert_parallel=2", "--generator-engine", "vllm",
                                     "--generator-devices", "cuda:2,cuda:3", "--generator", "vllm.enforce_eager=true",
                                     "--run-dir", str(tmp_path), "--staleness", "4"], "bench async")  # fmt: skip
    sync = loop.parse_args(sync_vs_async.loop_argv(args, "sync", ["staleness.sync=true"]), "bench loop")
    s4 = loop.parse_args(sync_vs_async.loop_argv(args, "async-4", ["staleness.max_staleness=4"]), "bench loop")
    for run in (sync, s4):
        assert (run.backend, run.learner_nproc, run.generator_engine, run.generator_devices) == \
            ("megatron", 2, "vllm", "cuda:2,cuda:3")  # fmt: skip
        assert "megatron.expert_parallel=2" in run.learner and run.generator == ["vllm.enforce_eager=true"]
    assert "staleness.sync=true" in sync.learner and "staleness.sync=true" not in s4.learner
    assert run.model == "tiny-moe"  # bench loop's own default where --model is not given
    with pytest.raises(SystemExit):
        sync_vs_async.parse_args(["--json", "a.json", "--learner-nproc", "2"], "bench async")  # torch: one rank


def _run(wall: float | None, first_step: float = 5.0) -> dict:
    return {"machine": "test", "tracebacks": [], "wall_to_target_s": wall, "steps_to_target": 40,
            "reward_curve": [[1, first_step, 0.1, 0.2]]}  # fmt: skip


def test_bench_async_reuse_keeps_earlier_runs_of_the_same_setup_and_refuses_another(tmp_path: Path) -> None:
    """A bench split over several calls: the runs an earlier JSON holds are kept (none runs again here, as every plan
    is there), the ratio taken over all of them (from the learner's first step, and from process start); a JSON of
    another setup is refused naming what differs."""
    from actors.commands.bench import sync_vs_async

    setup = ["--device", "cuda", "--backend", "megatron", "--learner-nproc", "2"]
    first = {"bench": "async", "setup": sync_vs_async.setup(sync_vs_async.parse_args(["--json", "x", *setup], "b")),
             "runs": {"sync": _run(100.0, first_step=20.0), "async-4": _run(60.0), "async-2": _run(45.0)}}  # fmt: skip
    (tmp_path / "first.json").write_text(json.dumps(first))
    out = tmp_path / "all.json"
    rc = sync_vs_async.main(["--json", str(out), *setup, "--staleness", "2,4", "--reuse", str(tmp_path / "first.json"),
                             "--run-dir", str(tmp_path)])  # fmt: skip
    data = json.loads(out.read_text())
    assert rc == 0 and sorted(data["runs"]) == ["async-2", "async-4", "sync"]
    assert data["sync"]["train_to_0_9_s"] == 80.0 and data["async"]["2"]["train_to_0_9_s"] == 40.0
    assert data["best_async_vs_sync"] == 0.5 and data["best_async_vs_sync_from_start"] == 0.45
    assert data["setup"]["backend"] == "megatron" and data["learner_nproc"] == 2
    with pytest.raises(SystemExit, match="another setup .backend 'megatron' there, 'torch' here"):
        sync_vs_async.main(["--json", str(out), "--device", "cuda", "--reuse", str(tmp_path / "first.json")])


def test_bench_async_writes_its_json_after_each_run_for_a_call_cut_short(tmp_path: Path) -> None:
    """After the synchronous run alone, the JSON holds it with the ratios null; a later call given it (``--reuse``)
    keeps that run and completes the bench with the other."""
    from actors.commands.bench import sync_vs_async

    out = tmp_path / "node.json"
    argv = ["--json", str(out), "--device", "cuda", "--staleness", "4", "--run-dir", str(tmp_path)]
    args = sync_vs_async.parse_args(argv, "b")
    sync_vs_async.write_partial(args, {"sync": _run(100.0, first_step=20.0)})
    partial = json.loads(out.read_text())
    assert partial["sync"]["train_to_0_9_s"] == 80.0 and partial["async"] == {}
    assert partial["best_async_vs_sync"] is None and partial["best_async_vs_sync_from_start"] is None
    partial["runs"]["async-4"] = _run(50.0)  # what the next call would have run
    (tmp_path / "kept.json").write_text(json.dumps(partial))
    assert sync_vs_async.main([*argv, "--reuse", str(tmp_path / "kept.json")]) == 0
    assert json.loads(out.read_text())["best_async_vs_sync"] == 0.5625


def test_generator_rate_averages_every_beat_of_each_generator_the_empty_ones_too() -> None:
    from async_rl.servers.control import Heartbeat

    def beat(gen: str, rate: float) -> Heartbeat:
        return Heartbeat(generator_id=gen, tokens_per_s=rate)

    # a batch ends in one beat of four: the beats that saw tokens say 4000, the generator made 1000 a second
    beats = [beat("a", r) for r in (0.0, 0.0, 4000.0, 0.0)] + [beat("b", r) for r in (500.0, 1500.0)]
    assert loop.generator_rate(beats) == 1000.0 + 1000.0
    assert loop.generator_rate([beat("a", 0.0)]) is None
    assert loop.generator_rate([]) is None


def test_generators_are_measured_while_the_learner_steps_not_during_its_final_checkpoint() -> None:
    """Steps 1..5 at t=10..50; the generator busy throughout them, then idle for the learner's minute-long final
    checkpoint (beats to t=110): busy, not half idle, and its rate that of the steps."""
    from async_rl.servers.control import Heartbeat

    events = [(10.0 * s, s, {"train_s": 1.0, "tokens": 100.0}) for s in range(1, 6)]
    beats = [Heartbeat(generator_id="g", version=t // 10, sent_at=float(t), generate_s=float(min(t, 50)) - 10.0,
                       tokens_per_s=0.0 if t > 50 else 2000.0, loop_lag_ms=900.0 if t > 50 else 5.0)
             for t in range(10, 111, 5)]  # fmt: skip
    out = loop.summarize(events, beats, 0, 0.0)
    assert out["generator_idle_frac"] == pytest.approx(0.0)
    assert out["generator_tokens_per_s"] == pytest.approx(2000.0)
    assert out["generator_loop_lag_ms"] == {"p50": 5.0, "max": 5.0}


def test_exit_lines_keep_each_roles_own_words_on_why_it_stopped(tmp_path: Path) -> None:
    """A learner under torchrun that fails on purpose prints one line and exits 1; torchrun's own traceback follows
    and is all ``tracebacks`` holds, so the summary keeps the role's line."""
    (tmp_path / "learner.log").write_text(
        "11:14:08 learner INFO actors.learner.loop: step 30 v30\n"
        "[rank1]:async-rl learner: No space left on device: '/tmp/run/checkpoints/step-30'; exiting\n"
        "Traceback (most recent call last):\n  File \"/opt/torch/.venv/bin/torchrun\", line 10, in <module>\n")
    (tmp_path / "generator-0.log").write_text("async-rl generator: gen-0: NATS lost for good; exiting\n"
                                              "INFO the async-rl generator: not a line of its own\n")  # fmt: skip
    assert loop.exit_lines(tmp_path) == [
        "generator-0.log: async-rl generator: gen-0: NATS lost for good; exiting",
        "learner.log: [rank1]:async-rl learner: No space left on device: '/tmp/run/checkpoints/step-30'; exiting"]
    assert loop.tracebacks(tmp_path) == ['learner.log: File "/opt/torch/.venv/bin/torchrun", line 10, in <module>']
