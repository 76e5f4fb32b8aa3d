"""Learner checkpoints: model + optimizer (through the backend), version, step, data
position and the set of group ids already trained on.

A checkpoint is written into ``<dir>/step-<N>.tmp`` and renamed to ``<dir>/step-<N>``
once complete (rename is atomic on POSIX), then ``<dir>/latest`` is replaced atomically.
A learner killed at any point therefore finds either the previous or the new checkpoint,
never a half-written one. The learner acks rollout entries only after the checkpoint that
includes their step is committed, so after a restart every group is trained exactly once:
groups of committed steps are skipped by id, groups of lost steps are re-read (their
entries were never acked).

:meth:`CheckpointManager.save` is :meth:`~CheckpointManager.write` (the directory) then
:meth:`~CheckpointManager.point_latest` (``latest`` and pruning): the learner checks its fencing token before each
(:mod:`async_rl.run.lease`), so a learner another one took the run from moves no ``latest`` it shares.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from actors.learner.backend import TrainingBackend

STATE_FILE = "state.json"
SEEN_FILE = "seen_groups.msgpack"
LATEST = "latest"


@dataclass(slots=True)
class LearnerState:
    """What the learner loop needs beside the model to resume."""

    step: int = 0
    """Optimizer steps taken."""
    version: int = 0
    """Weight version of the current model: the step, plus the versions a resume skipped (those published by steps
    lost with a killed learner are never reused)."""
    prompts_issued: int = 0
    """Data position: prompts issued so far (the next prompt index)."""
    published_version: int = -1
    """Newest weight version published to generators."""
    seen_group_ids: set[str] = field(default_factory=set)
    """Group ids already trained on (duplicates are skipped)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Small JSON-able extras (reward history for summaries, counters)."""


class CheckpointManager:
    """Writes and finds checkpoints under one directory, keeping the newest ``keep``."""

    root: Path
    keep: int

    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("learner.checkpoint.keep must be >= 1")
        self.root = root
        self.keep = keep
        root.mkdir(parents=True, exist_ok=True)

    def latest_path(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / STATE_FILE).is_file() else None

    def latest_meta(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint's path and its state (step, version, published version, prompts issued) without
        loading the model: what a learner compares with the run's Redis state before anything heavy."""
        path = self.latest_path()
        return None if path is None else (path, json.loads((path / STATE_FILE).read_text()))

    def save(self, backend: TrainingBackend, state: LearnerState) -> Path:
        """Write a checkpoint of ``state`` and make it the latest."""
        path = self.write(backend, state)
        self.point_latest(path)
        return path

    def write(self, backend: TrainingBackend, state: LearnerState) -> Path:
        """Write a checkpoint of ``state`` under its final name (not yet the latest); returns its directory."""
        name = f"step-{state.step:08d}"
        final = self.root / name
        tmp = self.root / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        backend.save(tmp / "backend")
        meta = {
            "step": state.step, "version": state.version, "prompts_issued": state.prompts_issued,
            "published_version": state.published_version, "extra": state.extra,
        }  # fmt: skip
        (tmp / SEEN_FILE).write_bytes(msgpack.packb(sorted(state.seen_group_ids)))
        with (tmp / STATE_FILE).open("w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def point_latest(self, path: Path) -> None:
        """Make the checkpoint written at ``path`` the latest (atomically), and prune the older ones."""
        pointer_tmp = self.root / f"{LATEST}.tmp"
        pointer_tmp.write_text(path.name)
        os.replace(pointer_tmp, self.root / LATEST)
        self._prune(keep_name=path.name)

    def load(self, backend: TrainingBackend, path: Path | None = None) -> LearnerState | None:
        path = path or self.latest_path()
        if path is None:
            return None
        meta = json.loads((path / STATE_FILE).read_text())
        seen = set(msgpack.unpackb((path / SEEN_FILE).read_bytes()))
        backend.load(path / "backend")
        return LearnerState(
            step=int(meta["step"]), version=int(meta["version"]), prompts_issued=int(meta["prompts_issued"]),
            published_version=int(meta["published_version"]), seen_group_ids=seen, extra=dict(meta.get("extra", {})),
        )  # fmt: skip

    def _prune(self, keep_name: str) -> None:
        done = sorted(p for p in self.root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
        for p in done[: max(0, len(done) - self.keep)]:
            if p.name != keep_name:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.root.glob("step-*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
