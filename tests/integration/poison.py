"""Valid and malformed rollout entries for the poison-pill tests, built for a model's facts.

``valid_record`` builds what a correct generator would send for an issued prompt; ``poison_entries``
builds one stream entry (its raw fields) for every class of malformed entry seen in the field, each
with the substring its dead letter's reason must contain; ``mutate`` applies one property-based
mutation (drawn by hypothesis) to an encoded valid record. Plain sync helpers, so a test can drive
them from hypothesis' ``@given`` while a learner process reads the stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import redis

from async_rl.model.moe import route_dtype
from async_rl.run.names import Names
from async_rl.wire import PromptSpec, decode_prompt, encode_group
from async_rl.wire.types import GroupRecord, Sample
from buffer.entry_checks import ModelFacts


def valid_record(pid: str, prompt_ids: np.ndarray, facts: ModelFacts, *, version: int, num_samples: int,
                 seed: int, response_tokens: int = 6, episode: bool = False) -> GroupRecord:  # fmt: skip
    """A correct group for prompt ``pid``: ids in the vocabulary, distinct experts per row, one version; ``episode``:
    each response is model, environment, model tokens (a third each, the environment's out of the loss mask)."""
    rng = np.random.default_rng(seed)
    prompt = np.asarray(prompt_ids, dtype=np.int32)
    samples = []
    for i in range(num_samples):
        n = response_tokens
        routes = None
        if facts.num_moe_layers:
            t = prompt.size + n - 1
            rows = np.argsort(rng.random((t, facts.num_moe_layers, facts.num_experts)), axis=-1)[..., : facts.top_k]
            routes = rows.astype(route_dtype(facts.num_experts))
        samples.append(Sample(
            response_ids=rng.integers(0, facts.vocab_size, n, dtype=np.int32),
            logprobs=-rng.exponential(1.0, n).astype(np.float32), versions=np.full(n, version, dtype=np.int32),
            reward=float(i % 2), finish_reason="length", routes=routes, reward_info={"correct": float(i % 2)},
            loss_mask=(np.arange(n) * 3 // n != 1).astype(np.uint8) if episode and n >= 3 else None,
        ))  # fmt: skip
    return GroupRecord(group_id=pid, prompt_id=pid, generator_id="poison-test", created_at=time.time(),
                       prompt_ids=prompt, samples=samples, metadata={"task": "copy"})  # fmt: skip


def take_prompts(r: redis.Redis, names: Names, count: int, block_ms: int = 200) -> list[tuple[str, PromptSpec]]:
    """Read up to ``count`` issued prompts as a generator would (consumer group, sync client)."""
    try:
        r.xgroup_create(names.prompts_stream, names.prompts_group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    resp: Any = r.xreadgroup(names.prompts_group, "poison-gen", {names.prompts_stream: ">"}, count=count,
                             block=block_ms)  # fmt: skip
    if not resp:
        return []
    return [(eid.decode(), decode_prompt(f[b"spec"])) for eid, f in resp[0][1]]


def ack_prompt(r: redis.Redis, names: Names, entry_id: str) -> None:
    r.xack(names.prompts_stream, names.prompts_group, entry_id)
    r.xdel(names.prompts_stream, entry_id)


def push(r: redis.Redis, names: Names, fields: dict[bytes, Any]) -> str:
    """XADD raw fields to the rollout stream (what a producer can do whatever the writer checks)."""
    return r.xadd(names.rollouts_stream, fields).decode()  # type: ignore[union-attr]


def fields_of(data: bytes, gid: str, gen: str = "poison-gen") -> dict[bytes, Any]:
    return {b"gen": gen.encode(), b"gid": gid.encode(), b"rec": data}


def _tree(data: bytes) -> dict[str, Any]:
    return msgspec.msgpack.decode(data)


def _arr(values: np.ndarray) -> list[Any]:
    a = np.ascontiguousarray(values)
    return [a.dtype.str, list(a.shape), a.tobytes()]


@dataclass
class Poison:
    """One malformed entry: its class, the raw fields to XADD, and what its dead letter's reason must say."""

    name: str
    fields: dict[bytes, Any]
    reason: str


def poison_entries(r: redis.Redis, names: Names, good: GroupRecord, facts: ModelFacts, *, other: Names,
                   max_entry_bytes: int, published: int) -> list[Poison]:  # fmt: skip
    """Every class of malformed entry, built around ``good`` (whose prompt id is in flight).

    Keys it creates: a LIST under one of this run's payload key names (WRONGTYPE), and under ``other``
    (another run) a string holding a valid record and a list: a learner must neither read nor delete those.
    """
    pid = good.prompt_id
    base = encode_group(good)
    out: list[Poison] = []

    def variant(name: str, reason: str, edit: Any) -> None:
        t = _tree(base)
        edit(t)
        out.append(Poison(name, fields_of(msgspec.msgpack.encode(t), pid), reason))

    def huge_run(t: dict[str, Any]) -> None:
        s = t["samples"][0]
        s["ver"] = None
        s["ver_runs"] = _arr(np.array([[0, 2**31 - 1]], dtype="<i4"))

    variant("version run of 2**31 tokens", "runs cover 2147483647 tokens", huge_run)
    deep = b"\x81\xa1a" * 100_000 + b"\xc0"
    raw = bytearray(base)
    # meta is the record's last field: {"task": "copy"} (fixmap of one pair); replace it by a 100,000-deep map.
    tail = msgspec.msgpack.encode({"task": "copy"})
    assert raw.endswith(tail)
    out.append(Poison("metadata nested 100,000 deep", fields_of(bytes(raw[: -len(tail)]) + deep, pid),
                      "nested more than"))  # fmt: skip

    def set_id(value: int, where: str) -> Any:
        def edit(t: dict[str, Any]) -> None:
            if where == "prompt":
                ids = np.frombuffer(t["prompt"][2], dtype="<i4").copy()
                ids[0] = value
                t["prompt"] = _arr(ids)
            else:
                ids = np.frombuffer(t["samples"][1]["ids"][2], dtype="<i4").copy()
                ids[2] = value
                t["samples"][1]["ids"] = _arr(ids)

        return edit

    variant("response token id = vocab size", "is not in the model's vocabulary", set_id(facts.vocab_size, "r"))
    variant("prompt token id 10**9", "is not in the model's vocabulary", set_id(10**9, "prompt"))
    variant("negative token id", "is not in the model's vocabulary", set_id(-5, "r"))

    def routes_edit(fn: Any, every_sample: bool = False) -> Any:
        def edit(t: dict[str, Any]) -> None:
            for s in t["samples"] if every_sample else t["samples"][:1]:
                dt, shape, data = s["routes"]
                routes = np.frombuffer(data, dtype=dt).reshape(shape).copy()
                s["routes"] = _arr(fn(routes))

        return edit

    def bad_expert(a: np.ndarray) -> np.ndarray:
        a[1, 0, 0] = facts.num_experts
        a[1, 0, 1] = (facts.num_experts + 1) % 256
        return a

    def twice(a: np.ndarray) -> np.ndarray:
        a[2, 1, 1] = a[2, 1, 0]
        return a

    variant("expert id >= num_experts", "is not below the model's", routes_edit(bad_expert))
    variant("routes for one more MoE layer", "MoE layers, the model has",
            routes_edit(lambda a: np.concatenate([a, a[:, :1]], axis=1), every_sample=True))  # fmt: skip
    variant("routes with top_k + 1", "routes with top_k",
            routes_edit(lambda a: np.concatenate([a, (a[:, :, :1] + 1) % facts.num_experts], axis=2), True))
    variant("routes of different shapes across samples", "other samples",
            routes_edit(lambda a: np.concatenate([a, a[:, :1]], axis=1)))
    variant("the same expert twice in a row", "appears twice", routes_edit(twice))

    def too_long(t: dict[str, Any]) -> None:
        n = facts.max_seq_len
        for s in t["samples"]:
            s["ids"] = _arr(np.ones(n, dtype="<i4"))
            s["lp"] = _arr(np.full(n, -1.0, dtype="<f4"))
            s["ver"], s["ver_runs"] = _arr(np.zeros(n, dtype="<i4")), None
            s["routes"] = None

    variant("sequence longer than the context", "exceed the model's context", too_long)

    def future(t: dict[str, Any]) -> None:
        s = t["samples"][0]
        n = len(s["lp"][2]) // 4
        s["ver"], s["ver_runs"] = _arr(np.full(n, published + 1000, dtype="<i4")), None

    variant("token version newer than published", "newer than the newest published version", future)
    variant("one sample too few", "the run samples 2 per prompt", lambda t: t.__setitem__("samples", t["samples"][:-1]))

    def unknown(t: dict[str, Any]) -> None:
        t["pid"] = t["gid"] = "never-issued-7"

    t = _tree(base)
    unknown(t)
    out.append(Poison("prompt id never issued", fields_of(msgspec.msgpack.encode(t), "never-issued-7"),
                      "is not in flight"))  # fmt: skip
    out.append(Poison("not a group record", fields_of(b"\x93garbage", pid), "group record"))
    out.append(Poison("truncated record", fields_of(base[:-9], pid), "msgpack"))
    out.append(Poison("no record field", {b"gen": b"poison-gen", b"gid": pid.encode()}, "no 'rec' field"))
    out.append(Poison("record over max_entry_bytes", fields_of(base + b"\0" * max_entry_bytes, pid),
                      "max_entry_bytes"))  # fmt: skip
    wrongtype = names.rollout_payload("ab" * 16)
    if not r.exists(wrongtype):
        r.rpush(wrongtype, b"x")
    out.append(Poison("side key of the wrong type", {b"gen": b"poison-gen", b"gid": pid.encode(),
                                                    b"ref": wrongtype.encode()}, "WRONGTYPE"))  # fmt: skip
    gone = names.rollout_payload("cd" * 16)
    out.append(Poison("side key that does not exist", {b"gen": b"poison-gen", b"gid": pid.encode(),
                                                      b"ref": gone.encode()}, "is gone"))  # fmt: skip
    canary = other.rollout_payload("ef" * 16)  # another run's payload key, holding a valid record
    r.set(canary, base)
    canary_list = other.key("canary-list")
    if not r.exists(canary_list):
        r.rpush(canary_list, b"keep me")
    for key in (canary, canary_list, "unprefixed-canary-" + other.prefix):
        out.append(Poison(f"side key outside the run ({key})", {b"gen": b"poison-gen", b"gid": pid.encode(),
                                                                b"ref": key.encode()}, "not a payload key"))  # fmt: skip
    return out


# ---- property-based mutations (hypothesis draws every choice) ------------------------------------------
def _nodes(t: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every value in a decoded msgpack tree (containers included)."""
    out = [path]
    if isinstance(t, dict):
        for k, v in t.items():
            out += _nodes(v, (*path, k))
    elif isinstance(t, list):
        for i, v in enumerate(t):
            out += _nodes(v, (*path, i))
    return out


def _arrays(t: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every ``[dtype, shape, bytes]`` array in the tree."""
    if isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and isinstance(t[2], bytes):
        return [path]
    out: list[tuple[Any, ...]] = []
    items = t.items() if isinstance(t, dict) else enumerate(t) if isinstance(t, list) else []
    for k, v in items:
        out += _arrays(v, (*path, k))
    return out


def _get(t: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        t = t[p]
    return t


def _set(t: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(t, path[:-1])[path[-1]] = value
    return t


MUTATIONS = ("leaf", "element", "shape", "byte", "truncate")


def mutate(data: bytes, draw: Any) -> bytes:
    """One mutation of an encoded record, every choice drawn with ``draw`` (hypothesis' ``data.draw``):
    a value anywhere replaced by another of any type, an array element set to any integer (ids, experts,
    versions), an array shape changed, a byte flipped, or the record cut short."""
    from hypothesis import strategies as st

    kind = draw(st.sampled_from(MUTATIONS))
    if kind == "byte":
        i = draw(st.integers(0, len(data) - 1))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    t = msgspec.msgpack.decode(data)
    if kind == "leaf":
        path = draw(st.sampled_from(_nodes(t)))
        value = draw(st.one_of(
            st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
            st.text(max_size=6), st.binary(max_size=24), st.lists(st.integers(-5, 70_000), max_size=4),
            st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**64 - 1), max_size=2),
        ))  # fmt: skip
        t = _set(t, path, value)
    else:
        path = draw(st.sampled_from(_arrays(t)))
        dt, shape, raw = _get(t, path)
        if kind == "shape" and shape:
            shape = list(shape)
            shape[draw(st.integers(0, len(shape) - 1))] = draw(st.integers(-3, 2**40))
            _set(t, path, [dt, shape, raw])
        elif kind == "element":
            a = np.frombuffer(raw, dtype=dt).copy()
            if a.size:
                value = draw(st.integers(-70_000, 70_000))
                a[draw(st.integers(0, a.size - 1))] = np.array(value).astype(a.dtype)
            _set(t, path, [dt, shape, a.tobytes()])
    return msgspec.msgpack.encode(t)
