"""The wire codec: round trips of every field, zero-copy decoding, and errors that name the field."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_rl import wire
from async_rl.wire import PromptSpec, WireError, compact_routes, decode_group, encode_group, encode_group_into
from async_rl.wire.sampling import Sampling
from async_rl.wire.types import FINISH_REASONS, SCHEMA_VERSION, GroupRecord, Sample


def _sample(n: int = 6, p: int = 4, routes: bool = True, versions: np.ndarray | None = None, **kw) -> Sample:
    rng = np.random.default_rng(n)
    args = dict(
        response_ids=rng.integers(0, 1000, n, dtype=np.int32),
        logprobs=-rng.random(n).astype(np.float32),
        versions=np.arange(n, dtype=np.int32) if versions is None else versions,
        reward=0.5,
        finish_reason="stop",
        routes=rng.integers(0, 60, (p + n - 1, 3, 2)).astype(np.uint8) if routes else None,
        reward_info={"correct": 1.0},
    )
    args.update(kw)
    return Sample(**args)


def _record(samples: list[Sample] | None = None, p: int = 4, **kw) -> GroupRecord:
    args = dict(
        group_id="g-1",
        prompt_id="p-1",
        generator_id="gen-0",
        created_at=1234.5,
        prompt_ids=np.arange(p, dtype=np.int32),
        samples=samples if samples is not None else [_sample(p=p), _sample(n=3, p=p)],
        metadata={"task": "add", "nested": {"a": [1, 2]}},
    )
    args.update(kw)
    return GroupRecord(**args)


def _assert_same(a: GroupRecord, b: GroupRecord) -> None:
    assert (a.group_id, a.prompt_id, a.generator_id, a.created_at) == (
        b.group_id,
        b.prompt_id,
        b.generator_id,
        b.created_at,
    )
    assert a.metadata == b.metadata and a.schema_version == b.schema_version
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples, strict=True):
        for name in ("response_ids", "logprobs", "versions"):
            u, v = getattr(x, name), getattr(y, name)
            assert u.dtype == v.dtype and u.shape == v.shape
            np.testing.assert_array_equal(u, v)
        assert (x.reward, x.finish_reason, x.reward_info) == (y.reward, y.finish_reason, y.reward_info)
        if x.routes is None:
            assert y.routes is None
        else:
            assert y.routes is not None and x.routes.dtype == y.routes.dtype
            np.testing.assert_array_equal(x.routes, y.routes)
        np.testing.assert_array_equal(x.model_token_mask(), y.model_token_mask())


def test_roundtrip_every_field_and_zero_copy():
    rec = _record()
    data = encode_group(rec)
    out = decode_group(data)
    _assert_same(rec, out)
    routes = out.samples[0].routes
    assert routes is not None and not routes.flags.writeable
    assert routes.base is not None  # a view into the received bytes, not a copy
    assert out.min_version == 0 and out.num_tokens == 9


def test_int16_routes_dense_samples_and_empty_response():
    samples = [
        _sample(routes=False),
        _sample(n=0, routes=False, versions=np.zeros(0, np.int32)),
    ]
    _assert_same(_record(samples), decode_group(encode_group(_record(samples))))
    wide = _sample(routes=False)
    wide.routes = np.full((9, 3, 2), 300, dtype=np.int16)
    out = decode_group(encode_group(_record([wide])))
    assert out.samples[0].routes is not None and out.samples[0].routes.dtype == np.int16


def test_versions_run_length_encoded_when_shorter():
    const = _sample(n=100, versions=np.full(100, 7, np.int32), routes=False)
    varied = _sample(n=5, routes=False)
    data = encode_group(_record([const, varied]))
    raw = msgspec.msgpack.decode(data)
    assert raw["samples"][0]["ver"] is None and raw["samples"][0]["ver_runs"] is not None
    assert raw["samples"][1]["ver"] is not None and raw["samples"][1]["ver_runs"] is None
    out = decode_group(data)
    np.testing.assert_array_equal(out.samples[0].versions, np.full(100, 7, np.int32))
    assert len(data) < 100 * 4 + 100 * 4 + 100 * 4  # versions did not travel as 400 bytes


def test_encode_into_reused_buffer_matches():
    rec = _record()
    buf = bytearray()
    for _ in range(2):
        view = encode_group_into(rec, buf)
        assert bytes(view) == encode_group(rec)
        view.release()


def test_big_endian_input_is_converted():
    s = _sample(routes=False)
    s.logprobs = s.logprobs.astype(">f4")
    out = decode_group(encode_group(_record([s])))
    assert out.samples[0].logprobs.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(out.samples[0].logprobs, s.logprobs)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda r: setattr(r.samples[1], "logprobs", r.samples[1].logprobs.astype(np.float64)),
            r"samples\[1\]\.logprobs must be float32",
        ),
        (
            lambda r: setattr(r.samples[0], "response_ids", r.samples[0].response_ids.astype(np.int64)),
            r"samples\[0\]\.response_ids must be int32",
        ),
        (
            lambda r: setattr(r.samples[0], "logprobs", r.samples[0].logprobs[:-1]),
            r"samples\[0\]\.logprobs has 5 entries but response_ids has 6",
        ),
        (
            lambda r: setattr(r.samples[1], "versions", r.samples[1].versions[:2]),
            r"samples\[1\]\.versions has 2 entries",
        ),
        (lambda r: r.samples[0].logprobs.__setitem__(2, np.nan), r"samples\[0\]\.logprobs\[2\] is not finite"),
        (lambda r: r.samples[0].logprobs.__setitem__(0, -np.inf), r"samples\[0\]\.logprobs\[0\] is not finite"),
        (
            lambda r: setattr(r.samples[0], "routes", np.zeros((11, 3, 2), np.uint8)),
            r"samples\[0\]\.routes covers 11 tokens but the sequence has 4 \+ 6",
        ),
        (
            lambda r: setattr(r.samples[0], "routes", np.zeros((9, 3, 2), np.int32)),
            r"samples\[0\]\.routes must be uint8 or int16",
        ),
        (
            lambda r: setattr(r.samples[0], "routes", np.zeros((9, 6), np.uint8)),
            r"samples\[0\]\.routes must have 3 dimension",
        ),
        (
            lambda r: setattr(r.samples[1], "routes", np.zeros((5, 4, 2), np.uint8)),
            r"samples\[1\]\.routes has \[moe_layers, top_k\] = \[4, 2\]",
        ),
        (lambda r: setattr(r.samples[0], "finish_reason", "eos"), r"samples\[0\]\.finish_reason must be one of"),
        (lambda r: setattr(r.samples[0], "reward", float("nan")), r"samples\[0\]\.reward must be finite"),
        (
            lambda r: setattr(r.samples[0], "reward_info", {"x": float("inf")}),
            r"samples\[0\]\.reward_info\['x'\] must be finite",
        ),
        (lambda r: setattr(r.samples[0], "versions", -np.ones(6, np.int32)), r"samples\[0\]\.versions must be >= 0"),
        (lambda r: setattr(r, "prompt_ids", [1, 2, 3]), r"prompt_ids must be a numpy array"),
        (lambda r: setattr(r, "group_id", ""), r"group_id must not be empty"),
        (lambda r: setattr(r, "samples", []), r"samples must be a non-empty list"),
        (lambda r: setattr(r, "created_at", math.inf), r"created_at must be finite"),
        (lambda r: setattr(r, "metadata", {"obj": object()}), r"metadata is not msgpack-encodable"),
        (lambda r: setattr(r, "schema_version", 99), r"schema_version 99"),
        (lambda r: setattr(r, "metadata", {1: "x"}), r"metadata keys must be strings, got 1"),
    ],
)
def test_encode_errors_name_the_field(mutate, message):
    rec = _record()
    mutate(rec)
    with pytest.raises(WireError, match=message):
        encode_group(rec)


def _tamper(path: list, value) -> bytes:
    raw = msgspec.msgpack.decode(encode_group(_record()))
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["v"], 3, "unknown schema version 3 \\(this code reads 1 and 2\\)"),
        (["samples", 0, "lp", 0], "<f8", r"samples\[0\]\.logprobs must be float32, got dtype '<f8'"),
        (["samples", 0, "ids", 1], [7], r"samples\[0\]\.response_ids: shape \(7,\) of int32 needs 28 bytes, got 24"),
        (["samples", 1, "routes", 0], "<i4", r"samples\[1\]\.routes must be uint8 or int16"),
        (["samples", 0, "fin"], "done", r"samples\[0\]\.finish_reason must be one of"),
        (
            ["samples", 0, "lp", 2],
            np.full(6, np.inf, np.float32).tobytes(),
            r"samples\[0\]\.logprobs\[0\] is not finite",
        ),
        (["samples", 0, "ver"], None, r"exactly one of 'ver' and 'ver_runs'"),
        (["samples", 0, "rw"], "high", r"malformed group record.*samples\[0\]\.rw"),
        (["samples"], [], "samples must not be empty"),
        (["gid"], "", "group_id must not be empty"),
        (["extra"], 1, "malformed group record"),
    ],
)
def test_decode_errors_name_the_field(path, value, message):
    with pytest.raises(WireError, match=message):
        decode_group(_tamper(path, value))


def test_decode_garbage_and_wrong_types():
    with pytest.raises(WireError, match="not valid msgpack"):
        decode_group(b"\xc1\xc1\xc1")
    with pytest.raises(WireError, match="must be bytes"):
        decode_group("text")  # type: ignore[arg-type]
    data = encode_group(_record())
    with pytest.raises(WireError):
        decode_group(data[: len(data) // 2])
    with pytest.raises(WireError, match="unknown schema version 3"):
        decode_group(msgspec.msgpack.encode({"v": 3, "whatever": [1, 2]}))


def test_compact_routes():
    assert compact_routes(np.array([[[1, 255]]], dtype=np.int64)).dtype == np.uint8
    assert compact_routes(np.array([[[1, 256]]], dtype=np.int64)).dtype == np.int16
    with pytest.raises(WireError, match="negative expert id"):
        compact_routes(np.array([[[-1]]]))
    with pytest.raises(WireError, match="does not fit int16"):
        compact_routes(np.array([[[40_000]]]))
    with pytest.raises(WireError, match=r"\[tokens, moe_layers, top_k\]"):
        compact_routes(np.zeros((3, 2)))


def test_prompt_spec_roundtrip_and_errors():
    spec = PromptSpec("p-9", np.array([5, 6, 7], dtype=np.int32), {"answer": "12", "n": 3})
    out = PromptSpec.decode(spec.encode())
    assert out.prompt_id == "p-9" and out.metadata == spec.metadata
    np.testing.assert_array_equal(out.prompt_ids, spec.prompt_ids)
    with pytest.raises(WireError, match="prompt_ids must be int32"):
        PromptSpec("p", np.array([1], dtype=np.int64)).encode()
    with pytest.raises(WireError, match="prompt_id must not be empty"):
        PromptSpec("", np.array([1], dtype=np.int32)).encode()
    bad = msgspec.msgpack.decode(spec.encode())
    bad["v"] = 5
    with pytest.raises(WireError, match="unknown prompt schema version 5"):
        wire.decode_prompt(msgspec.msgpack.encode(bad))


def test_prompt_min_version_round_trips_and_is_checked():
    spec = PromptSpec("p-1", np.array([5, 6], dtype=np.int32), min_version=7)
    assert PromptSpec.decode(spec.encode()).min_version == 7
    assert PromptSpec.decode(PromptSpec("p-2", np.array([5], dtype=np.int32)).encode()).min_version == -1
    bad = msgspec.msgpack.decode(spec.encode())
    bad["mv"] = -3
    with pytest.raises(WireError, match="min_version must be >= -1, got -3"):
        wire.decode_prompt(msgspec.msgpack.encode(bad))


def test_sampling_on_the_wire_carries_the_token_mask_switch():
    off = Sampling(n=4, mask_special_tokens=False)
    assert Sampling.from_wire(off.to_wire()) == off and Sampling().mask_special_tokens
    with pytest.raises(ValueError, match="sampling.mask_special_tokens must be a bool, got 1"):
        Sampling.from_wire({"mask_special_tokens": 1})
    with pytest.raises(ValueError, match="sampling.n must be a int, got True"):
        Sampling.from_wire({"n": True})


# ---- property tests ------------------------------------------------------------------------


def _array(draw, n: int, dtype: str) -> np.ndarray:
    """n values of ``dtype`` from raw bytes (fast to draw, every bit pattern possible)."""
    size = np.dtype(dtype).itemsize * n
    return np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=dtype).copy()


@st.composite
def _records(draw) -> GroupRecord:
    p = draw(st.integers(0, 12))
    layers = draw(st.integers(1, 4))
    top_k = draw(st.integers(1, 3))
    route_dtype = draw(st.sampled_from(["<u1", "<i2"]))
    samples = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 20))
        lp = _array(draw, n, "<f4")
        lp[~np.isfinite(lp)] = -1.0
        # versions: a few runs (travel run-length encoded) or arbitrary (travel plain)
        ver = np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=np.int32)
        if draw(st.booleans()):
            ver = np.sort(ver)
        routes = None
        if draw(st.booleans()) and p + n > 0:
            t = draw(st.integers(0, p + n))
            routes = _array(draw, t * layers * top_k, route_dtype).reshape(t, layers, top_k)
            if route_dtype == "<i2":
                routes &= 0x7FFF  # expert ids are >= 0
        mask = None
        if draw(st.booleans()) and n:  # an episode's loss mask (all ones travels as none: the same sample)
            mask = np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype=np.uint8)
        samples.append(
            Sample(
                loss_mask=mask,
                response_ids=_array(draw, n, "<i4"),
                logprobs=lp,
                versions=ver,
                reward=draw(st.floats(allow_nan=False, allow_infinity=False)),
                finish_reason=draw(st.sampled_from(FINISH_REASONS)),
                routes=routes,
                reward_info=draw(
                    st.dictionaries(st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False), max_size=3)
                ),
            )
        )
    meta_values = st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.booleans(), st.none())
    return GroupRecord(
        group_id=draw(st.text(min_size=1, max_size=20)),
        prompt_id=draw(st.text(min_size=1, max_size=20)),
        generator_id=draw(st.text(max_size=10)),
        created_at=draw(st.floats(allow_nan=False, allow_infinity=False)),
        prompt_ids=_array(draw, p, "<i4"),
        samples=samples,
        metadata=draw(st.dictionaries(st.text(max_size=5), meta_values, max_size=3)),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_records())
def test_property_roundtrip(rec):
    data = encode_group(rec)
    out = decode_group(data)
    _assert_same(rec, out)
    assert encode_group(out) == data  # decoding loses nothing that encoding wrote
    assert out.schema_version == SCHEMA_VERSION


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_property_garbage_never_escapes_as_other_errors(data):
    try:
        decode_group(data)
    except WireError:
        pass


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_records(), st.data())
def test_property_single_byte_corruption_is_caught_or_harmless(rec, data):
    blob = bytearray(encode_group(rec))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] ^= data.draw(st.integers(1, 255))
    try:
        out = decode_group(bytes(blob))
    except WireError:
        return
    # Corruption inside a payload (token ids, logprobs, strings) may decode; it must still be valid.
    encode_group(out)


# ---- loss masks (schema version 2) ---------------------------------------------------------
def test_loss_mask_round_trips_and_all_ones_travels_as_none():
    mask = np.array([1, 1, 0, 0, 1, 1], dtype=np.uint8)
    rec = _record([_sample(loss_mask=mask), _sample(loss_mask=np.ones(6, dtype=bool)), _sample()])
    out = decode_group(encode_group(rec))
    assert out.schema_version == SCHEMA_VERSION == 2
    np.testing.assert_array_equal(out.samples[0].loss_mask, mask)
    assert out.samples[0].loss_mask.dtype == np.uint8
    assert out.samples[1].loss_mask is None and out.samples[2].loss_mask is None  # all the model's: left out
    np.testing.assert_array_equal(out.samples[0].model_token_mask(), mask.astype(bool))
    assert out.samples[2].model_token_mask().all()


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (np.ones(5, np.uint8), r"samples\[0\]\.loss_mask has 5 entries but response_ids has 6"),
        (np.array([1, 2, 0, 0, 1, 1], np.uint8), r"samples\[0\]\.loss_mask\[1\] must be 0 or 1, got 2"),
        (np.ones(6, np.int32), r"samples\[0\]\.loss_mask must be uint8"),
        (np.ones((6, 1), np.uint8), r"samples\[0\]\.loss_mask must have 1 dimension"),
    ],
)
def test_bad_loss_mask_is_refused_on_encode_and_decode(mask, message):
    with pytest.raises(WireError, match=message):
        encode_group(_record([_sample(loss_mask=mask)]))
    if mask.ndim == 1 and mask.dtype == np.uint8:  # the same bytes arriving from a foreign writer
        raw = msgspec.msgpack.decode(encode_group(_record([_sample(loss_mask=np.zeros(6, np.uint8))])))
        raw["samples"][0]["mask"] = ["|u1", [mask.size], mask.tobytes()]
        with pytest.raises(WireError, match=message):
            decode_group(msgspec.msgpack.encode(raw))


def test_version_1_records_still_decode_and_cannot_carry_a_mask():
    """A record written before loss masks existed (schema 1) reads as all-model tokens; one that claims version 1
    yet carries a mask is refused by name, and a version a reader does not know is refused by its number."""
    raw = msgspec.msgpack.decode(encode_group(_record()))
    raw["v"] = 1
    out = decode_group(msgspec.msgpack.encode(raw))
    assert out.schema_version == 1 and all(s.loss_mask is None for s in out.samples)
    assert decode_group(encode_group(out)).schema_version == SCHEMA_VERSION  # rewritten at the current version
    raw["samples"][0]["mask"] = ["|u1", [6], bytes(6)]
    with pytest.raises(WireError, match=r"samples\[0\]\.loss_mask: schema version 1 has no loss mask"):
        decode_group(msgspec.msgpack.encode(raw))


def test_min_version_ignores_empty_responses():
    empty = _sample(n=0, routes=False, versions=np.zeros(0, np.int32))
    assert _record([_sample(routes=False, versions=np.full(6, 5, np.int32)), empty]).min_version == 5
    assert _record([empty]).min_version == 0
