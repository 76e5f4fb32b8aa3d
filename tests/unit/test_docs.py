"""The docs run as written: every fenced shell and TOML block of README.md and docs/*.md is checked.

The marking convention: an HTML comment on the line right before a block's opening fence (invisible on GitHub),
``<!-- docs-test: KIND ARGS -->``, where KIND is

- ``config ROLE [FILE]``: a TOML block, parsed and validated by ROLE's config class (``learner``, ``generator``);
  with FILE (from the repository root) the block must be that file's content, so a sample file and the page
  that shows it cannot drift apart;
- ``command [cwd=DIR] [made=DIR,...]``: every ``async-rl ...`` line is parsed dry by the real argument parser of its subcommand,
  and a learner's or generator's config (``--config`` file and ``key=value`` overrides, and the overrides in
  ``LEARNER_ARGS=`` / ``GENERATOR_ARGS=``) is loaded and validated by the real config classes; nothing starts.
  Other lines (``pip``, ``git``, ``sbatch``) are not run. Placeholder model directories (``/models/my-moe``) are
  made, empty, in a temporary directory for the check, and so are the ``made`` directories (what the block's
  earlier commands write, e.g. a run directory or ``async-rl init-model``'s model, that later ones read);
- ``run [cwd=DIR]``: the block's ``async-rl`` lines are executed (cheap ones only) and must exit 0;
- ``file FILE``: a block of any language (a Python example) that must be FILE's content (from the repository root),
  so the page shows the file the tests run;
- ``skip REASON``: not checked, and the reason says why.

A shell or TOML block without a marker fails the test: a new snippet is checked from the day it is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from async_rl.config.configurable import ConfigError, config_from_data

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*/*.md"))]
CHECKED_LANGS = ("bash", "sh", "shell", "console", "toml")
MARKER = re.compile(r"^<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->$")
ENV = {"ASYNC_RL_REDIS_URL": "redis://placeholder:6379/0", "ASYNC_RL_NATS_URL": "nats://placeholder:4222"}
"""What a block's ``$ASYNC_RL_*`` stand for while its commands are parsed."""


