"""In-process training with controlled staleness: the learner's own code paths, no servers, no timing noise.

The learner's functions (``build_samples``, ``make_micro_batches``, ``make_loss_fn``, the backend's
``forward_logprobs`` / ``train_step``, ``CheckpointManager``) train on groups sampled by the real
:class:`TorchEngine` (routes recorded, replayed by the learner). The lag is exact: the learner at version
v trains on a batch sampled with the weights of version max(0, v - S), kept in a window of the last S + 1
versions (``random_staleness``: S uniform in [0, S] per step).

``mixed`` makes sequences span two versions, as rollouts continued across a weight swap do: each
response's first ``ceil(budget / 2)`` tokens come from version v - S, the rest from version v (a second
engine that follows the learner). ``per_token`` hands the learner each token's own logprob and version;
``oldest`` treats the sequence as its oldest version, as a system without per-token versions must: the
newer tokens' behaviour logprobs are recomputed under version v - S (and their versions set to it).

One dict per step (:meth:`Simulation.step`): reward and its components, the lag, the log-ratio statistics
between learner and behaviour, grad norm, entropy, timings. Used by ``scripts/copy_sim.py`` and
``async-rl bench staleness``.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from actors.generator.config import TorchEngineConfig
from actors.generator.engine import Completion, SamplingParams
from actors.generator.torch_engine import TorchEngine
from actors.learner.backend import TrainingBackend
from actors.learner.batching import make_micro_batches
from actors.learner.build import build_backend
from actors.learner.checkpoint import CheckpointManager, LearnerState
from actors.learner.config import LearnerConfig
from actors.learner.samples import build_samples
from async_rl.algorithms import make_loss_fn
from async_rl.algorithms.batch import MicroBatch
from async_rl.config.configurable import load_config
from async_rl.model import toy_tokenizer as tt
from async_rl.tasks.base import Task
from async_rl.tasks.config import build_task
from async_rl.wire.types import GroupRecord, Sample

MixedMode = Literal["off", "per_token", "oldest"]
MIXED_MODES: tuple[MixedMode, ...] = ("off", "per_token", "oldest")
NO_SERVERS = ["run.redis_url=redis://127.0.0.1:1/0", "run.nats_url=nats://127.0.0.1:1"]
"""The learner config wants server URLs; nothing here connects to them."""
Weights = dict[str, torch.Tensor]


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One in-process run."""

    staleness: int = 1
    """S: the batch trained at learner version v is sampled with version max(0, v - S)."""
    random_staleness: bool = False
    """Draw the lag uniformly from [0, S] at every step instead."""
    mixed: MixedMode = "off"
    """``per_token`` / ``oldest``: responses span versions v - S and v (see the module docstring); ``off``: one."""
    seed: int = 0
    """Seeds the engines' sampling (the learner's seeds come from its overrides)."""
    threads: int = 1
    """torch threads of this process."""
    overrides: list[str] = field(default_factory=list)
    """Dotted ``key=value`` learner overrides (model, task, batch, lr, algorithm)."""

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.mixed not in MIXED_MODES:
            raise ValueError(f"mixed must be one of {list(MIXED_MODES)}, got {self.mixed!r}")
        if self.mixed != "off" and self.random_staleness:
            raise ValueError("mixed and random_staleness do not combine")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


def _engine(seed: int, threads: int) -> TorchEngine:
    return TorchEngine(TorchEngineConfig(seed=seed, num_threads=threads, max_batch_sequences=512))


def _follow(engine: TorchEngine, version: int, weights: Weights) -> None:
    if engine.version < version:
        engine.stage_weights(weights, version)
        engine.wait_staged(version)


def _log_ratio_stats(mbs: list[MicroBatch], learner_lp: list[torch.Tensor]) -> dict[str, float]:
    """|log π_learner - log μ| over the response tokens, before the step (π_learner = the weights it updates)."""
    diffs = torch.cat([(lp - mb.behaviour_logprobs)[mb.loss_mask] for mb, lp in zip(mbs, learner_lp, strict=True)])
    if diffs.numel() == 0:
        return {}
    a = diffs.abs().double()
    return {"log_ratio_mean": float(diffs.mean()), "abs_log_ratio_mean": float(a.mean()),
            "abs_log_ratio_p99": float(a.quantile(0.99)), "abs_log_ratio_max": float(a.max()),
            "log_ratio_sq_mean": float(diffs.double().square().mean())}  # fmt: skip


