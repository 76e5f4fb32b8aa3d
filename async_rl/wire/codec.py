"""What every wire record shares: arrays as ``[dtype, shape, raw little-endian bytes]``, the checks that
bound what a decoder allocates, and :class:`WireError`, which names the bad field (see :mod:`async_rl.wire`)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

# Metadata is a few flat fields (task, answer, timings); 32 levels is far beyond any real use and far below the
# interpreter's recursion limit, so a hostile record nested 100,000 deep is refused before it can recurse.
MAX_META_DEPTH = 32

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
U8 = np.dtype("|u1")
I16 = np.dtype("<i2")
_DTYPES_BY_STR = {d.str: d for d in (I32, F32, U8, I16)}


class WireError(ValueError):
    """A record cannot be encoded or decoded; the message names the field."""

    __module__ = "async_rl.wire"  # its public name, which dead letters record


class Arr(msgspec.Struct, array_like=True):
    dt: str
    shape: list[int]
    data: memoryview


class _Header(msgspec.Struct):
    v: int


ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(_Header)


def to_wire(a: Any, path: str, allowed: tuple[np.dtype, ...], ndim: int) -> Arr:
    if not isinstance(a, np.ndarray):
        raise WireError(f"{path} must be a numpy array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise WireError(f"{path} must have {ndim} dimension(s), got shape {tuple(a.shape)}")
    if a.dtype.newbyteorder("<") not in allowed and a.dtype not in allowed:
        names = " or ".join(d.name for d in allowed)
        raise WireError(f"{path} must be {names}, got {a.dtype}")
    le = a.dtype.newbyteorder("<")
    if a.dtype != le:  # big-endian input: convert, the wire is little-endian
        a = a.astype(le)
    a = np.ascontiguousarray(a)
    return Arr(le.str, list(a.shape), a.data.cast("B") if a.size else memoryview(b""))


def from_wire(w: Arr, path: str, allowed: tuple[np.dtype, ...], ndim: int) -> np.ndarray:
    dt = _DTYPES_BY_STR.get(w.dt)
    if dt is None or dt not in allowed:
        names = " or ".join(d.name for d in allowed)
        raise WireError(f"{path} must be {names}, got dtype {w.dt!r}")
    if len(w.shape) != ndim:
        raise WireError(f"{path} must have {ndim} dimension(s), got shape {tuple(w.shape)}")
    if any(s < 0 for s in w.shape):
        raise WireError(f"{path} has a negative dimension in shape {tuple(w.shape)}")
    expect = math.prod(w.shape) * dt.itemsize
    if len(w.data) != expect:
        raise WireError(f"{path}: shape {tuple(w.shape)} of {dt.name} needs {expect} bytes, got {len(w.data)}")
    return np.frombuffer(w.data, dtype=dt).reshape(w.shape)


def check_str(value: Any, path: str, allow_empty: bool = False) -> None:
    if not isinstance(value, str):
        raise WireError(f"{path} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise WireError(f"{path} must not be empty")


def check_finite_number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise WireError(f"{path} must be a number, got {type(value).__name__}")
    f = float(value)
    if not math.isfinite(f):
        raise WireError(f"{path} must be finite, got {f}")
    return f


def check_meta(meta: Any) -> None:
    if not isinstance(meta, dict):
        raise WireError(f"metadata must be a dict, got {type(meta).__name__}")
    for k in meta:
        if not isinstance(k, str):
            raise WireError(f"metadata keys must be strings, got {k!r}")
    check_depth(meta, "metadata")


def check_depth(value: Any, path: str) -> None:
    """Containers nested at most :data:`MAX_META_DEPTH` deep (iterative: deep input cannot recurse here)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_META_DEPTH:
            raise WireError(f"{path} is nested more than {MAX_META_DEPTH} levels deep")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values() if isinstance(x, (dict, list, tuple)))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list, tuple)))


def _version_of(data: bytes | bytearray | memoryview) -> int | None:
    try:
        return _HEADER_DECODER.decode(data).v
    except (msgspec.DecodeError, ValueError):
        return None


def decode_struct(decoder: Any, data: Any, what: str, schema: str, expected: tuple[int, ...]) -> Any:
    """Decode ``data`` with ``decoder``; every failure becomes a WireError naming what and why."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{what} must be bytes, got {type(data).__name__}")
    try:
        w = decoder.decode(data)
    except msgspec.ValidationError as exc:
        v = _version_of(data)
        if v is not None and v not in expected:
            raise WireError(f"unknown {schema} version {v} (this code reads {versions_text(expected)})") from exc
        raise WireError(f"malformed {what}: {exc}") from exc
    except (msgspec.DecodeError, ValueError) as exc:  # ValueError: e.g. a string that is not UTF-8
        raise WireError(f"{what} is not valid msgpack: {exc}") from exc
    except RecursionError as exc:  # msgspec's own guard; the depth check below is the tighter bound
        raise WireError(f"{what}: metadata is nested more than {MAX_META_DEPTH} levels deep") from exc
    if w.v not in expected:
        raise WireError(f"unknown {schema} version {w.v} (this code reads {versions_text(expected)})")
    check_depth(w.meta, "metadata")
    return w


def versions_text(expected: tuple[int, ...]) -> str:
    return " and ".join(str(v) for v in expected)
