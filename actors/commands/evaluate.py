"""``async-rl eval RUN_DIR|HF_DIR [--version N] [KEY=VALUE ...]``: evaluate a run's checkpoint or an exported model
offline, with the same prompts and metrics as the run's evaluation rounds.

* **What.** RUN_DIR (a learner's ``run.run_dir``): its checkpoint of weight version ``--version`` (default: the newest),
  exported to a temporary Hugging Face directory as ``async-rl export`` writes it; HF_DIR: a model directory
  (``async-rl export``'s, or any other).
* **On what.** The task, ``eval.*`` and ``sampling.*`` of the run's saved config (RUN_DIR's, or the run an export
  names in its ``async_rl_export.json``), each overridable as ``KEY=VALUE`` (``eval.n=8 eval.k=[1,8]``); a model
  directory of no run takes its task from the overrides alone. Each evaluated source's first ``eval.num_prompts``
  held-out prompts, as a round issues them (:func:`~actors.learner.evaluation.held_out_specs`), ``eval.n`` samples
  each, greedy unless ``eval.temperature`` > 0.
* **How.** The generator's torch engine on the CPU (``--device``; ``--engine vllm`` where vLLM is installed), the
  task's own scorers and episodes, and the sums of :mod:`async_rl.metrics.evaluation`: for the weights of a round,
  greedy, the numbers are the round's (``tests/integration/test_eval_suite.py``). A prompt whose scoring raises is
  left out and counted, as a generator dead-letters it.

Prints one row per source and writes ``{"metrics": {"eval/<source>/...": ...}, ...}`` as JSON (``--out``; default
``eval-v<version>.json`` in RUN_DIR, ``async_rl_eval.json`` in HF_DIR).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from actors.learner.evaluation import EvalConfig
from async_rl.entry import first_sentence
from async_rl.tasks.config import TaskConfig
from async_rl.wire.sampling import Sampling


@dataclass(kw_only=True, slots=True)
class OfflineEvalConfig:
    """What ``async-rl eval`` reads from the run's config, and its overrides."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """The task whose held-out prompts are evaluated (the run's)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Sources, prompts per source, samples, k, temperature (the run's ``eval.*``)."""
    sampling: Sampling = field(default_factory=Sampling)
    """The run's sampling (top-p, top-k, the response budget and the token mask apply to evaluation too)."""


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    p.add_argument("path", type=Path, metavar="RUN_DIR|HF_DIR", help="a learner's run.run_dir or a model directory")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="task.*, eval.*, sampling.* over the run's")
    p.add_argument("--version", type=int, default=None, help="RUN_DIR: the checkpoint of this weight version "
                   "(default: the newest)")  # fmt: skip
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch", help="default torch")
    p.add_argument("--device", default="cpu", help="torch engine: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--out", type=Path, default=None, help="the JSON file to write")
    args = p.parse_args(argv)
    if not args.path.is_dir():
        p.error(f"{str(args.path)!r} is not a directory (a run directory or a model directory)")
    if args.version is not None and args.version < 0:
        p.error("--version must be >= 0")
    return args


