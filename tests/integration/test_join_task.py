"""The task a generator scores with must be the run's (issue 37): the facts compared at join, and the join check
itself against a real Redis and NATS, the learner's side of the refusal included. The whole processes are in
tests/integration/test_fail_fast.py (a generator on ``reverse`` under a learner on ``copy``)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from actors.generator.config import GeneratorConfig
from actors.generator.join import check_join
from async_rl.config.configurable import load_config
from async_rl.model import architecture as arch
from async_rl.process.lifecycle import StartupError
from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, JoinRefused, Message
from async_rl.servers.embedded import ServerSet
from async_rl.tasks import identity
from async_rl.tasks.config import TaskConfig


def test_a_prompt_file_is_its_name_and_content_not_its_path(tmp_path: Path) -> None:
    a, b = tmp_path / "host-a", tmp_path / "host-b"
    for d in (a, b):
        d.mkdir()
        (d / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    learner = identity.task_facts(TaskConfig(name="jsonl", jsonl_path=str(a / "prompts.jsonl")))
    same = identity.task_facts(TaskConfig(name="jsonl", jsonl_path=str(b / "prompts.jsonl")))
    assert learner == same and learner["task.jsonl_path"].startswith("prompts.jsonl sha256:")
    assert str(tmp_path) not in identity.encode(learner)  # nothing of a host's own paths
    (b / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "3"}\n')  # an edited copy
    edited = identity.task_facts(TaskConfig(name="jsonl", jsonl_path=str(b / "prompts.jsonl")))
    (diff,) = identity.differences(edited, learner)
    assert diff.startswith("task.jsonl_path 'prompts.jsonl sha256:") and "here, 'prompts.jsonl sha256:" in diff


def test_the_first_difference_is_named_first(tmp_path: Path) -> None:
    ours = identity.task_facts(TaskConfig(name="reverse", reward="mine:score"))
    run = identity.task_facts(TaskConfig(name="copy"))
    assert identity.differences(ours, run) == [
        "task.name 'reverse' here, 'copy' in the run", "task.reward 'mine:score' here, '' (the task's own) in the run"]
    assert identity.differences(run, run) == []
    # A fact only one side has (a learner older than a new fact) is not a difference.
    assert identity.differences({**run, "task.new_fact": 1}, run) == []


def test_a_tokenizer_directory_is_its_files_not_its_path(tmp_path: Path) -> None:
    from async_rl.model.presets import save_pretrained_dir

    model = save_pretrained_dir(tmp_path / "a" / "my-model", preset="tiny-moe")
    copy = tmp_path / "b" / "my-model"
    shutil.copytree(model, copy)
    one, other = identity.tokenizer_identity(str(model)), identity.tokenizer_identity(str(copy))
    assert one == other and one.startswith("my-model sha256:")
    assert identity.tokenizer_identity("tiny-moe") == identity.tokenizer_identity("small-moe")  # one toy tokenizer
    assert identity.tokenizer_identity("") == ""
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text().replace("}", ', "x": 1}'))
    assert identity.tokenizer_identity(str(copy)) != one


@pytest.mark.asyncio
async def test_join_refuses_another_task_on_both_sides(servers: ServerSet, names: Names, redis_client) -> None:  # type: ignore[no-untyped-def]
    urls = [f"run.prefix={names.prefix}", f"run.redis_url={servers.redis_url}", f"run.nats_url={servers.nats_url}"]
    gen = load_config(GeneratorConfig, None, [*urls, "generator_id=g1", "torch.model.name=tiny-moe",
                                              "task.name=reverse"])  # fmt: skip
    control = await ControlPlane(servers.nats_url, name="test").connect()
    heard: list[JoinRefused] = []

    async def on_message(msg: Message) -> None:
        if isinstance(msg, JoinRefused):
            heard.append(msg)

    try:
        await control.subscribe(names.heartbeat_subject, on_message, kinds=(JoinRefused,))
        assert await check_join(gen, redis_client, control) is False  # no learner yet: checked once it comes
        await redis_client.hset(names.learner_state, mapping={
            "model": "tiny-moe", arch.STATE_FIELD: arch.encode(arch.architecture("tiny-moe")),
            identity.STATE_FIELD: identity.encode(identity.task_facts(TaskConfig(name="copy")))})  # fmt: skip
        with pytest.raises(StartupError) as refused:
            await check_join(gen, redis_client, control)
        line = str(refused.value)
        assert line == (f"task 'reverse' does not match run {names.prefix!r}, whose learner trains on 'copy': "
                        "task.name 'reverse' here, 'copy' in the run (give the generator the learner's task.* "
                        "settings and the same files)")  # fmt: skip
        for _ in range(50):  # what the learner logs: the same line
            if heard:
                break
            await asyncio.sleep(0.05)
        assert [m.reason for m in heard] == [line] and heard[0].generator_id == "g1"
        same = load_config(GeneratorConfig, None, [*urls, "generator_id=g2", "torch.model.name=tiny-moe",
                                                   "task.name=copy"])  # fmt: skip
        assert await check_join(same, redis_client, control) is True
    finally:
        await control.close()


@pytest.mark.asyncio
async def test_join_compares_a_mixture_member_by_member(servers: ServerSet, names: Names, redis_client) -> None:  # type: ignore[no-untyped-def]
    urls = [f"run.prefix={names.prefix}", f"run.redis_url={servers.redis_url}", f"run.nats_url={servers.nats_url}"]
    mix = 'task.mix=[{"name": "copy", "weight": 3}, {"name": "reverse"}]'
    learner = load_config(GeneratorConfig, None, [*urls, "torch.model.name=tiny-moe", mix]).task
    await redis_client.hset(names.learner_state, mapping={
        "model": "tiny-moe", arch.STATE_FIELD: arch.encode(arch.architecture("tiny-moe")),
        identity.STATE_FIELD: identity.encode(identity.task_facts(learner))})  # fmt: skip
    control = await ControlPlane(servers.nats_url, name="test").connect()
    try:
        other = load_config(GeneratorConfig, None, [*urls, "generator_id=g1", "torch.model.name=tiny-moe",
                                                     'task.mix=[{"name": "copy"}, {"name": "reverse", '
                                                     '"strict_length": false}]'])  # fmt: skip
        with pytest.raises(StartupError, match=r"task 'mix' does not match run .*: task.mix\[1\].strict_length False "
                                               r"here, True in the run \(give the generator"):  # fmt: skip
            await check_join(other, redis_client, control)
        with pytest.raises(StartupError, match=r"task.name 'copy' here, 'mix' in the run"):
            await check_join(load_config(GeneratorConfig, None, [*urls, "generator_id=g2", "torch.model.name=tiny-moe",
                                                                 "task.name=copy"]), redis_client, control)  # fmt: skip
        same = load_config(GeneratorConfig, None, [*urls, "generator_id=g3", "torch.model.name=tiny-moe",
                                                   'task.mix=[{"name": "copy"}, {"name": "reverse"}]'])  # fmt: skip
        assert await check_join(same, redis_client, control) is True  # the weights are the learner's alone
    finally:
        await control.close()
