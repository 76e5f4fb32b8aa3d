"""Configs load without torch: validating any role's config, and every config error, is fast.

Each check runs in a fresh interpreter (this test process has torch loaded already): it loads and
validates the config of every role with overrides that reach nested sections, and then reports
which heavy libraries got imported. The CLI's config errors are run as the user runs them.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "wandb", "matplotlib", "vllm", "megatron")

_PROBE = """
import json, sys
from async_rl.config.configurable import load_config
from actors.generator.config import GeneratorConfig
from actors.learner.config import LearnerConfig
from actors.learner.megatron.config import MegatronConfig
from actors.commands.quickstart import parse_args

learner = load_config(LearnerConfig, None, ["batch_groups=4", "sampling.n=2", "torch.lr=1e-3", "backend=megatron",
                                            "algorithm.loss.type=ppo", "staleness.max_staleness=3"])
generator = load_config(GeneratorConfig, None, ["engine=vllm", "vllm.max_num_seqs=8", "sampling.temperature=0.7",
                                                "weight_sync.poll_interval_s=1"])
megatron = load_config(MegatronConfig, None, [])
parse_args([], prog="async-rl quickstart")
assert learner.sampling.n == 2 and generator.sampling.temperature == 0.7
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)))
""".replace("HEAVY", repr(HEAVY))


def test_every_role_config_loads_without_heavy_imports() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_config_errors_are_quick_and_name_the_key() -> None:
    for role, bad, expect in (
        ("generator", "not_a_key=1", "not_a_key"),
        ("learner", "batch_grups=3", "batch_grups (did you mean batch_groups?)"),
        ("learner", "sampling.temperature=0", "sampling.temperature must be > 0"),
    ):
        # The user's path (the dispatcher, the role's entry point, the config error), and at exit the heavy
        # modules it imported on the way.
        code = (f"import atexit, json, sys\n"
                f"atexit.register(lambda: print('HEAVY', json.dumps(sorted(m for m in sys.modules "
                f"if m.split('.')[0] in {HEAVY!r}))))\n"
                f"from actors.commands.cli import main\nsys.exit(main([{role!r}, {bad!r}]))")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert expect in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert out.stdout.strip().splitlines()[-1] == "HEAVY []", out.stdout
