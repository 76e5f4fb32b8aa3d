"""Your own task or environment by config: the one-file environment of docs/environments.md, taken from the page
itself, runs by ``task.name=path/to/file.py:Class`` alone through the generator's episode runner (a random model on
the real torch engine, and scripted turns that win); a task as ``module:Class``; and every mistake the page names
ends at config time in one line naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from actors.generator.config import GeneratorConfig, TorchEngineConfig
from actors.generator.engine import SamplingParams
from actors.generator.episodes import EpisodeConfig, run_group
from actors.generator.torch_engine import TorchEngine
from async_rl.config.configurable import load_config
from async_rl.model.byte_tokenizer import build_byte_tokenizer
from async_rl.model.config import ModelConfig
from async_rl.model.presets import load_model, save_pretrained_dir
from async_rl.tasks import TaskConfig, build_task
from async_rl.tasks.envs import EnvTask
from tests.unit.test_env_adapters import ScriptedTurns

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "guess_number" / "guess.py"
HINTS = {"Higher.", "Lower.", "A number, please."}


def docs_example() -> str:
    """The Python block under ``<!-- docs-test: file examples/guess_number/guess.py -->`` in docs/environments.md."""
    page = (ROOT / "docs" / "environments.md").read_text()
    block = page.split("<!-- docs-test: file examples/guess_number/guess.py -->\n```python\n", 1)[1].split("\n```\n")[0]
    return block + "\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pretrained_dir(tmp_path_factory.mktemp("guess") / "model", preset="tiny-moe", tokenizer="bytes")


def _hints(sample, tok) -> list[str]:  # type: ignore[no-untyped-def]
    """The environment's replies in a sample, as text (each a user message of the chat template)."""
    env = ~sample.model_token_mask()
    text = tok.decode(np.where(env, sample.response_ids, -1)[env].tolist())
    return re.findall(r"<\|im_start\|>user\n(.*?)<eos>", text)


async def test_the_documented_environment_runs_by_task_name_alone(model_dir: Path, tmp_path: Path) -> None:
    code = docs_example()
    assert code == EXAMPLE.read_text()  # the page shows the file, whole
    (tmp_path / "guess.py").write_text(code)
    cfg = load_config(GeneratorConfig, None, [f"task.name={tmp_path / 'guess.py'}:GuessTask",
                                              f"task.tokenizer={model_dir}", "task.args.max_number=20"])  # fmt: skip
    task = build_task(cfg.task)
    assert isinstance(task, EnvTask) and task.name == "guess" and task.max_new_tokens == 8
    tok = build_byte_tokenizer()
    spec = task.prompt(5)
    assert task.prompt(5).metadata == spec.metadata and 1 <= spec.metadata["secret"] <= 20
    assert task.prompt_text(spec.prompt_ids) == ("<bos><|im_start|>user\nI am thinking of a number between 1 and 20. "
                                                 "Guess it: answer with the number only.<eos><|im_start|>assistant\n")
    assert task.eval_prompt(0).prompt_id == "guess-0-eval-0"

    # A random model on the real engine: each episode runs its turns, the hints masked out of the loss.
    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name=str(model_dir))), model=load_model(str(model_dir)))
    params = SamplingParams(n=4, max_new_tokens=task.max_new_tokens, temperature=1.0)
    samples = await run_group(engine, task, spec.metadata, spec.prompt_ids, params,
                              EpisodeConfig(max_turns=6, max_tokens=320))  # fmt: skip
    for s in samples:
        info = s.reward_info
        assert s.reward == info["solved"] and info["episode/turns"] >= 1 and info["guesses"] == info["episode/turns"]
        hints = _hints(s, tok)
        assert len(hints) == info["episode/turns"] - 1 and set(hints) <= HINTS, hints
    await engine.close()

    # Scripted turns that play the game: not a number, too low, right.
    secret = spec.metadata["secret"]
    [s] = await run_group(ScriptedTurns(tok, ["I guess", f"{secret - 1}", f"It is {secret}."]), task, spec.metadata,
                          spec.prompt_ids, SamplingParams(n=1, max_new_tokens=16), EpisodeConfig())  # fmt: skip
    assert s.reward == 1.0 and s.reward_info["solved"] == 1.0 and s.reward_info["guesses"] == 3.0
    assert _hints(s, tok) == ["A number, please.", "Higher."] and s.reward_info["episode/end_done"] == 1.0