class Simulation:
    """A learner, its behaviour engine(s) and the window of past weights; :meth:`step` trains one batch."""

    cfg: LearnerConfig
    sim: SimConfig
    task: Task
    backend: TrainingBackend
    engine: TorchEngine
    fresh_engine: TorchEngine | None
    scorer: TrainingBackend | None
    weights: collections.deque[tuple[int, Weights]]
    version: int
    index: int
    steps: int
    _rng: np.random.Generator

    def __init__(self, sim: SimConfig) -> None:
        torch.set_num_threads(sim.threads)
        self.sim = sim
        self.cfg = load_config(LearnerConfig, None, [*NO_SERVERS, *sim.overrides])
        self.task = build_task(self.cfg.task)
        self.backend = build_backend(self.cfg)
        self.engine = _engine(sim.seed, sim.threads)
        self.fresh_engine = _engine(sim.seed + 10_000, sim.threads) if sim.mixed != "off" else None
        self.scorer = build_backend(self.cfg) if sim.mixed == "oldest" else None
        self.weights = collections.deque(maxlen=sim.staleness + 1)
        self.version, self.index, self.steps = 0, 0, 0
        self._rng = np.random.default_rng(sim.seed)
        self._keep_weights()
        _follow(self.engine, 0, self.weights[0][1])

    def _keep_weights(self) -> None:
        self.weights.append((self.version, {k: v.clone() for k, v in self.backend.export_weights()}))

    def _sampling(self, max_new_tokens: int, n: int) -> SamplingParams:
        return SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=(tt.EOS_ID,))

    def _generate(self, prompts: list[np.ndarray], old: int) -> list[list[Completion]]:
        """Completions of every prompt: from version ``old``, or (mixed) from ``old`` then the learner's own."""
        budget, n = self.task.max_new_tokens, self.cfg.sampling.n
        window = dict(self.weights)
        _follow(self.engine, old, window[old])
        if self.fresh_engine is None:
            return asyncio.run(self.engine.generate(prompts, self._sampling(budget, n)))
        cut = math.ceil(budget / 2)
        heads = asyncio.run(self.engine.generate(prompts, self._sampling(cut, n)))
        _follow(self.fresh_engine, self.version, window[self.version])
        todo = [(i, j) for i, comps in enumerate(heads) for j, c in enumerate(comps) if c.finish_reason == "length"]
        if not todo or budget == cut:
            return heads
        continued = [np.concatenate([prompts[i], heads[i][j].token_ids]).astype(np.int32) for i, j in todo]
        tails = asyncio.run(self.fresh_engine.generate(continued, self._sampling(budget - cut, 1)))
        for (i, j), (tail,) in zip(todo, tails, strict=True):
            head = heads[i][j]
            heads[i][j] = Completion(token_ids=np.concatenate([head.token_ids, tail.token_ids]),
                                     logprobs=np.concatenate([head.logprobs, tail.logprobs]),
                                     versions=np.concatenate([head.versions, tail.versions]),
                                     finish_reason=tail.finish_reason, routes=tail.routes)  # fmt: skip
        return heads

    def _as_oldest(self, mbs: list[MicroBatch], old: int) -> None:
        """Behaviour logprobs of the tokens newer than ``old`` recomputed under version ``old``; their versions set
        to it (what a learner that knows one version per sequence would train on)."""
        assert self.scorer is not None
        self.scorer.model.load_state_dict(dict(self.weights)[old])  # type: ignore[attr-defined]
        for mb in mbs:
            newer = mb.loss_mask & (mb.token_versions > old)
            if newer.any():
                lp = self.scorer.forward_logprobs(mb, replay_routes=False).logprobs
                mb.behaviour_logprobs = torch.where(newer, lp, mb.behaviour_logprobs)
                mb.token_versions = torch.where(newer, torch.full_like(mb.token_versions, old), mb.token_versions)

    def step(self, *, probe: bool = False) -> dict[str, Any]:
        """Sample a batch with the lagged weights, train on it, keep the new weights; the step's figures."""
        t0 = time.monotonic()
        self.steps += 1
        cfg, sim = self.cfg, self.sim
        lag = int(self._rng.integers(0, sim.staleness + 1)) if sim.random_staleness else sim.staleness
        old = max(0, self.version - lag)
        specs = [self.task.prompt(self.index + i) for i in range(cfg.batch_groups)]
        self.index += cfg.batch_groups
        completions = self._generate([s.prompt_ids for s in specs], old)
        t_gen = time.monotonic() - t0
        groups = []
        for spec, comps in zip(specs, completions, strict=True):
            samples = []
            for c in comps:
                score = self.task.score(spec.metadata, c.token_ids)
                samples.append(Sample(response_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                                      reward=score.reward, finish_reason=c.finish_reason, routes=c.routes,
                                      reward_info=dict(score.info)))  # fmt: skip
            groups.append(GroupRecord(group_id=spec.prompt_id, prompt_id=spec.prompt_id, generator_id="sim",
                                      created_at=time.time(), prompt_ids=spec.prompt_ids, samples=samples))  # fmt: skip
        token_versions = np.concatenate([s.versions for g in groups for s in g.samples])
        train_samples, adv_metrics, rewards = build_samples(groups, cfg)
        mbs = make_micro_batches(train_samples, cfg.batching)
        if sim.mixed == "oldest":
            self._as_oldest(mbs, old)
        learner_lp = [self.backend.forward_logprobs(mb, replay_routes=cfg.replay_routes).logprobs for mb in mbs]
        if cfg.algorithm.needs_proximal_logprobs:
            for mb, lp in zip(mbs, learner_lp, strict=True):
                mb.proximal_logprobs = lp
        loss_fn = make_loss_fn(cfg.algorithm, learner_version=self.version)
        before = [p.detach().clone() for p in self.backend.model.parameters()] if probe else []  # type: ignore[attr-defined]
        result = self.backend.train_step(mbs, loss_fn, replay_routes=cfg.replay_routes, with_entropy=True)
        probe_row = _probe(self.backend, mbs, before, learner_lp) if probe else {}
        learner_version = self.version
        self.version += 1
        self._keep_weights()
        m = result.metrics
        info: dict[str, list[float]] = collections.defaultdict(list)
        for g in groups:
            for s in g.samples:
                for k, v in s.reward_info.items():
                    info[k].append(v)
        lags = learner_version - token_versions if token_versions.size else np.zeros(1)
        return {"step": self.steps, "version": learner_version, "behaviour_version": old, "lag": lag,
                "token_lag_min": int(lags.min()), "token_lag_max": int(lags.max()),
                "reward": float(np.mean(rewards)), **{f"reward/{k}": float(np.mean(v)) for k, v in info.items()},
                **_log_ratio_stats(mbs, learner_lp), "grad_norm": result.grad_norm, "lr": m.get("lr"),
                "entropy": m.get("entropy_mean"), "is_ratio_max": m.get("is_ratio_max"),
                "cispo_ratio_max": m.get("cispo/ratio_max"), "clip_ratio": m.get("clip_ratio"),
                "kept_frac": m.get("kept_frac"), "zero_std_groups": adv_metrics.get("adv_zero_std_groups_count"),
                "resp_len": float(np.mean([s.response_ids.size for g in groups for s in g.samples])),
                "adv_abs_mean": adv_metrics.get("adv_abs_mean"), **probe_row,
                "gen_s": t_gen, "step_s": time.monotonic() - t0}  # fmt: skip

    def restart(self, directory: Path) -> None:
        """Save a checkpoint, build a fresh backend and load it (as a restarted learner does)."""
        ckpt = CheckpointManager(directory, keep=1)
        ckpt.save(self.backend, LearnerState(step=self.steps, version=self.version))
        self.backend = build_backend(self.cfg)
        ckpt.load(self.backend)

    def close(self) -> None:
        for engine in (self.engine, self.fresh_engine):
            if engine is not None:
                asyncio.run(engine.close())


def _probe(backend: TrainingBackend, mbs: list[MicroBatch], before: list[torch.Tensor],
           lp_before: list[torch.Tensor]) -> dict[str, float]:  # fmt: skip
    """How far the step moved the weights and the policy, and what Adam's second moment looks like."""
    params = list(backend.model.parameters())  # type: ignore[attr-defined]
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before, strict=True)])
    out: dict[str, float] = {"upd_norm": float(delta.norm()), "upd_max": float(delta.abs().max())}
    shifts = []
    for mb, lp0 in zip(mbs, lp_before, strict=True):
        lp1 = backend.forward_logprobs(mb, replay_routes=False).logprobs
        shifts.append((lp1 - lp0)[mb.loss_mask].abs())
    shift = torch.cat(shifts)
    out.update(policy_shift_mean=float(shift.mean()), policy_shift_max=float(shift.max()))
    optimizer = backend.optimizer  # type: ignore[attr-defined]
    sq = [st["exp_avg_sq"].flatten() for st in optimizer.state.values() if "exp_avg_sq" in st]
    if sq:
        v = torch.cat(sq).sqrt()
        out.update(adam_sqrt_v_median=float(v.median()), adam_sqrt_v_p10=float(v.quantile(0.1)))
    return out
