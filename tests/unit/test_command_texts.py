"""What the commands say: --print-recipe's ports, the status table's "versions behind" column, and every
command's --help description a whole sentence."""

from __future__ import annotations

import importlib

import pytest

from actors.commands.quickstart import main


def test_the_recipe_serves_the_ports_of_the_urls_it_was_given(capsys) -> None:
    assert main(["--print-recipe", "--redis-url", "redis://10.0.0.5:16379/0", "--nats-url",
                 "nats://10.0.0.5:14222"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "async-rl serve --no-auth --redis-port 16379 --nats-port 14222" in out
    assert "6379 " not in out.replace("16379", "") and "4222" not in out.replace("14222", "")
    assert "can also start" not in out and "never start servers of their own" in out
    generators = [line for line in out.splitlines() if " generator " in line]
    assert len(generators) == 2 and all("run.redis_url=redis://10.0.0.5:16379/0" in g for g in generators)


def test_status_says_what_its_versions_behind_column_measures() -> None:
    from rich.console import Console

    from actors.commands.status import render

    gen = {"id": "g1", "host": "h", "engine": "torch", "version": 3, "tokens_per_s": 1.0, "in_flight": 0,
           "state": "running", "last_seen_s": 0.5, "alive": True, "pending_prompts": 0, "reclaim_in_s": None}
    stats = {"rollouts": {"backlog": 0, "duplicates": 0}, "dead_letters": {"length": 0, "latest": []},
             "audit": {"issued": 0, "trained": 0, "dropped_stale": 0, "dead_lettered": 0, "in_flight": 0}}
    console = Console(record=True, width=400)
    console.print(render({"prefix": "p", "learner": {"version": "10"}, "weights": {"latest": 10}, "generators": [gen],
                          "buffer": stats, "scaling": None}))  # fmt: skip
    text = console.export_text()
    assert "versions behind" in text and "staleness" not in text.split("versions behind")[0].split("generators")[-1]
    assert "at its last heartbeat" in text and "staleness.max_staleness bounds something else" in text
    assert "│ 7 " in text.replace(" 7  ", " 7 ")



@pytest.mark.parametrize("module", ["status", "audit", "samples", "serve", "acl", "quickstart", "evaluate", "bench.loop",
                                    "bench.backends", "bench.sync_vs_async", "env_serve"])  # fmt: skip
def test_help_descriptions_are_whole_sentences(module: str, capsys) -> None:  # type: ignore[no-untyped-def]
    mod = importlib.import_module(f"actors.commands.{module}")
    with pytest.raises(SystemExit):
        mod.main(["--help"])
    out = capsys.readouterr().out
    description = " ".join(out.split("\n\n")[1].split())
    assert description.endswith("."), description
    assert description.count("``") % 2 == 0, description


def test_status_help_shows_its_defaults(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from actors.commands.status import main as status_main

    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps at the terminal's width, and breaks "async-rl" there

    with pytest.raises(SystemExit):
        status_main(["--help"])
    out = " ".join(capsys.readouterr().out.split("options:")[1].split())
    for option, default in (("--prefix", "default async-rl"), ("--redis-url", "default $ASYNC_RL_REDIS_URL"),
                            ("--nats-url", "default $ASYNC_RL_NATS_URL"), ("--listen-s", "default 3.0"),
                            ("--watch", "default: one snapshot"), ("--json", "default: tables")):  # fmt: skip
        assert default in out.split(f" {option} ")[1].split(" --")[0], (option, out)
