"""Config loading, names and embedded servers."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import redis

from async_rl.config.configurable import ConfigError, from_dict, load_config, parse_overrides
from async_rl.run.names import Names
from async_rl.servers.embedded import start_nats, start_redis, url_reachable


@dataclass(kw_only=True, slots=True)
class _Inner:
    lr: float = 1e-3
    """learning rate"""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError("inner.lr must be > 0")


@dataclass(kw_only=True, slots=True)
class _Outer:
    name: str = "x"
    steps: int = 3
    tags: list[str] = field(default_factory=list)
    inner: _Inner = field(default_factory=_Inner)


def test_from_dict_nested_and_coerced() -> None:
    cfg = from_dict(_Outer, {"steps": "5", "tags": "a,b", "inner": {"lr": "0.5"}})
    assert cfg.steps == 5 and cfg.tags == ["a", "b"] and cfg.inner.lr == 0.5


def test_unknown_key_named() -> None:
    with pytest.raises(ConfigError, match="unknown config key.*inner.*lrr"):
        from_dict(_Outer, {"inner": {"lrr": 1}})


def test_bad_type_named() -> None:
    with pytest.raises(ConfigError, match="steps must be an integer"):
        from_dict(_Outer, {"steps": "many"})


def test_validation_error_surfaces() -> None:
    with pytest.raises(ConfigError, match="inner.lr must be > 0"):
        load_config(_Outer, overrides=["inner.lr=-1"])


def test_overrides_parse_json_values() -> None:
    assert parse_overrides(["a.b=1", "a.c=true", "d=hello"]) == {"a": {"b": 1, "c": True}, "d": "hello"}


def test_names_are_prefixed() -> None:
    n = Names(prefix="run1")
    assert n.prompts_stream == "run1:prompts"
    assert n.weights_bucket(3, 2) == "run1:weights:3:bucket:2"
    assert n.weights_subject == "run1.weights"
    with pytest.raises(ValueError, match="prefix"):
        Names(prefix="bad prefix")


def test_embedded_servers_start_and_stop() -> None:
    r = start_redis()
    n = start_nats()
    try:
        assert redis.Redis.from_url(r.url).ping()
        assert url_reachable(n.url)
    finally:
        r.stop()
        n.stop()
    assert not url_reachable(r.url) and not url_reachable(n.url)


def test_cli_help_is_light() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, actors.commands.cli; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "False"