def test_a_task_of_your_own_as_module_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``module:Class`` from the working directory: a one-answer Task, scored by its own ``score``."""
    (tmp_path / "echo_task.py").write_text('''
import numpy as np
from async_rl.model import toy_tokenizer as tt
from async_rl.tasks import Score, Task
from async_rl.wire import PromptSpec


class Echo(Task):
    name = "echo"

    def __init__(self, *, seed, tokenizer, digits=3):
        self.seed, self.digits = seed, digits

    num_prompts = None
    max_new_tokens = property(lambda self: self.digits + 1)

    def prompt(self, index):
        text = str(10 ** (self.digits - 1) + (self.seed + index) % 9)
        return PromptSpec(prompt_id=f"echo-{index}", prompt_ids=np.array([tt.BOS_ID, *tt.encode(text)], np.int32),
                          metadata={"task": self.name, "text": text})

    def score(self, metadata, response_ids):
        return Score(reward=float(tt.decode(response_ids.tolist()) == metadata["text"]))
''')
    monkeypatch.chdir(tmp_path)
    task = build_task(TaskConfig(name="echo_task:Echo", args={"digits": 4}, seed=2))
    spec = task.prompt(1)
    assert spec.metadata["text"] == "1003" and task.max_new_tokens == 5
    assert task.score(spec.metadata, np.array(spec.prompt_ids[1:])).reward == 1.0
    assert task.prompt_text(spec.prompt_ids) == f"token ids {spec.prompt_ids.tolist()}"  # no tokenizer: the ids


def test_mistakes_end_at_config_time_naming_the_key(tmp_path: Path, model_dir: Path) -> None:
    from actors.learner.config import LearnerConfig

    example = f"{EXAMPLE}:GuessTask"
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "abstract.py").write_text("from async_rl.tasks.envs import EnvTask\n\nclass Half(EnvTask):\n"
                                          "    name = 'half'\n")  # fmt: skip
    (tmp_path / "no_eval.py").write_text("from async_rl.tasks import Task\n\nclass NoEval(Task):\n    name = 'x'\n"
                                         "    num_prompts = None\n    max_new_tokens = 4\n"
                                         "    def __init__(self, *, seed, tokenizer): pass\n"
                                         "    def prompt(self, index): ...\n    def score(self, metadata, ids): ...\n")
    cases = [
        (dict(name="no/such/file.py:GuessTask"), r"task.name 'no/such/file.py:GuessTask': no file no/such/file.py"),
        (dict(name=f"{EXAMPLE}:Guess"), r"has no 'Guess' \(its Task classes: GuessTask\)"),
        (dict(name=f"{EXAMPLE}:GuessEpisode"), "GuessEpisode is the class GuessEpisode, not a subclass of"),
        (dict(name=f"{EXAMPLE}:HELD_OUT"), "HELD_OUT is the int 1073741824, not a subclass of async_rl.tasks.Task"),
        (dict(name="no_such_module_here:Task"), "no module 'no_such_module_here' in the working directory"),
        (dict(name=f"{tmp_path}/broken.py:X"), r"broken.py does not load: SyntaxError: "),
        (dict(name=f"{tmp_path}/abstract.py:Half"), "Half is abstract: it does not implement episode, max_new_tokens"),
        (dict(name="copy:"), "task.name 'copy:' must be a built-in task, 'path/to/file.py:Class' or 'module:Class'"),
        (dict(name=example, args={"max_numbr": 20}), r"task.args \{'max_numbr': 20\} for task.name .*got an unexpected"),
        (dict(name=example, args={"seed": 1}), r"task.args cannot set \['seed'\]"),
        (dict(name=example, reward="m:f"), "task.reward cannot be set for task.name"),
        (dict(name=example, max_new_tokens=4), "task.max_new_tokens cannot be set for task.name"),
        (dict(name="copy", args={"x": 1}), "task.args applies to a task of your own"),
        (dict(name="guess"), r"task.name must be one of \[.*\], or a task of your own as 'path/to/file.py:Class'"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            TaskConfig(**fields)  # type: ignore[arg-type]
        assert "\n" not in str(err.value), str(err.value)
    # What the constructor refuses is a config error too (check_task turns it into one line and exit 2).
    with pytest.raises(ValueError, match="guess needs task.tokenizer"):
        build_task(TaskConfig(name=example))
    # Evaluation needs a held-out split: refused at start without eval_prompt, accepted with it.
    with pytest.raises(ValueError, match=r"task.name '.*no_eval.py:NoEval' has no eval_prompt\(index\) of its own"):
        LearnerConfig(task=TaskConfig(name=f"{tmp_path}/no_eval.py:NoEval"), eval=_eval_every(5))
    LearnerConfig(task=TaskConfig(name=example, tokenizer=str(model_dir)), eval=_eval_every(5))


def _eval_every(n: int):  # type: ignore[no-untyped-def]
    from actors.learner.evaluation import EvalConfig

    return EvalConfig(interval_versions=n)
