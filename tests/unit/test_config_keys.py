"""Help from the config classes: ``--help-keys`` lists every key of a role with type, default and description;
unknown keys are answered with the key of that name in another section; messages name keys as the user sets them."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from actors.generator.config import GeneratorConfig
from actors.generator.main import main as generator_main
from actors.learner.config import LearnerConfig
from actors.learner.main import main as learner_main
from async_rl.config.keys import config_keys, field_docs


def _leaf_count(cls: type) -> int:
    hints = typing.get_type_hints(cls)
    n = 0
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        n += _leaf_count(tp) if isinstance(tp, type) and dataclasses.is_dataclass(tp) else 1
    return n


@pytest.mark.parametrize(("main", "cls", "role"), [(learner_main, LearnerConfig, "learner"),
                                                   (generator_main, GeneratorConfig, "generator")])  # fmt: skip
def test_help_keys_lists_every_key(main, cls, role, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        main(["--help-keys"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    keys = config_keys(cls)
    assert len(keys) == _leaf_count(cls) > 50
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for k in keys:  # every key, with its type, default and the first sentence of its docstring
        assert k.doc, f"{k.path} has no docstring"
        assert k.path in lines and f"{k.type} = {k.default}" in lines[k.path] and k.doc in lines[k.path], k
    assert "[run]  Prefix" in out and "\ngeneral\n" in out
    run = lines["run.redis_url"]
    assert "str | None = (unset)" in run and "Redis URL (e.g. redis://host:6379/0)." in run
    with pytest.raises(SystemExit):
        main(["--help"])
    helped = capsys.readouterr().out
    assert f"async-rl {role} --help-keys lists each with its type, default and meaning" in helped
    listed = {word.strip(",") for word in helped.split("config keys, by section")[1].split()}
    assert {k.path for k in keys} <= listed  # --help itself names every key


def test_field_docs_come_from_the_class_body() -> None:
    docs = field_docs(GeneratorConfig)
    assert docs["heartbeat_interval_s"] == "Seconds between heartbeats on NATS."
    assert set(docs) == {f.name for f in dataclasses.fields(GeneratorConfig)}


@pytest.mark.parametrize(("main", "override", "expected"), [
    (generator_main, "model.name=tiny-moe",
     "unknown config key(s): model.name (did you mean torch.model.name or vllm.model.name?) "
     "(async-rl generator --help-keys lists every key)"),
    (learner_main, "device=cpu", "unknown config key(s): device (did you mean torch.device?)"),
    (learner_main, "batch_grups=3", "unknown config key(s): batch_grups (did you mean batch_groups?)"),
    (learner_main, "staleness.max_staleness=-1", "config error: staleness.max_staleness must be >= 0"),
    (learner_main, "batch_groups=0", "config error: batch_groups must be >= 1"),
    (generator_main, "torch.device=gpu", "config error: torch.device must be 'cpu', 'cuda' or 'cuda:N'"),
    (generator_main, "run.prefix=a b", "config error: run.prefix 'a b' must be"),
])  # fmt: skip
def test_messages_name_the_key_the_user_sets(main, override, expected, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        main([override, "run.redis_url=redis://127.0.0.1:1/0", "run.nats_url=nats://127.0.0.1:1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err
    for internal in ("buffer.", "engine.", "learner.", "generator."):
        assert internal not in err.split("error: ", 1)[1], err


def test_help_keys_shows_no_sphinx_markup(capsys) -> None:  # type: ignore[no-untyped-def]
    from async_rl.config.keys import plain

    assert plain("Weights of :meth:`TorchBackend.export_weights`: ``state_dict``.") == (
        "Weights of `TorchBackend.export_weights`: `state_dict`.")
    assert plain("a :class:`~async_rl.tasks.base.Task` in :data:`SCHEMES`") == "a `Task` in `SCHEMES`"
    assert plain("no role here: 1:2 and `one`") == "no role here: 1:2 and `one`"
    for main in (learner_main, generator_main):
        with pytest.raises(SystemExit):
            main(["--help-keys"])
        out = capsys.readouterr().out
        for markup in (":data:`", ":meth:`", ":class:`", ":func:`", ":mod:`", "`~", "``"):
            assert markup not in out, [line for line in out.splitlines() if markup in line][:3]
    assert "(`SCHEMES`)" in out and "`async_rl.weights.peer`" in out  # the generator's transport.url