def main(argv: list[str] | None = None, prog: str = "async-rl eval") -> int:
    args = parse_args(argv, prog)
    from actors.learner.hf_export import CONFIG_FILE, EXPORT_FILE

    is_run = (args.path / CONFIG_FILE).is_file()
    if not is_run and not (args.path / "config.json").is_file():
        print(f"{prog}: {args.path} holds neither a run ({CONFIG_FILE}) nor a model (config.json)", file=sys.stderr)
        return 2
    if not is_run and args.version is not None:
        print(f"{prog}: --version picks a checkpoint of a run directory; {args.path} is a model directory",
              file=sys.stderr)  # fmt: skip
        return 2
    provenance = json.loads((args.path / EXPORT_FILE).read_text()) if (args.path / EXPORT_FILE).is_file() else {}
    run_dir = args.path if is_run else Path(provenance.get("run_dir", ""))
    try:
        cfg = _config(run_dir if (run_dir / CONFIG_FILE).is_file() else None, args.overrides)
        from async_rl.tasks.config import build_task

        task = build_task(cfg.task)
    except ValueError as exc:
        print(f"{prog}: config error: {exc}", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="async-rl-eval-") as tmp:
            model_dir, provenance = (_export(args.path, args.version, Path(tmp)) if is_run
                                     else (args.path, provenance))  # fmt: skip
            report = asyncio.run(evaluate(cfg, task, model_dir, engine=args.engine, device=args.device,
                                          dtype=str(provenance.get("dtype", "float32")),
                                          version=int(provenance.get("version", -1))))  # fmt: skip
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    report.update({"path": str(args.path.resolve()), "step": provenance.get("step"), "engine": args.engine})
    out = args.out or (args.path / (f"eval-v{report['version']}.json" if is_run else "async_rl_eval.json"))
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"{prog}: wrote {out}")
    return 0


def _config(run_dir: Path | None, overrides: list[str]) -> OfflineEvalConfig:
    """The run's task, eval and sampling settings (none: the defaults) with the overrides; ValueError naming a key."""
    from actors.learner.evaluation import eval_sources
    from actors.learner.hf_export import read_run_config
    from async_rl.config.configurable import config_from_data, deep_merge, parse_overrides

    run = read_run_config(run_dir) if run_dir is not None else {}
    data: dict[str, Any] = {k: run[k] for k in ("task", "eval", "sampling") if k in run}
    cfg = config_from_data(OfflineEvalConfig, deep_merge(data, parse_overrides(overrides)))
    eval_sources(cfg.eval, cfg.task)  # each source evaluated has a held-out split, as far as the config tells
    return cfg


