"""Every Redis key and NATS subject of a run, built in exactly one place.

A run is identified by its ``prefix`` (default ``"async-rl"``). Tests give each test its
own prefix so that nothing outside it is touched; :meth:`Names.all_key_pattern` matches
every key of a run for clean-up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TOKEN_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True, slots=True)
class Names:
    """Key and subject names for one run."""

    prefix: str = "async-rl"

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"run.prefix {self.prefix!r} must be 1-64 characters of letters, digits, '_', '.', '-'")

    # ---- Redis: data plane -------------------------------------------------------------
    def key(self, *parts: str | int) -> str:
        return ":".join([self.prefix, *(str(p) for p in parts)])

    @property
    def prompts_stream(self) -> str:
        """Stream of prompt entries, read by generators through :attr:`prompts_group`."""
        return self.key("prompts")

    @property
    def rollouts_stream(self) -> str:
        """Stream of encoded group records, read by the learner through :attr:`rollouts_group`."""
        return self.key("rollouts")

    @property
    def dead_letters_stream(self) -> str:
        """Stream of entries that could not be decoded or validated, with their reason and source."""
        return self.key("dead-letters")

    @property
    def rollout_acks_stream(self) -> str:
        """Short stream the rollout reader appends to after each ack, waking producers held by back-pressure."""
        return self.key("rollouts", "acks")

    def rollout_payload(self, token: str) -> str:
        """String key holding the bytes of a large rollout record; its stream entry carries this key.

        ``token`` is 32 lowercase hex digits (a uuid4): :meth:`is_rollout_payload` accepts nothing else;
        ``"*"`` gives the pattern of all of them (SCAN, ACL rules).
        """
        if not _TOKEN_RE.match(token) and token != "*":
            raise ValueError(f"rollout payload token must be 32 lowercase hex digits, got {token!r}")
        return self.key("rollouts", "payload", token)

    def is_rollout_payload(self, key: str) -> bool:
        """Whether ``key`` is a payload key of this run as :meth:`rollout_payload` builds it.

        The learner follows (and deletes) only such keys: a stream entry naming any other key, of this run
        or another, is refused, so nothing a producer writes can make it read or delete a key outside the run.
        """
        prefix = self.key("rollouts", "payload", "")
        return key.startswith(prefix) and bool(_TOKEN_RE.match(key[len(prefix) :]))

    @property
    def rollout_errors(self) -> str:
        """Hash of the last error per rollout entry id (what failed while the learner held it), for dead letters."""
        return self.key("rollouts", "errors")

    # ---- audit: the fate of every issued prompt (buffer.audit) ----
    @property
    def audit_open(self) -> str:
        """Hash of prompts issued and not yet finished: prompt id -> ``entry id|issued version|issued at``."""
        return self.key("audit", "open")

    @property
    def audit_fates(self) -> str:
        """Stream of final fates (trained / dropped_stale / dead_lettered), one entry per issued prompt."""
        return self.key("audit", "fates")

    @property
    def audit_counters(self) -> str:
        """Hash of totals: issued, trained, dropped_stale, dead_lettered (in flight = issued - the rest)."""
        return self.key("audit", "counters")

    prompts_group: str = "generators"
    rollouts_group: str = "learner"

    # ---- evaluation: held-out prompts, apart from training (buffer.evals) ----
    @property
    def evaluation(self) -> EvalNames:
        """The names of the run's evaluation queue: the prompt stream, audit and counters keys under
        ``<prefix>:eval:``, so that a prompt queue and an audit built on them never touch training's."""
        return EvalNames(prefix=self.prefix)

    @property
    def eval_results_stream(self) -> str:
        """Stream of scored evaluation prompts (generators append, the learner reads by cursor)."""
        return self.key("eval", "results")

    @property
    def prompt_counters(self) -> str:
        """Hash of prompt admission counters (issued, consumed)."""
        return self.key("prompts", "counters")

    @property
    def rollout_counters(self) -> str:
        """Hash of rollout counters (appended, consumed, dropped_stale, dead_letters)."""
        return self.key("rollouts", "counters")

    @property
    def weights_latest(self) -> str:
        """String key holding the newest complete weight version (an int)."""
        return self.key("weights", "latest")

    @property
    def weights_versions(self) -> str:
        """Sorted set of complete versions kept (score = version)."""
        return self.key("weights", "versions")

    def weights_manifest(self, version: int) -> str:
        return self.key("weights", version, "manifest")

    def weights_bucket(self, version: int, index: int) -> str:
        return self.key("weights", version, "bucket", index)

    def weights_bucket_part(self, version: int, index: int, part: int) -> str:
        """Part ``part`` >= 1 of a bucket too large for one Redis value (part 0 is :meth:`weights_bucket`)."""
        return self.key("weights", version, "bucket", index, part)

    def weights_readers(self, version: int) -> str:
        """Sorted set of reader leases on a version (member = reader id, score = lease expiry in ms)."""
        return self.key("weights", version, "readers")

    def weights_relays(self, version: int) -> str:
        """Hash of the peers holding or receiving a version over the ``peer://`` transport (peer id -> JSON
        entry: addresses, parent, depth, progress, expiry; see :mod:`async_rl.weights.peer.topology`)."""
        return self.key("weights", version, "relays")

    @property
    def weights_staging(self) -> str:
        """Hash of versions being written (version -> bucket count), so a restarted publisher can clean them."""
        return self.key("weights", "staging")

    @property
    def weights_retiring(self) -> str:
        """Hash of pruned versions (version -> bucket count) whose data waits for its reader leases to end."""
        return self.key("weights", "retiring")

    @property
    def weights_gpu_latest(self) -> str:
        """String key holding the newest weight version held in the learner's GPU buffers (same-host readers take it
        over CUDA IPC: :mod:`async_rl.weights.gpu.publisher`)."""
        return self.key("weights", "gpu", "latest")

    def weights_gpu_manifest(self, version: int) -> str:
        """A GPU-held version's manifest: its tensors, bucket checksums and the CUDA IPC handles of its buffers."""
        return self.key("weights", "gpu", version, "manifest")

    def weights_gpu_readers(self, version: int) -> str:
        """Sorted set of reader leases on a GPU-held version (member = reader id, score = expiry in ms): its buffers
        are not overwritten while one is live."""
        return self.key("weights", "gpu", version, "readers")

    @property
    def weights_want_full(self) -> str:
        """Sorted set of generators asking for a full version (member = reader id, score = unix ms); the publisher
        takes it before each version and then publishes a full one (a late joiner, a refused delta)."""
        return self.key("weights", "want_full")

    @property
    def generators(self) -> str:
        """Hash: generator id -> its last heartbeat (kept by the learner; ``async-rl status`` lists the departed)."""
        return self.key("generators")

    @property
    def learner_state(self) -> str:
        """Hash the learner publishes about itself (version, step, started_at)."""
        return self.key("learner", "state")

    @property
    def learner_lease(self) -> str:
        """Hash of the run's leadership (token, host, pid, since, run_dir) with a time-to-live that its learner renews:
        while it exists no other learner starts on the run (:mod:`async_rl.run.lease`)."""
        return self.key("learner", "lease")

    @property
    def learner_fence(self) -> str:
        """Hash of the run's fencing token: ``n``, a counter every learner that takes the lease increments, and
        ``current``, the token of the lease's holder (``<n>:<nonce>``); every learner write is refused by Redis unless
        it carries ``current`` (:mod:`async_rl.run.lease`). Never expires."""
        return self.key("learner", "fence")

    @property
    def run_ended(self) -> str:
        """String key holding the encoded :class:`~async_rl.servers.control.RunEnded` of a finished run (absent while it
        runs; a learner that starts or resumes the run deletes it)."""
        return self.key("run", "ended")

    @property
    def scaling_state(self) -> str:
        """String key holding the learner's latest encoded :class:`~async_rl.servers.control.ScalingSignal`."""
        return self.key("learner", "scaling")

    def all_key_pattern(self) -> str:
        return f"{self.prefix}:*"

    # ---- NATS: control plane -----------------------------------------------------------
    def subject(self, *parts: str) -> str:
        return ".".join([self.prefix.replace(".", "_"), *parts])

    @property
    def weights_subject(self) -> str:
        """Announcements of newly complete weight versions."""
        return self.subject("weights")

    @property
    def heartbeat_subject(self) -> str:
        """Generator heartbeats (one subject; the payload names the generator)."""
        return self.subject("heartbeat")

    @property
    def control_subject(self) -> str:
        """Pause / resume / drain / stop commands addressed to generators."""
        return self.subject("control")

    @property
    def learner_subject(self) -> str:
        """Learner progress events (step metrics) for status views and the quickstart."""
        return self.subject("learner")

    @property
    def scaling_subject(self) -> str:
        """The learner's scaling signal (wait share, backlog, suggested generators) for autoscalers."""
        return self.subject("scaling")


@dataclass(frozen=True, slots=True)
class EvalNames(Names):
    """:class:`Names` whose prompt queue and audit keys are the evaluation queue's (``<prefix>:eval:...``); every
    other name (dead letters, weights, subjects) is the run's own."""

    @property
    def prompts_stream(self) -> str:
        return self.key("eval", "prompts")

    @property
    def audit_open(self) -> str:
        return self.key("eval", "open")

    @property
    def audit_fates(self) -> str:
        return self.key("eval", "fates")

    @property
    def audit_counters(self) -> str:
        return self.key("eval", "counters")

    @property
    def prompt_counters(self) -> str:
        return self.key("eval", "prompt-counters")
