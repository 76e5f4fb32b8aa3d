"""Generators as Ray actors for a running learner, as many as the learner's scaling signal asks for; Ray's
autoscaler brings up (and releases) the nodes they need.

    pip install "async-rl[ray]"
    python scripts/ray/generators.py --address auto --prefix exp1 --min 1 --max 16 --num-gpus 1 -- \\
        engine=vllm vllm.model.name=/models/my-moe task.name=jsonl task.jsonl_path=/data/prompts.jsonl

Each actor runs one ``async-rl generator`` process (id ``ray-<node>-<n>``; the run's URLs from --redis-url /
--nats-url or ASYNC_RL_REDIS_URL / ASYNC_RL_NATS_URL, handed to the process through its environment). Every
--interval-s the controller reads the learner's latest scaling signal (the Redis copy of the ScalingSignal it
also sends on NATS; async_rl/metrics/scaling.py) and moves the number of actors toward ``suggested_generators`` within
[--min, --max]: up at once, down by one, --cooldown-s after the last change. An actor Ray cannot place (its --num-gpus / --resources
exceed what the nodes have free) waits, and Ray's autoscaler launches a node for it; a node left idle is released.
A scale-down sends the newest generator SIGTERM: it finishes its batch (or releases it) and exits. When the learner
ends the run, the generators exit 0 by themselves, and so does this controller. SIGTERM / SIGINT stop them all.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger("ray-generators")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default="auto", help="Ray cluster address (ray.init)")
    p.add_argument("--prefix", required=True, help="run.prefix of the learner")
    p.add_argument("--redis-url", default=os.environ.get("ASYNC_RL_REDIS_URL"), help="the run's Redis URL")
    p.add_argument("--nats-url", default=os.environ.get("ASYNC_RL_NATS_URL"), help="the run's NATS URL")
    p.add_argument("--min", type=int, default=1, dest="min_generators", help="fewest generators")
    p.add_argument("--max", type=int, default=8, dest="max_generators", help="most generators")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs each generator actor asks Ray for")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs each generator actor asks Ray for")
    p.add_argument("--resources", type=json.loads, default={}, help='custom Ray resources per actor, JSON')
    p.add_argument("--interval-s", type=float, default=5.0, help="how often the signal is read")
    p.add_argument("--cooldown-s", type=float, default=60.0, help="least time from a change to a scale-down")
    args = p.parse_args(argv)
    if not args.redis_url or not args.nats_url:
        p.error("--redis-url and --nats-url (or ASYNC_RL_REDIS_URL / ASYNC_RL_NATS_URL) are required")
    if not 0 <= args.min_generators <= args.max_generators or args.max_generators < 1:
        p.error("need 0 <= --min <= --max and --max >= 1")
    return args, extra


class Generator:
    """One ``async-rl generator`` process inside a Ray actor (see ``remote_class``)."""

    def __init__(self, argv: list[str], env: dict[str, str], index: int) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.generator_id = f"ray-{self.node_id[-8:]}-{index}"
        cmd = [sys.executable, "-m", "actors.commands", "generator", f"generator_id={self.generator_id}", *argv]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdin=subprocess.DEVNULL)

    def info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "generator_id": self.generator_id, "pid": self.proc.pid}

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float = 90.0) -> int:
        """SIGTERM: the generator drains its batch in hand (or releases it) and exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Controller:
    """Keeps the number of generator actors on the learner's suggestion (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, generator_args: list[str]) -> None:
        import ray
        import redis

        from async_rl.run.names import Names

        self.args = args
        self.names = Names(prefix=args.prefix)
        self.redis = redis.Redis.from_url(args.redis_url)
        self.argv = [f"run.prefix={args.prefix}", *generator_args]
        self.env = {"ASYNC_RL_REDIS_URL": args.redis_url, "ASYNC_RL_NATS_URL": args.nats_url}
        self.remote = ray.remote(num_cpus=args.num_cpus, num_gpus=args.num_gpus, resources=args.resources or None,
                                 max_restarts=0)(Generator)  # fmt: skip
        self.actors: list[Any] = []
        self.started = 0
        self.last_change = time.monotonic()
        self.stop_event = threading.Event()

    def _decoded(self, key: str) -> Any:
        from async_rl.servers.control import MessageError, decode

        raw = self.redis.get(key)
        try:
            return decode(raw) if isinstance(raw, bytes) else None
        except MessageError:
            return None

    def target(self, have: int) -> int:
        """Generators wanted, from the learner's latest signal. Its suggestion counts the generators alive (sending
        heartbeats); ours may include some still starting, so: up to at least the suggestion, down only when every
        one of ours is counted, otherwise keep what we have."""
        sig = self._decoded(self.names.scaling_state)
        if sig is None:
            want = have
        elif sig.decision == "up":
            want = max(have, sig.suggested_generators)
        elif sig.decision == "down" and sig.generators >= have:
            want = sig.suggested_generators
        else:
            want = have
        return max(self.args.min_generators, min(self.args.max_generators, want))

    def add(self) -> None:
        self.started += 1
        actor = self.remote.remote(self.argv, self.env, self.started)
        self.actors.append(actor)
        log.info("generator actor %d requested (%d in all)", self.started, len(self.actors))

    def remove_newest(self) -> None:
        import ray

        actor = self.actors.pop()
        rc = ray.get(actor.stop.remote())
        ray.kill(actor)
        log.info("scaled down: a generator stopped with exit code %s (%d left)", rc, len(self.actors))

    def reap(self) -> None:
        """Forget actors whose generator has exited (the end of the run, or a failure)."""
        import ray

        for actor in list(self.actors):
            try:
                rc = ray.get(actor.poll.remote(), timeout=2)
            except ray.exceptions.GetTimeoutError:  # not placed yet: a node is being launched for it
                continue
            if rc is not None:
                info = ray.get(actor.info.remote())
                log.info("generator %s on node %s exited with %d", info["generator_id"], info["node_id"][-8:], rc)
                self.actors.remove(actor)
                ray.kill(actor)

    def run(self) -> int:
        from async_rl.servers.control import RunEnded

        for _ in range(self.args.min_generators):
            self.add()
        while not self.stop_event.wait(self.args.interval_s):
            self.reap()
            ended = self._decoded(self.names.run_ended)
            if isinstance(ended, RunEnded):
                if not self.actors:
                    log.info("run %s ended at step %d (%s); every generator has exited", self.args.prefix,
                             ended.step, ended.reason)  # fmt: skip
                    return 0
                continue  # the generators drain and exit by themselves
            have = len(self.actors)
            want = self.target(have)
            if want > have:
                log.info("scaling up %d -> %d (learner's suggestion)", have, want)
                for _ in range(want - have):
                    self.add()
                self.last_change = time.monotonic()
            elif want < have and time.monotonic() - self.last_change >= self.args.cooldown_s:
                log.info("scaling down %d -> %d (learner's suggestion)", have, have - 1)
                self.remove_newest()
                self.last_change = time.monotonic()
        while self.actors:  # stopped by a signal
            self.remove_newest()
        return 0


def main(argv: list[str] | None = None) -> int:
    args, generator_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ray-generators %(levelname)s: %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    import ray

    ray.init(address=args.address, logging_level=logging.WARNING)
    controller = Controller(args, generator_args)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: controller.stop_event.set())
    try:
        return controller.run()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
