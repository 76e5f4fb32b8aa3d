"""Credentials in URLs are never printed or saved with the run: ``--print-config``, the resolved config file
and the wandb config all go through ``public_config``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from async_rl.entry import public_config, save_resolved_config
from async_rl.process.lifecycle import redact_url

SECRET = "pw-never-shown-42"


def test_print_config_and_the_saved_config_redact_urls(tmp_path: Path) -> None:
    from actors.learner.config import LearnerConfig
    from async_rl.config.configurable import load_config

    urls = [f"run.redis_url=rediss://learner:{SECRET}@db:6380/0", f"run.nats_url=tls://{SECRET}@db:4222"]
    out = subprocess.run([sys.executable, "-m", "actors.commands.cli", "learner", "--print-config", *urls],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)["run"]
    assert run["redis_url"] == "rediss://***@db:6380/0" and run["nats_url"] == "tls://***@db:4222"
    assert SECRET not in out.stdout + out.stderr
    cfg = load_config(LearnerConfig, None, urls)
    assert cfg.run.redis_url is not None and SECRET in cfg.run.redis_url  # the process itself keeps them
    saved = save_resolved_config(cfg, tmp_path, "learner").read_text()
    assert SECRET not in saved and SECRET not in json.dumps(public_config(cfg))
    assert redact_url("redis://db:6379/0") == "redis://db:6379/0"
