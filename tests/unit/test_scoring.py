"""Scoring errors stay small (issue 37): a reward or environment that raises scores its sample as an error, counted
per reason and logged once with its traceback; only every sample failing for ``max_failed_groups`` groups in a
row ends the generator, with one line naming the key to fix. The real processes: tests/integration/test_reward_errors.py."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from actors.generator.engine import Completion
from actors.generator.episodes import EpisodeConfig, run_group
from actors.generator.scoring import Scoring, ScoringFailed
from async_rl.model import toy_tokenizer as tt
from async_rl.model.presets import build_model
from async_rl.tasks import TaskConfig, ToyTask
from tests.unit.test_episodes import PARAMS, PROMPT, _Scripted
from tests.unit.test_torch_engine import make_engine


def _completions(n: int) -> list[Completion]:
    ids = np.array(tt.encode("123"), np.int32)
    return [Completion(token_ids=ids, logprobs=np.zeros(3, np.float32), versions=np.zeros(3, np.int32),
                       finish_reason="stop") for _ in range(n)]  # fmt: skip


def _reward(text: str, metadata: Mapping[str, Any]) -> float:
    if metadata["index"] % 2:
        return float(text == metadata["answr"])  # the typo of the issue
    return 1.0


def test_a_raising_reward_scores_its_sample_as_an_error(caplog: pytest.LogCaptureFixture) -> None:
    task = ToyTask("copy", reward_fn=_reward)
    scoring = Scoring(TaskConfig(name="copy", reward="mymod:reward"), max_failed_groups=3)
    good = scoring.score(task, task.prompt(0).metadata, _completions(4))
    assert not good.failed and [s.reward for s in good.samples] == [1.0] * 4
    with caplog.at_level(logging.WARNING, logger="actors.generator.scoring"):
        for i in (1, 3, 5):
            bad = scoring.score(task, task.prompt(i).metadata, _completions(4))
            assert bad.failed and len(bad.samples) == 4 and isinstance(bad.first_error, KeyError)
    reason = f"task.reward='mymod:reward' raised KeyError at test_scoring.py:{_reward.__code__.co_firstlineno + 2}"
    assert bad.reasons == [reason] * 4 and scoring.counts == {reason: 12}
    assert bad.dead_letter_reason() == f"scoring failed on 4 of 4 samples: {reason}"
    # Logged once, with the traceback; the other eleven are summed later (RepeatedLine), not one line each.
    assert [r.getMessage() for r in caplog.records] == [
        f"scoring raised on 1 sample(s): {reason}: KeyError: 'answr'; their groups go to the dead letters, the "
        "generator goes on"]
    assert caplog.records[0].exc_info is not None and caplog.records[0].exc_info[0] is KeyError


def test_only_every_sample_failing_for_n_groups_in_a_row_ends_it() -> None:
    task = ToyTask("copy", reward_fn=_reward)
    scoring = Scoring(TaskConfig(name="copy"), max_failed_groups=3)
    assert scoring.what == "task.reward='' (the copy task's own scorer)"
    for i in (1, 3, 0, 5, 7):  # a whole group that scored breaks the run of failures
        scoring.judge(scoring.score(task, task.prompt(i).metadata, _completions(2)))
    assert scoring.failed_in_row == 2
    with pytest.raises(ScoringFailed) as failed:
        scoring.judge(scoring.score(task, task.prompt(9).metadata, _completions(2)))
    assert str(failed.value).startswith("every sample of the last 3 groups failed to score: task.reward='' (the copy "
                                        "task's own scorer) raised KeyError at test_scoring.py:")  # fmt: skip
    assert "KeyError: 'answr' (fix task.reward; the groups are in the dead letters" in str(failed.value)
    never = Scoring(TaskConfig(name="copy"), max_failed_groups=0)  # 0: dead-letter for ever, never exit
    for i in range(1, 40, 2):
        never.judge(never.score(task, task.prompt(i).metadata, _completions(1)))
    assert never.failed_in_row == 20


async def test_an_environment_that_raises_is_the_same_error(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(build_model("tiny-moe", seed=0), stop_on_eos=False)
    scoring = Scoring(TaskConfig(name="tool_copy"), max_failed_groups=1)
    assert scoring.key == "task.env"
    errors: list[BaseException] = []
    with caplog.at_level(logging.WARNING):
        samples = await run_group(engine, _Scripted(fail_at=1), {}, PROMPT, PARAMS.__class__(n=3, max_new_tokens=4),
                                  EpisodeConfig(), on_error=errors.append)  # fmt: skip
        group = scoring.episodes(samples, errors)
    await engine.close()
    assert len(errors) == 3 and all(isinstance(e, ValueError) for e in errors)
    assert all(s.reward_info["episode/end_env_error"] == 1.0 for s in samples)  # each episode still says why it ended
    assert group.failed and group.reasons[0].startswith("the environment of task.name=tool_copy raised ValueError at ")
    assert len([r for r in caplog.records if r.exc_info]) == 1  # not the episodes' own line per error
    with pytest.raises(ScoringFailed, match=r"\(fix task.env;"):
        scoring.judge(group)


def test_errors_are_counted_per_reason_on_metrics() -> None:
    import urllib.request

    from actors.generator.config import GeneratorConfig
    from actors.generator.metrics import GeneratorMetrics
    from async_rl.config.configurable import load_config
    from async_rl.servers.embedded import free_port

    cfg = load_config(GeneratorConfig, None, ["generator_id=g1", "run.prefix=p", "prometheus.host=127.0.0.1",
                                              f"prometheus.port={free_port()}"])  # fmt: skip
    metrics = GeneratorMetrics(cfg)
    metrics.start()
    try:
        task = ToyTask("copy", reward_fn=_reward)
        scoring = Scoring(cfg.task, max_failed_groups=0, metrics=metrics)
        scoring.score(task, task.prompt(1).metadata, _completions(3))
        metrics.dead_lettered()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics.exporter.port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        metrics.close()
    (reason,) = scoring.counts
    assert (f'async_rl_generator_scoring_errors_total{{generator="g1",reason="{reason}",run="p"}} 3.0' in text
            or f'async_rl_generator_scoring_errors_total{{run="p",generator="g1",reason="{reason}"}} 3.0' in text), text
    assert 'async_rl_generator_dead_lettered_groups_total{generator="g1",run="p"} 1.0' in text or (
        'async_rl_generator_dead_lettered_groups_total{run="p",generator="g1"} 1.0' in text), text
