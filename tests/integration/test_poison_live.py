"""Poison pills pushed at a live learner process (tiny MoE, CPU): every malformed entry is dead-lettered with
its reason, the learner never restarts and keeps training on the valid groups around them, and no key outside
the run is read or deleted. The test is the generator: it takes issued prompts and answers each with a valid
group, one of the poison classes, or a property-based mutation (hypothesis) of a valid group."""

from __future__ import annotations

import time

import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.wire import PromptSpec, encode_group
from buffer.entry_checks import ModelFacts
from tests.integration.poison import ack_prompt, fields_of, mutate, poison_entries, push, take_prompts, valid_record
from tests.integration.procs import Procs

# tiny-moe: 22-token vocabulary, context 256, 2 MoE layers, top-2 of 4 experts (asserted against the preset below).
FACTS = ModelFacts(vocab_size=22, max_seq_len=256, num_moe_layers=2, top_k=2, num_experts=4)
NUM_SAMPLES = 2
NUM_MUTATIONS = 40


def test_poison_pills_at_a_live_learner(procs: Procs, servers: ServerSet, names: Names, other: Names) -> None:
    from async_rl.model.presets import load_model_config

    assert ModelFacts.from_hf_config(load_model_config("tiny-moe")) == FACTS
    learner = procs.learner("batch_groups=4", f"sampling.n={NUM_SAMPLES}", "rollouts.max_entry_bytes=400000",
                            "max_steps=0")  # fmt: skip
    r = redis.Redis.from_url(servers.redis_url)
    procs.wait_for("weights v0", lambda: r.get(names.weights_latest) is not None, timeout_s=120)

    def alive() -> None:
        assert learner.poll() is None, f"the learner exited ({learner.returncode})\n{procs.tails()}"

    def next_prompt() -> tuple[str, PromptSpec]:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = take_prompts(r, names, 1)
            if got:
                return got[0]
            alive()
        raise AssertionError(f"no prompt issued within 60 s\n{procs.tails()}")

    def published() -> int:
        return int(r.get(names.weights_latest) or 0)

    seed = iter(range(10**6))
    valid: dict[str, str] = {}  # entry id -> prompt id

    def push_valid() -> None:
        eid, spec = next_prompt()
        rec = valid_record(spec.prompt_id, spec.prompt_ids, FACTS, version=published(), num_samples=NUM_SAMPLES,
                           seed=next(seed))  # fmt: skip
        valid[push(r, names, fields_of(encode_group(rec), spec.prompt_id))] = spec.prompt_id
        ack_prompt(r, names, eid)

    # Every poison class, each answering an issued prompt and followed by a valid group.
    poisoned: dict[str, tuple[str, str]] = {}  # entry id -> (class, reason substring)
    i = 0
    while True:
        eid, spec = next_prompt()
        good = valid_record(spec.prompt_id, spec.prompt_ids, FACTS, version=published(), num_samples=NUM_SAMPLES,
                            seed=next(seed))  # fmt: skip
        kinds = poison_entries(r, names, good, FACTS, other=other, max_entry_bytes=400_000, published=published())
        p = kinds[i]
        poisoned[push(r, names, p.fields)] = (p.name, p.reason)
        ack_prompt(r, names, eid)
        push_valid()
        alive()
        i += 1
        if i == len(kinds):
            break
    canary = r.get(other.rollout_payload("ef" * 16))

    # Property-based mutations of valid groups (hypothesis draws each one), pushed as they are drawn.
    mutated: dict[str, str] = {}

    @settings(max_examples=NUM_MUTATIONS, deadline=None, database=None, derandomize=True)
    @given(data=st.data())
    def push_mutation(data: st.DataObject) -> None:
        eid, spec = next_prompt()
        rec = valid_record(spec.prompt_id, spec.prompt_ids, FACTS, version=published(), num_samples=NUM_SAMPLES,
                           seed=next(seed))  # fmt: skip
        mutated[push(r, names, fields_of(mutate(encode_group(rec), data.draw), spec.prompt_id))] = spec.prompt_id
        ack_prompt(r, names, eid)

    push_mutation()
    ours = set(valid) | set(poisoned) | set(mutated)

    def letters() -> dict[str, dict[bytes, bytes]]:
        return {f[b"source_id"].decode(): f for _, f in r.xrange(names.dead_letters_stream)}

    def fates() -> dict[str, str]:
        return {f[b"pid"].decode(): f[b"fate"].decode() for _, f in r.xrange(names.audit_fates)}

    def settled() -> bool:
        """Every entry we pushed is out of the rollout stream: trained, dropped or dead-lettered."""
        left = {eid.decode() for eid, _ in r.xrange(names.rollouts_stream)} & ours
        return not left

    deadline = time.monotonic() + 240
    while not settled():  # valid groups fill the last batches
        assert time.monotonic() < deadline, f"entries still unsettled\n{procs.tails()}"
        push_valid()
        time.sleep(0.05)
    alive()
    assert procs.stop("learner") == 0, procs.tails()
    log = procs.log("learner")
    assert "Traceback" not in log and log.count("resumed from checkpoint") == 0, procs.tails()

    dl, fate = letters(), fates()
    # Each poison entry: dead-lettered, its reason naming what was wrong, the traceback's last line kept.
    for eid, (name, reason) in poisoned.items():
        assert eid in dl, f"{name} was not dead-lettered"
        assert reason in dl[eid][b"reason"].decode(), (name, dl[eid][b"reason"])
        assert dl[eid][b"error"], name
    # Each valid group around them was trained; each mutation was refused or trained (or dropped as stale).
    untrained = {pid: fate.get(pid) for eid, pid in valid.items() if eid in ours and fate.get(pid) != "trained"}
    assert not untrained, untrained
    refused = sum(1 for eid in mutated if eid in dl)
    trained = sum(1 for eid, pid in mutated.items() if eid not in dl and fate.get(pid) in ("trained", "dropped_stale"))
    assert refused + trained == len(mutated), (refused, trained, len(mutated))
    assert set(dl) <= ours  # nothing but what we pushed was set aside
    # Nothing outside the run was read or deleted.
    assert r.get(other.rollout_payload("ef" * 16)) == canary
    assert r.lrange(other.key("canary-list"), 0, -1) == [b"keep me"]
    rows = procs.metrics()
    assert rows and [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    print(f"\npoison classes {len(poisoned)}, mutations {len(mutated)} (refused {refused}, trained {trained}), "
          f"valid {len(valid)}, steps {len(rows)}")  # fmt: skip
    r.close()