def _export(run_dir: Path, version: int | None, tmp: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint of ``version`` (None: the newest) of ``run_dir`` exported into ``tmp``, and its provenance."""
    from actors.learner.checkpoint import STATE_FILE
    from actors.learner.hf_export import EXPORT_FILE, export_checkpoint

    step = None
    if version is not None:
        kept = {json.loads((p / STATE_FILE).read_text())["version"]: int(p.name.split("-")[1])
                for p in sorted((run_dir / "checkpoints").glob("step-*")) if (p / STATE_FILE).is_file()}  # fmt: skip
        if version not in kept:
            raise ValueError(f"--version {version}: no checkpoint of that version in {run_dir / 'checkpoints'} "
                             f"(kept: {', '.join(map(str, sorted(kept))) or 'none'})")  # fmt: skip
        step = kept[version]
    out = export_checkpoint(run_dir, tmp / "model", step=step)
    return out, json.loads((out / EXPORT_FILE).read_text())


async def evaluate(cfg: OfflineEvalConfig, task: Any, model_dir: Path, *, engine: Literal["torch", "vllm"] = "torch",
                   device: str = "cpu", dtype: str = "float32", version: int = -1) -> dict[str, Any]:  # fmt: skip
    """Each evaluated source's held-out prompts generated on ``model_dir`` and scored (module docstring):
    ``{"version", "sources", "num_failed", "metrics": {"eval/<source>/<name>": value}}``."""
    from actors.generator.engine import SamplingParams
    from actors.generator.episodes import EpisodeConfig, run_group
    from actors.generator.scoring import Scoring
    from actors.learner.evaluation import eval_sampling, eval_sources, held_out_specs
    from async_rl.metrics.evaluation import SourceScores
    from async_rl.model.config import ModelConfig
    from async_rl.tasks.envs.base import EnvTask
    from async_rl.tasks.mixture import SOURCE_KEY

    sources = eval_sources(cfg.eval, cfg.task)
    specs = held_out_specs(task, sources, cfg.eval.num_prompts)
    sp = eval_sampling(cfg.eval, cfg.sampling, task)
    params = SamplingParams(n=sp.n, max_new_tokens=sp.max_new_tokens, top_p=sp.top_p, top_k=sp.top_k,
                            temperature=0.0 if cfg.eval.temperature == 0 else sp.temperature,
                            mask_special_tokens=sp.mask_special_tokens)  # fmt: skip
    model = ModelConfig(name=str(model_dir), dtype=dtype)
    gen = _engine(engine, model, device, len(specs))
    scoring = Scoring(cfg.task, max_failed_groups=0)
    try:
        owners = [task.task_for(s.metadata) for s in specs]
        single = [i for i, t in enumerate(owners) if not isinstance(t, EnvTask)]
        results = await gen.generate([specs[i].prompt_ids for i in single], params) if single else []
        groups = {i: scoring.score(owners[i], specs[i].metadata, c) for i, c in zip(single, results, strict=True)}
        for i, t in enumerate(owners):
            if isinstance(t, EnvTask):
                errors: list[BaseException] = []
                samples = await run_group(gen, t, specs[i].metadata, specs[i].prompt_ids, params, EpisodeConfig(),
                                          on_error=errors.append)  # fmt: skip
                groups[i] = scoring.episodes(samples, errors)
    finally:
        await gen.close()
    scores = {s: SourceScores() for s in sources}
    failed = 0
    for i, spec in enumerate(specs):
        group = groups[i]
        if group.failed:
            failed += 1
            continue
        samples = group.samples
        scores[spec.metadata[SOURCE_KEY]].add(
            [s.reward for s in samples], {k: [s.reward_info.get(k, 0.0) for s in samples] for k in samples[0].reward_info},
            scoring.answers(task, spec.metadata, samples), ks=cfg.eval.ks, pass_threshold=cfg.eval.pass_threshold,
            min_version=version, max_version=version)  # fmt: skip
    metrics: dict[str, float] = {}
    for source, got in scores.items():
        metrics.update({f"eval/{source}/{k}": v for k, v in got.metrics().items()})
        if got.prompts:
            metrics[f"eval/{source}/version"] = float(version)
    return {"version": version, "sources": sources, "num_failed": failed, "metrics": metrics}


def _engine(kind: str, model: Any, device: str, num_prompts: int) -> Any:
    """The generator's engine of ``kind`` on ``model``, taking all prompts in one call."""
    if kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ValueError("--engine vllm needs the vllm package (pip install 'async-rl[vllm]')") from exc
        from actors.generator.config import VLLMEngineConfig
        from actors.generator.vllm_engine import VLLMEngine

        return VLLMEngine(VLLMEngineConfig(model=model, max_batch_prompts=max(num_prompts, 1)))
    from actors.generator.config import TorchEngineConfig
    from actors.generator.torch_engine import TorchEngine

    return TorchEngine(TorchEngineConfig(model=model, device=device, max_batch_prompts=max(num_prompts, 1)))


def table(report: dict[str, Any]) -> str:
    """One row per source: prompts, reward, then each ``mean@n``, ``pass@k`` and ``maj@k`` reported ('-': none)."""
    metrics: dict[str, float] = report["metrics"]
    by_source = {s: {k.removeprefix(f"eval/{s}/"): v for k, v in metrics.items() if k.startswith(f"eval/{s}/")}
                 for s in report["sources"]}  # fmt: skip
    at = sorted({k for got in by_source.values() for k in got if "@" in k},
                key=lambda k: (k.split("@")[0], int(k.split("@")[1])))  # fmt: skip
    columns = ["num_prompts", "reward", *at]
    width = max([len("source"), *map(len, by_source)]) + 2
    lines = ["source".ljust(width) + "".join(f"{c.removeprefix('num_'):>10}" for c in columns)]
    for source, got in by_source.items():
        cells = ["-" if c not in got else f"{int(got[c])}" if c == "num_prompts" else f"{got[c]:.4f}" for c in columns]
        lines.append(source.ljust(width) + "".join(f"{c:>10}" for c in cells))
    failed = report.get("num_failed", 0)
    return "\n".join(lines) + (f"\n({failed} prompts left out: their scoring raised)" if failed else "")
