"""docs/tasks.md, as written: the example task (examples/own_task/) runs with the documented commands from its own
directory (the reward module found in the working directory, no PYTHONPATH), and the mistakes the page names (a
reward module elsewhere, letters with the presets' digit tokenizer) end at config time, before any server."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from async_rl.metrics.sinks import read_metrics
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet, free_port

ROOT = Path(__file__).resolve().parents[2]


def _launcher(tmp_path: Path) -> Path:
    """An ``async-rl`` like the console script pip writes: its own directory, not the working one, on sys.path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "async-rl"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom actors.commands.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return script


def _doc_commands() -> list[list[str]]:
    text = (ROOT / "docs" / "tasks.md").read_text()
    block = text.split("<!-- docs-test: command cwd=examples/own_task -->\n```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.startswith("async-rl ")]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                TOKENIZERS_PARALLELISM="false")  # fmt: skip


def test_the_documented_task_runs(servers: ServerSet, names: Names, tmp_path: Path) -> None:
    work = tmp_path / "own_task"
    shutil.copytree(ROOT / "examples" / "own_task", work)
    async_rl = _launcher(tmp_path)
    learner, generator = _doc_commands()
    quick = {"learner": ["max_steps=3", "batch_groups=4", "read_block_ms=200"],
             "generator": ["torch.num_threads=1", "torch.max_batch_prompts=4", "read_block_ms=200",
                           "heartbeat_interval_s=0.5"]}  # fmt: skip
    procs = []
    for cmd in (learner, generator):
        argv = [a.replace("redis://127.0.0.1:6379/0", servers.redis_url).replace("nats://127.0.0.1:4222",
                servers.nats_url).replace("run.prefix=own-task", f"run.prefix={names.prefix}") for a in cmd[1:]]  # fmt: skip
        log = (tmp_path / f"{cmd[1]}.log").open("wb")
        procs.append(subprocess.Popen([str(async_rl), *argv, *quick[cmd[1]]], cwd=work, env=_env(), stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))  # fmt: skip
    try:
        rcs = [p.wait(240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join((tmp_path / f"{r}.log").read_text()[-3000:] for r in ("learner", "generator"))
    assert rcs == [0, 0], logs
    rows = [r for r in read_metrics(work / "runs" / "own-task") if "reward" in r]
    assert len(rows) == 3 and all("reward/exact" in r for r in rows), rows


def test_task_mistakes_are_config_errors(tmp_path: Path) -> None:
    async_rl = _launcher(tmp_path)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: a config error must come first
    urls = [f"run.redis_url=redis://{dead}/0", f"run.nats_url=nats://{dead}"]
    examples = ROOT / "examples" / "own_task"
    (tmp_path / "letters.jsonl").write_text('{"prompt": "hello", "answer": "olleh"}\n')
    cases = [
        (tmp_path, ["learner", "--config", str(examples / "learner.toml"), f"task.jsonl_path={examples}/prompts.jsonl",
                    *urls],
         "async-rl learner: config error: task.reward 'myreward:reverse_reward': cannot import module 'myreward' "
         f"from the working directory {tmp_path}"),
        (tmp_path, ["generator", "task.name=jsonl", "task.jsonl_path=letters.jsonl", *urls],
         "async-rl generator: config error: letters.jsonl:1: text 'hello' has characters outside the toy vocabulary"),
    ]  # fmt: skip
    for cwd, argv, expected in cases:
        t0 = time.monotonic()
        out = subprocess.run([str(async_rl), *argv], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out
        assert out.stderr.startswith(expected) and len(out.stderr.strip().splitlines()) == 1, out.stderr
        print(f"\n{time.monotonic() - t0:.1f} s: {out.stderr.strip()[:160]}")
    assert "a text task needs task.tokenizer" in out.stderr
