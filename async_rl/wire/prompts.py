"""Prompt entries on the prompt stream: :class:`PromptSpec`, :func:`encode_prompt` and :func:`decode_prompt`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from async_rl.wire.codec import ENCODER, I32, Arr, WireError, check_meta, check_str, decode_struct, from_wire, to_wire
from async_rl.wire.sampling import Sampling

PROMPT_SCHEMA_VERSION = 1


class _PromptW(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    pid: str
    ids: Arr
    meta: dict[str, Any] = {}
    s: dict[str, Any] | None = None
    mv: int = -1


_PROMPT_DECODER = msgspec.msgpack.Decoder(_PromptW)


@dataclass(slots=True)
class PromptSpec:
    """One prompt issued to generators: an id, its token ids and small extras (task, answer...)."""

    prompt_id: str
    """Stable id of the prompt (the same across retries)."""
    prompt_ids: np.ndarray
    """int32 ``[P]`` prompt token ids."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """msgpack-able extras the scorer needs (task name, reference answer...)."""
    sampling: Sampling | None = None
    """How to sample this prompt's group (the learner's); None: the generator's own default."""
    min_version: int = -1
    """The oldest weight version a generator may sample it with (-1: any). The learner sets it to its version in
    synchronous mode (``staleness.sync``): generators wait for that version before they generate."""

    def encode(self) -> bytes:
        return encode_prompt(self)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> PromptSpec:
        return decode_prompt(data)


def encode_prompt(spec: PromptSpec) -> bytes:
    """Validate and encode a :class:`PromptSpec`."""
    if not isinstance(spec, PromptSpec):
        raise WireError(f"encode_prompt expects a PromptSpec, got {type(spec).__name__}")
    check_str(spec.prompt_id, "prompt_id")
    check_meta(spec.metadata)
    ids = to_wire(spec.prompt_ids, "prompt_ids", (I32,), 1)
    try:
        sampling = None if spec.sampling is None else spec.sampling.to_wire()
        return ENCODER.encode(_PromptW(v=PROMPT_SCHEMA_VERSION, pid=spec.prompt_id, ids=ids, meta=spec.metadata,
                                        s=sampling, mv=spec.min_version))  # fmt: skip
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"metadata is not msgpack-encodable: {exc}") from exc


def decode_prompt(data: bytes | bytearray | memoryview) -> PromptSpec:
    """Decode and validate a prompt entry; ``prompt_ids`` is a read-only view into ``data``."""
    w = decode_struct(_PROMPT_DECODER, data, "prompt entry", "prompt schema", (PROMPT_SCHEMA_VERSION,))
    check_str(w.pid, "prompt_id")
    try:
        sampling = None if w.s is None else Sampling.from_wire(w.s)
    except ValueError as exc:
        raise WireError(f"prompt {w.pid!r}: {exc}") from None
    if w.mv < -1:
        raise WireError(f"prompt {w.pid!r}: min_version must be >= -1, got {w.mv}")
    return PromptSpec(prompt_id=w.pid, prompt_ids=from_wire(w.ids, "prompt_ids", (I32,), 1), metadata=w.meta,
                      sampling=sampling, min_version=w.mv)  # fmt: skip