@dataclasses.dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    kind: str
    args: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    out = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(```+|~~~+)\s*([\w-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(prev)
        out.append(Block(page, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n",
                         marker.group(1) if marker else "", marker.group(2) if marker else ""))  # fmt: skip
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
MARKED = [b for b in ALL if b.kind]


def test_every_shell_and_toml_block_is_marked() -> None:
    unmarked = [f"{b.where} ({b.lang})" for b in ALL if b.lang in CHECKED_LANGS and not b.kind]
    assert not unmarked, f"fenced blocks without a <!-- docs-test: ... --> marker (see {__name__}): {unmarked}"
    assert {b.kind for b in MARKED} <= {"config", "command", "run", "file", "skip"}
    assert all(b.args for b in MARKED if b.kind == "skip"), "a skip names its reason"
    assert len([b for b in MARKED if b.kind != "skip"]) >= 15


def _options(args: str) -> tuple[list[str], dict[str, str]]:
    words = shlex.split(args)
    return [w for w in words if "=" not in w], dict(w.split("=", 1) for w in words if "=" in w)


def _config_class(role: str) -> type:
    from actors.generator.config import GeneratorConfig
    from actors.learner.config import LearnerConfig

    return {"learner": LearnerConfig, "generator": GeneratorConfig}[role]


@pytest.mark.parametrize("block", [b for b in MARKED if b.kind == "config"], ids=lambda b: b.where)
def test_config_blocks_are_valid(block: Block, placeholders: Path) -> None:
    (role, *file), _ = _options(block.args)
    data = _real(tomllib.loads(block.text), placeholders)
    try:
        config_from_data(_config_class(role), data)
    except ConfigError as exc:
        pytest.fail(f"{block.where}: {exc}")
    if file:
        assert (ROOT / file[0]).read_text() == block.text, f"{block.where} differs from {file[0]}"


@pytest.mark.parametrize("block", [b for b in MARKED if b.kind == "file"], ids=lambda b: b.where)
def test_file_blocks_are_the_files(block: Block) -> None:
    (file,), _ = _options(block.args)
    assert (ROOT / file).read_text() == block.text, f"{block.where} differs from {file}"


PLACEHOLDER = re.compile(r"(?<![\w.])/(?:models|path/to)/[\w./-]*")
"""Model directories the docs name as examples (``/models/my-moe``): they become real, empty, temporary ones."""


@pytest.fixture
def placeholders(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary root where the docs' placeholder directories are made; the ``$ASYNC_RL_*`` URLs set."""
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    return tmp_path_factory.mktemp("placeholders")


def _real(value: Any, root: Path) -> Any:
    """``value`` with each placeholder directory replaced by one that exists under ``root``."""
    if isinstance(value, dict):
        return {k: _real(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [_real(v, root) for v in value]
    if not isinstance(value, str):
        return value

    def made(m: re.Match) -> str:
        path = root / m.group(0).lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    return PLACEHOLDER.sub(made, value)


def _commands(text: str) -> list[list[str]]:
    """The block's command lines as argv lists: continuations joined, ``&&`` / ``;`` split, a pipe's first command
    kept, ``$VAR`` expanded (the block's own ``NAME="..."`` assignments, then :data:`ENV`; an unquoted one splits into
    words as the shell does), a trailing ``&`` dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    local: dict[str, str] = {}

    def expand(word: str) -> list[str]:
        for name, value in local.items():
            if word == f"${name}":
                return value.split()
            word = word.replace(f"${{{name}}}", value).replace(f"${name}", value)
        return [os.path.expandvars(word)]

    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"\s+(?:&&|\|\||;)\s+|;\s*", line):
            with contextlib.suppress(ValueError):
                raw = shlex.split(part.split(" | ")[0], comments=True)
                if len(raw) == 1 and (m := re.match(r"^([A-Za-z_]\w*)=(.*)$", raw[0], flags=re.S)):
                    local[m.group(1)] = " ".join(w for v in m.group(2).split() for w in expand(v))
                    continue
                words = [w for raw_word in raw for w in expand(raw_word)]
                out.append([w for w in words if w != "&"])
    return out


def _async_rl_argv(argv: list[str]) -> list[str] | None:
    """The ``async-rl`` arguments of a command line: after ``async-rl`` in command place (``<(async-rl`` too), after ``-m actors.commands`` (torchrun,
    python), or after ``scripts/megatron/learner.sh NPROC`` (which is torchrun of ``async-rl learner``)."""
    for i, word in enumerate(argv):
        in_command_place = all(re.match(r"^\w+=", w) for w in argv[:i])  # only VAR=value before it
        if (word == "async-rl" and in_command_place) or word in ("<(async-rl", "$(async-rl"):
            return argv[i + 1 :]
        if word == "actors.commands" and i and argv[i - 1] == "-m":
            return argv[i + 1 :]
        if word.endswith("scripts/megatron/learner.sh"):
            return ["learner", *argv[i + 2 :]]
    return None


def _check_role(role: str, argv: list[str], cwd: Path, root: Path) -> str | None:
    from async_rl.config.configurable import deep_merge, parse_overrides
    from async_rl.entry import config_parser

    args = config_parser(f"async-rl {role}", "").parse_args(argv)
    data: dict[str, Any] = {}
    try:
        if args.config is not None:
            path = cwd / args.config
            if not path.is_file():
                return f"config file {args.config} does not exist (from {cwd.relative_to(ROOT)}/)"
            data = _real(tomllib.loads(path.read_text()), root)
        config_from_data(_config_class(role), deep_merge(data, parse_overrides(args.overrides)))
    except ConfigError as exc:
        return str(exc)
    return None


def _check_command(argv: list[str], cwd: Path, root: Path) -> str | None:
    """None when ``async-rl ARGV`` parses (and its config validates); else why not."""
    import importlib

    from actors.commands.cli import BENCHES, COMMANDS

    if argv[0] in ("learner", "generator"):
        return _check_role(argv[0], [a for a in argv[1:] if a != "..."], cwd, root)
    if argv[0] == "bench":
        target, rest, prog = BENCHES[argv[1]][0], argv[2:], f"async-rl bench {argv[1]}"
    else:
        if argv[0] not in COMMANDS:
            return f"unknown command {argv[0]!r}"
        target, rest, prog = COMMANDS[argv[0]][0], argv[1:], f"async-rl {argv[0]}"
    module = importlib.import_module(target.split(":")[0])
    parse = getattr(module, "parse_args", None) or getattr(module, "_parse", None)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if parse is not None:
                parse(rest, prog)
            else:  # no parser of its own to call: every option must be one its --help lists
                out = io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                    module.main(["--help"], prog=prog)
                unknown = [a.split("=")[0] for a in rest if a.startswith("--") and a.split("=")[0] not in out.getvalue()]
                if unknown:
                    return f"{prog}: unknown option(s) {unknown}"
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def _env_args(argv: list[str]) -> list[tuple[str, list[str]]]:
    """The learner and generator overrides a line passes in ``LEARNER_ARGS=`` / ``GENERATOR_ARGS=``."""
    out = []
    for word in argv:
        for var, role in (("LEARNER_ARGS=", "learner"), ("GENERATOR_ARGS=", "generator")):
            if word.startswith(var):
                out.append((role, shlex.split(word[len(var) :])))
    return out


@pytest.mark.parametrize("block", [b for b in MARKED if b.kind == "command"], ids=lambda b: b.where)
def test_command_blocks_parse(block: Block, placeholders: Path) -> None:
    _, opts = _options(block.args)
    cwd = ROOT / opts.get("cwd", ".")
    made = [d for d in opts.get("made", "").split(",") if d]
    for d in made:
        (placeholders / "made" / d).mkdir(parents=True, exist_ok=True)
    checked, problems = 0, []
    for argv in _commands(block.text):
        argv = _real(argv, placeholders)
        for d in made:  # the block's own products, as they would be by then
            argv = [re.sub(rf"(?<![\w./-]){re.escape(d)}(?=$|/)", str(placeholders / "made" / d), w) for w in argv]
        for role, overrides in _env_args(argv):
            checked += 1
            if (why := _check_role(role, overrides, cwd, placeholders)) is not None:
                problems.append(f"{role.upper()}_ARGS: {why}")
        command = _async_rl_argv(argv)
        if command is None:
            continue
        checked += 1
        if (why := _check_command(command, cwd, placeholders)) is not None:
            problems.append(f"async-rl {shlex.join(command)[:100]}: {why}")
    assert checked, f"{block.where}: no async-rl command found"
    assert not problems, f"{block.where}:\n" + "\n".join(problems)


@pytest.mark.parametrize("block", [b for b in MARKED if b.kind == "run"], ids=lambda b: b.where)
def test_run_blocks_run(block: Block, tmp_path: Path) -> None:
    _, opts = _options(block.args)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "async-rl"  # as the console script: the package from this tree
    launcher.write_text(f"#!{sys.executable}\nimport sys\nfrom actors.commands.cli import main\nsys.exit(main())\n")
    launcher.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    ran = 0
    for argv in _commands(block.text):
        if argv and argv[0] == "async-rl":
            ran += 1
            out = subprocess.run(argv, cwd=ROOT / opts.get("cwd", "."), env=env, capture_output=True, text=True,
                                 timeout=60)  # fmt: skip
            assert out.returncode == 0, f"{block.where}: {shlex.join(argv)}: {out.stderr[-2000:]}"
    assert ran, f"{block.where}: nothing to run"


ROLE_KEY = re.compile(r"(\bnot\s+)?`(\[)?(learner|generator)\.([a-z_][\w.]*(?:\.\*)?)\]?`")
"""A key the prose names with its role (`learner.torch.lr_schedule`, `[generator.vllm]`)."""


def test_keys_named_with_their_role_exist() -> None:
    """Prose may say `learner.torch.lr` for "the learner's torch.lr", but the key must exist, and a TOML table is
    never shown as `[learner.megatron]` (a role's keys are at the top of its own file: the CLI refuses that table)
    unless the page says it is not the form to use ("`[vllm]`, not `[generator.vllm]`")."""
    from async_rl.config.keys import config_keys

    paths = {role: [k.path for k in config_keys(_config_class(role))] for role in ("learner", "generator")}
    problems, seen = [], 0
    for page in PAGES:
        text = " ".join(page.read_text().split())
        for m in ROLE_KEY.finditer(text):
            negated, table, role, path = m.groups()
            if path == "md":  # learner.md, a page
                continue
            seen += 1
            stem = path.removesuffix(".*")
            if not any(p == stem or p.startswith(stem + ".") for p in paths[role]):
                problems.append(f"{page.name}: {m.group(0)}: {role} has no key {stem}")
            elif table and not negated:
                problems.append(f"{page.name}: {m.group(0)}: a {role}'s file has [{stem}], not [{role}.{stem}]")
    assert seen >= 5
    assert not problems, "\n".join(problems)
